"""`python -m benchmarks model --train`: the training-loop tax, measured through the real `dsv3 train` entry on 1
and 2 gloo ranks (torchrun's environment) against the bare step; tiny preset, a few steps. Only the report's
structure and that every timer saw its part run are checked, never a timing."""

import json
import math
import os
import subprocess
import sys

import pytest

from benchmarks import ROOT  # the checkout's root: the children run its `benchmarks` and `dsv3_plugin`

pytestmark = pytest.mark.dist


def test_train_tax_reports_every_part_of_both_runs():
    cmd = [sys.executable, "-m", "benchmarks", "model", "--train", "--json", "--preset", "tiny"]
    cmd += ["--seq-lens", "16", "--batch", "2", "--train-steps", "4", "--warmup", "1", "--fused-adamw"]
    cmd += ["--fp32-grad-norm"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(p.stdout)
    assert r["bench"] == "model --train" and r["config"] == {"batch": 2, "seq_len": 16, "steps": 4, "warmup": 1}
    assert r["optimizer"]["params"]["fused"] is True  # --fused-adamw: torch's fused kernel on both sides
    # memory.flat_grads (the default) took on every rank of both runs (FP32, pp = 1, ep = 1)
    assert r["flat_grads"] == {"asked": True, "applied": {"1rank": True, "2ranks": True}}
    # memory.chunked_step (the default) does not apply to torch's fused AdamW (no temporaries to avoid)
    assert r["chunked_step"] == {"asked": True, "applied": {"1rank": False, "2ranks": False}}
    assert r["grad_norm"] == "fp32"  # --fp32-grad-norm reached dsv3 train (the patch refuses it where it cannot)
    for key in ("train_1rank", "train_2ranks"):
        assert r[key]["steps"] == 4 and r[key]["tokens_per_s"] > 0 and r[key]["wall_s"] > 0
    assert r["train_2ranks"]["tokens_per_s_per_rank"] == r["train_2ranks"]["tokens_per_s"] / 2
    assert r["ours"] == r["train_1rank"]["tokens_per_s"] and r["baseline"] == r["bare"]["tokens_per_s"]
    assert math.isclose(r["tax_1rank"], r["baseline"] / r["ours"] - 1)
    assert math.isclose(r["tax_1rank_steady"], r["baseline"] / r["train_1rank"]["summary_tokens_per_s"] - 1)
    # the phases of the 1-rank run's DeepSpeed calls beside the bare step's: all timed, added = difference
    assert set(r["phases_1rank"]) == {"forward", "backward", "optimizer"}
    for ph in r["phases_1rank"].values():
        assert ph["bare_s"] > 0 and ph["dsv3_train_s"] > 0
        assert ph["added_s"] == ph["dsv3_train_s"] - ph["bare_s"]
    ranks = r["two_ranks"]["seconds_per_step"]
    assert len(ranks) == 2
    for parts in ranks:
        assert set(parts) == {"collectives", "bias_update", "telemetry", "save", "rest"}
        # every timed part ran on every rank: gradient / loss all-reduces, the bias update, telemetry, the last save
        assert all(parts[k] > 0 for k in ("collectives", "bias_update", "telemetry", "save")), parts


def _refused(*args):
    """`python -m benchmarks ARGS` refused before it runs anything: its `main` in this process (no new interpreter)."""
    from benchmarks.__main__ import main
    from tests.helpers import run_entry_point

    return run_entry_point(main, list(args))


@pytest.mark.parametrize("flag", ["--fused-adamw", "--no-flat-grads", "--fp32-grad-norm", "--no-chunked-step"])
def test_train_settings_are_refused_without_train(flag):
    p = _refused("model", flag)
    assert p.returncode == 2 and f"{flag}: only with --train" in p.stderr


def test_train_steps_must_exceed_the_warmup():
    p = _refused("model", "--train", "--train-steps", "2", "--warmup", "3")
    assert p.returncode == 2 and "--train-steps 2: must exceed --warmup 3" in p.stderr


def test_fp32_grad_norm_needs_the_flat_gradients():
    p = _refused("model", "--train", "--fp32-grad-norm", "--no-flat-grads")
    assert p.returncode == 2 and "--fp32-grad-norm: the FP32 norm is taken over the flat gradients" in p.stderr
