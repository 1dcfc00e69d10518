"""`dsv3 train --init-from` on a checkpoint with one NaN weight stops with a message naming the tensor and the
shard instead of training to `loss nan`; `--allow-non-finite` lets it load (and the loss shows the NaN)."""

import json
import os
import re
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
NORM = "model.layers.0.input_layernorm.weight"


def _env():
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


@pytest.mark.dist
def test_train_init_from_refuses_nan_weight_unless_allowed(tmp_path):
    from test_checkpoint_nonfinite import make_loadable_fp8_ckpt
    from test_checkpoint_reader import _rewrite, _shard_of

    ck = make_loadable_fp8_ckpt(tmp_path / "ck")
    fn = _shard_of(ck, NORM)

    def poison(d):
        t = d[NORM].clone()
        t[3] = float("nan")
        d[NORM] = t

    _rewrite(ck, fn, poison)
    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 1,
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                "dsv3": {"preset": "tiny", "train": {"seq_len": 16, "steps": 1}},
            }
        )
    )
    from helpers import dsv3_cli

    cmd = ["train", "--config", str(cfg), "--nproc", "1", "--init-from", ck, "--no-progress", "--json"]
    p = dsv3_cli(*cmd, "--out", str(tmp_path / "a"), env=_env())
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert re.search(
        re.escape(NORM) + " in " + re.escape(os.path.join(ck, fn)) + r": 1 NaN among 64 values", p.stderr
    ), p.stderr[-3000:]
    assert "--allow-non-finite" in p.stderr and not p.stdout.strip(), p.stdout[-2000:]

    q = dsv3_cli(*cmd, "--out", str(tmp_path / "b"), "--allow-non-finite", env=_env())
    assert q.returncode == 0, q.stderr[-3000:]
    row = json.loads(q.stdout.strip().splitlines()[0])
    assert row["step"] == 1 and row["loss"] is None  # a non-finite value is written as JSON null
    shutil.rmtree(tmp_path / "b", ignore_errors=True)
