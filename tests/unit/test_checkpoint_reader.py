"""Released-format reader: FP8 block dequantization (exact vs DeepSeek's formula) and corrupt-input errors."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv3_plugin.checkpoint.reader import (
    CheckpointReader,
    dequantize_fp8_blockwise,
    dequantize_fp8_reference,
    read_safetensors_header,
)
from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise, write_released_checkpoint
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.errors import CheckpointError


def tiny_hf_cfg(**over):
    cfg = DSv3Config.from_block({"preset": "tiny"}).to_hf()
    cfg.update(over)
    return cfg


def make_fp8_ckpt(path, shard_bytes=40_000, block=(32, 32), seed=0, cfg=None):
    g = torch.Generator().manual_seed(seed)
    write_released_checkpoint(
        str(path),
        cfg or tiny_hf_cfg(),
        lambda n, s: torch.randn(s, generator=g) * 0.05,
        shard_bytes=shard_bytes,
        block=block,
    )
    return str(path)


def _formula(w_fp8, s, block):
    """DeepSeek's README formula elementwise: w[i, j] = float(w_fp8[i, j]) * s[i // b0, j // b1]."""
    O, I = w_fp8.shape
    ii = torch.arange(O)[:, None] // block[0]
    jj = torch.arange(I)[None, :] // block[1]
    return w_fp8.float() * s[ii, jj]


@pytest.mark.parametrize("shape", [(576, 200), (5, 7), (300, 1100), (128, 256), (1100, 1030)])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_blockwise_dequant_is_bit_exact(shape, fp8):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 4).to(fp8)
    # every finite byte pattern at least once (subnormals, both signs, the largest exponents)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F] if fp8 == torch.float8_e4m3fn else codes[(codes & 0x7C) != 0x7C]
    flat = w.view(torch.uint8).view(-1)
    flat[: min(codes.numel(), flat.numel())] = codes[: flat.numel()]
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    s = torch.rand(grid, generator=g) * 1e-2 + 1e-4
    ref32 = _formula(w, s, (128, 128))
    assert torch.equal(dequantize_fp8_reference(w, s, dtype=torch.float32), ref32)
    assert torch.equal(dequantize_fp8_blockwise(w, s, dtype=torch.float32), ref32)
    assert torch.equal(dequantize_fp8_blockwise(w, s, dtype=torch.bfloat16), ref32.to(torch.bfloat16))


def test_dequant_rejects_wrong_grid():
    w = torch.zeros(576, 200).to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"w_scale_inv: scale grid \[4, 2\].*expected \[5, 2\]"):
        dequantize_fp8_blockwise(w, torch.ones(4, 2), name="w")


def test_quantize_roundtrip_is_close():
    w = torch.randn(576, 200) * 0.1
    q, s = quantize_fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2)
    back = dequantize_fp8_blockwise(q, s, dtype=torch.float32)
    assert (back - w).abs().max() <= w.abs().max() * 2**-3  # E4M3 keeps 3 mantissa bits


def test_reader_sharded_fp8(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    r = CheckpointReader(path)
    assert len(r.files()) > 1 and r.is_quantized()
    names = r.names()
    assert not any(n.endswith("_scale_inv") for n in names)
    # detection is by dtype: eh_proj and the router are stored BF16 in the release and stay unquantized
    assert not r.is_fp8("model.layers.3.eh_proj.weight") and not r.is_fp8("model.layers.1.mlp.gate.weight")
    kv = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 40 rows: a ragged 32-row block
    assert r.is_fp8(kv) and r.raw(kv + "_scale_inv").shape == (2, 2)
    w = r.get(kv, torch.float32)
    assert torch.equal(w, _formula(r.raw(kv), r.raw(kv + "_scale_inv"), (32, 32)))
    assert r.get(kv).dtype == torch.bfloat16
    assert r.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32


def _rewrite(path, fn, edit):
    """Load one shard, let `edit(dict)` change it, save it back (index untouched)."""
    p = os.path.join(path, fn)
    d = load_file(p)
    edit(d)
    save_file(d, p, metadata={"format": "pt"})


def _shard_of(path, name):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)["weight_map"][name]


KV = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


def test_missing_scale(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(path, KV)

    def drop(d):
        del d[KV + "_scale_inv"]

    _rewrite(path, fn, drop)
    idx = os.path.join(path, "model.safetensors.index.json")
    with open(idx) as f:
        j = json.load(f)
    del j["weight_map"][KV + "_scale_inv"]
    with open(idx, "w") as f:
        json.dump(j, f)
    with pytest.raises(CheckpointError, match=re.escape(KV) + r" in .*" + re.escape(fn) + r": FP8 weight without"):
        CheckpointReader(path)


def test_wrong_grid(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(path, KV)
    _rewrite(path, fn, lambda d: d.__setitem__(KV + "_scale_inv", torch.ones(1, 2)))
    with pytest.raises(
        CheckpointError,
        match=re.escape(KV + "_scale_inv") + r" in .*" + re.escape(fn) + r": scale grid \[1, 2\].*expected \[2, 2\]",
    ):
        CheckpointReader(path)


def test_dtype_surprise_and_orphan_scale(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    name = "model.layers.0.input_layernorm.weight"
    fn = _shard_of(path, name)
    _rewrite(path, fn, lambda d: d.__setitem__(name, torch.zeros(64, dtype=torch.int8)))
    with pytest.raises(CheckpointError, match=re.escape(name) + r" in .*" + re.escape(fn) + r": unexpected dtype I8"):
        CheckpointReader(path)
    path2 = make_fp8_ckpt(tmp_path / "ck2")
    fn2 = _shard_of(path2, KV)

    def to_bf16(d):
        d[KV] = d[KV].to(torch.bfloat16)

    _rewrite(path2, fn2, to_bf16)
    with pytest.raises(CheckpointError, match=re.escape(KV + "_scale_inv") + r" in .*stored as BF16, not FP8"):
        CheckpointReader(path2)


def test_truncated_file(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(path, KV)
    p = os.path.join(path, fn)
    with open(p, "rb") as f:
        data = f.read()
    with open(p, "wb") as f:
        f.write(data[:-100])
    with pytest.raises(CheckpointError, match=re.escape(fn) + r": .*truncated safetensors"):
        CheckpointReader(path)
    with open(p, "wb") as f:
        f.write(data[:5])
    with pytest.raises(CheckpointError, match=re.escape(fn) + r": truncated safetensors file"):
        read_safetensors_header(p)


def test_index_points_to_missing_file(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(path, KV)
    os.remove(os.path.join(path, fn))
    with pytest.raises(CheckpointError, match=r"index .* points to missing file .*" + re.escape(fn)):
        CheckpointReader(path)


def test_index_and_file_disagree(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(path, KV)
    _rewrite(path, fn, lambda d: d.__setitem__("model.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"model\.extra\.weight in .*" + re.escape(fn) + ": unexpected tensor"):
        CheckpointReader(path)
    path2 = make_fp8_ckpt(tmp_path / "ck2")
    name = "model.layers.0.input_layernorm.weight"
    _rewrite(path2, _shard_of(path2, name), lambda d: d.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name) + r": listed in .*index.* does not hold it"):
        CheckpointReader(path2)


def test_single_file_and_missing_config(tmp_path):
    path = make_fp8_ckpt(tmp_path / "ck", shard_bytes=1 << 30)
    assert set(os.listdir(path)) == {"model.safetensors", "config.json"}
    r = CheckpointReader(path)
    assert r.files() == [os.path.join(path, "model.safetensors")] and r.is_fp8(KV)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="missing config.json"):
        CheckpointReader(path)
