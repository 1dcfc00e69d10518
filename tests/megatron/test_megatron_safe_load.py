"""`--load` of `python -m dsv3_plugin.megatron.pretrain_gpt` never unpickles code (patches/megatron_safe_load.py).

A real checkpoint is saved by the plugin's Megatron path (1 gloo rank, tiny model, torch_dist format, iteration 2).
Copies of it are then crafted, each with one file whose pickle would create a marker file when unpickled the way
torch / Megatron read it without the patch:
- `.metadata` (torch.distributed.checkpoint unpickles it with `pickle.load`);
- a byte item of `__0_0.distcp` (Megatron's `common_state`, which torch's load planner reads with
  `torch.load(weights_only=False)`): the payload appended to the file and `.metadata` pointed at it;
- a legacy `common.pt` beside them (megatron-core reads it with `torch.load` and torch's default);
- `model_optim_rng.pt` of a `--ckpt-format torch` checkpoint (Megatron's legacy loader, same).
The last two run with `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` (which turns torch's default unsafe; an explicit
`weights_only=True` is not overridden by it). Each `--load` must exit 2 with one line `error: <file>: refused to
unpickle ...` naming the crafted file, and the marker must not exist. The genuine checkpoint still resumes.

Needs megatron-core >= 0.19 (`megatron.training` in the wheel).
"""

import dataclasses
import json
import os
import pickle
import shutil
import sys

import pytest
from helpers import run_module, tiny_megatron_args

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training (Megatron's pretrain())")
pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = tiny_megatron_args(3, gbs=2, seq=16, lr="1e-3", cosine=False, seed=1)


class _Payload:
    """Unpickling this calls open(marker, "w"): the marker file appears if the payload ever runs."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(tmp, extra, env_extra=None):
    cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", "--nproc", "1"]
    cmd += ["--dsv3-config", str(tmp / "ds.json")] + FLAGS + extra
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return run_module(cmd, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("safe_load")
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    p = _run(tmp, ["--save", str(tmp / "ckpt"), "--save-interval", "2", "--exit-interval", "2"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert (tmp / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    return tmp


def _copy(tmp, name):
    dst = tmp / name
    shutil.copytree(tmp / "ckpt", dst)
    return dst, dst / "iter_0000002"


def _refused(tmp, ckpt, crafted, marker, extra=(), env_extra=None):
    p = _run(tmp, ["--load", str(ckpt), *extra], env_extra)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert not marker.exists(), f"the payload in {crafted} ran"
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-4000:]
    assert len(lines) == 1, p.stderr[-4000:]
    assert lines[0].startswith(f"error: {crafted}: refused to unpickle ("), lines[0]
    assert "successfully loaded checkpoint" not in p.stdout


def test_crafted_dcp_metadata_is_refused(saved):
    ckpt, it = _copy(saved, "metadata")
    marker = saved / "marker_metadata"
    (it / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _refused(saved, ckpt, it / ".metadata", marker)


def test_crafted_byte_item_in_distcp_is_refused(saved):
    from dsv3_plugin.checkpoint.megatron_dist import load_dcp_metadata

    ckpt, it = _copy(saved, "byte_item")
    marker = saved / "marker_byte_item"
    with open(it / ".metadata", "rb") as f:
        md = load_dcp_metadata(f)
    keys = [k for k in md.storage_data if k.fqn.startswith("common_state")]
    assert keys, sorted({k.fqn for k in md.storage_data})[:20]
    info = md.storage_data[keys[0]]
    distcp = it / info.relative_path
    offset = distcp.stat().st_size
    payload = pickle.dumps(_Payload(marker))
    with open(distcp, "ab") as f:
        f.write(payload)
    md.storage_data[keys[0]] = dataclasses.replace(info, offset=offset, length=len(payload))
    (it / ".metadata").write_bytes(pickle.dumps(md))  # only checkpoint-metadata classes: it reads back
    _refused(saved, ckpt, f"{it} (a byte item of its .distcp files)", marker)


@pytest.mark.long  # (make test-long)
def test_crafted_legacy_common_pt_is_refused(saved):
    ckpt, it = _copy(saved, "common_pt")
    marker = saved / "marker_common_pt"
    (it / "common.pt").write_bytes(pickle.dumps(_Payload(marker)))
    _refused(saved, ckpt, it / "common.pt", marker, env_extra={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"})


@pytest.mark.long  # (make test-long)
def test_crafted_legacy_model_optim_rng_pt_is_refused(saved):
    ckpt = saved / "legacy"
    f = ckpt / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    f.parent.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    marker = saved / "marker_legacy"
    f.write_bytes(pickle.dumps(_Payload(marker)))
    _refused(
        saved,
        ckpt,
        f,
        marker,
        extra=["--ckpt-format", "torch"],
        env_extra={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"},
    )


def test_genuine_checkpoint_still_resumes(saved):
    p = _run(saved, ["--load", str(saved / "ckpt")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert "successfully loaded checkpoint from" in p.stdout and "at iteration 2" in p.stdout
    assert "iteration        3/       3" in p.stdout


def test_patch_is_reversible_and_refuses_untested_versions(monkeypatch):
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from dsv3_plugin_patches import megatron_safe_load as patch

    before = (torch.load, FileSystemReader.read_metadata, FileSystemReader.read_data)
    assert patch.apply() and patch.is_applied() and not patch.apply()
    assert torch.load is not before[0] and FileSystemReader.read_metadata is not before[1]
    assert patch.revert() and not patch.is_applied()
    assert (torch.load, FileSystemReader.read_metadata, FileSystemReader.read_data) == before
    monkeypatch.setattr(patch, "_versions", lambda: {"megatron-core": "0.20.0", "torch": "2.13.0"})
    with pytest.raises(RuntimeError, match="megatron-core 0.20.0 untested"):
        patch.apply()
    assert not patch.is_applied() and torch.load is before[0]
