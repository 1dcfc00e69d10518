"""Issue 27 point 4 at the entry points not covered by tests/unit/test_checkpoint_nonfinite.py (which runs the reader,
`load_pretrained`, `dsv3 convert` and `dsv3 generate`): `dsv3 train --init-from`'s per-rank load
(`checkpoint.init_from.build_train_model`, the full build and the rank-local one) refuses a zero, negative or
subnormal `weight_scale_inv` block unless allowed; and a safetensors header declaring a tensor far larger than its
file is refused from the header alone, before any tensor is allocated.

Megatron's `--dsv3-init-from` reads released checkpoints through the same `CheckpointReader.get`
(`megatron.weights.load_hf_checkpoint`), which test_checkpoint_nonfinite checks; `dsv3 export` never reads a released
FP8 checkpoint (its sources are runs, Megatron-LM checkpoints and Megatron layouts, which hold no FP8 scales)."""

import json
import os
import re
import shutil
import struct

import pytest
import torch
from test_checkpoint_nonfinite import make_loadable_fp8_ckpt
from test_checkpoint_reader import KV, _rewrite, _shard_of

from dsv3_plugin.checkpoint.hf import pretrained_config
from dsv3_plugin.checkpoint.init_from import build_train_model
from dsv3_plugin.checkpoint.reader import CheckpointReader, read_safetensors_header
from dsv3_plugin.errors import CheckpointError


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return make_loadable_fp8_ckpt(tmp_path_factory.mktemp("sc") / "clean")


def _with_scale(clean, tmp_path, value) -> str:
    d = str(tmp_path / "src")
    shutil.copytree(clean, d)

    def edit(sd):
        s = sd[KV + "_scale_inv"].clone()
        s[1, 0] = value
        sd[KV + "_scale_inv"] = s

    _rewrite(d, _shard_of(d, KV), edit)
    return d


@pytest.mark.parametrize(
    "value, kind",
    [(0.0, "zero"), (-0.01, "negative"), (1e-40, r"subnormal \(< 1\.17549e-38\)")],
    ids=["zero", "negative", "subnormal"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["full-fp32", "rank-local-bf16"])
def test_init_from_refuses_a_bad_block_scale(clean, tmp_path, value, kind, dtype):
    d = _with_scale(clean, tmp_path, value)
    cfg = pretrained_config(d)  # headers only: the scale's value is not looked at before the load
    want = re.escape(f"{KV}_scale_inv in {os.path.join(d, _shard_of(d, KV))}") + f": 1 {kind} among 4 block scales"
    with pytest.raises(CheckpointError, match=want + r".*--allow-non-finite"):
        build_train_model(cfg, d, dtype=dtype)
    model = build_train_model(cfg, d, allow_non_finite=True, dtype=dtype)  # the opt-in loads it as it is
    assert all(torch.isfinite(p).all() for p in model.parameters() if not p.is_meta)


def test_header_declaring_a_huge_tensor_is_refused_before_allocation(clean, tmp_path):
    """A header entry with a consistent dtype/shape/offsets for 2**46 bytes in a file of a few KB: refused by the
    header check (which also catches overlaps and gaps), before anything is read or allocated."""
    d = str(tmp_path / "src")
    shutil.copytree(clean, d)
    p = os.path.join(d, _shard_of(d, KV))
    with open(p, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    last = max((k for k in hdr if k != "__metadata__"), key=lambda k: hdr[k]["data_offsets"][1])
    b = hdr[last]["data_offsets"][0]
    hdr[last] = {"dtype": "F32", "shape": [2**22, 2**22], "data_offsets": [b, b + 2**46]}
    new = json.dumps(hdr).encode()
    new += b" " * (-len(new) % 8)
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + body)
    want = re.escape(f"{last} in {p}: data ends at byte {b + 2**46} but the file holds {len(body)} data bytes")
    with pytest.raises(CheckpointError, match=want):
        read_safetensors_header(p)
    with pytest.raises(CheckpointError, match=want):
        CheckpointReader(d)
