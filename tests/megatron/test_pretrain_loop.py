"""Megatron's own `pretrain()` loop on CPU/gloo through `python -m dsv3_plugin.megatron.pretrain_gpt`, run as a
user runs it (a subprocess, 2 ranks): mock data, the tiny model, 10 iterations. The loss falls, Megatron's
`finalize_model_grads` steps our routers' bias, and a Megatron checkpoint (`--save`/`--load`, torch_dist format)
resumes exactly: a new run loading the iteration-5 checkpoint reproduces iterations 6..10 of the straight run bit
for bit (same op sequence on both sides; model, optimizer, LR schedule, RNG and data position restored).

Needs megatron-core >= 0.19 (`megatron.training` in the wheel): skipped on 0.16.1. Marked `long` (`make test-long`,
CI time): `make test` covers a PP = 1 checkpoint resumed bit-exactly at iteration 6 in test_pretrain_dualpipev.py,
the bias update there and in test_megatron_lm_script.py; this file adds the torchrun launch and 10 iterations.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run_module, tiny_megatron_args

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")
pytestmark = [pytest.mark.dist, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = tiny_megatron_args(10)


def _run(tmp, name, launcher, extra):
    metrics = tmp / f"{name}.jsonl"
    cmd = (
        [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", "--nproc", "2"]
        if launcher == "nproc"
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "dsv3_plugin.megatron.pretrain_gpt",
        ]
    )
    cmd += ["--dsv3-config", str(tmp / "ds.json"), "--dsv3-metrics", str(metrics)] + FLAGS + extra
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if launcher == "nproc":
        p = run_module(cmd, cwd=ROOT, env=env)
    else:  # torchrun's agent: a process of its own
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return [json.loads(l) for l in metrics.read_text().splitlines()], p.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    ck, ck2 = str(tmp / "ckpt"), str(tmp / "ckpt_resumed")
    # 10 straight iterations (torchrun), saving Megatron checkpoints at 5 and 10 ...
    straight, log = _run(tmp, "straight", "torchrun", ["--save", ck, "--save-interval", "5"])
    # ... then a new run (self-spawned ranks) that loads the one of iteration 5 and trains 6..10.
    resumed, log_resumed = _run(
        tmp, "resumed", "nproc", ["--load", ck, "--ckpt-step", "5", "--save", ck2, "--save-interval", "5"]
    )
    return {"straight": straight, "resumed": resumed, "log": log, "log_resumed": log_resumed, "ckpt": ck2}


def test_ten_iterations_and_the_loss_falls(runs):
    s = runs["straight"]
    assert [r["iteration"] for r in s] == list(range(1, 11))
    loss = [r["lm_loss"] for r in s]
    assert all(l == l and 0 < l < 20 for l in loss)  # finite
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, loss  # measured: 5.57 -> ~4.4
    assert "mtp_1 loss" in runs["log"]  # Megatron's MTP block trains too


def test_router_bias_stepped_by_finalize_model_grads(runs):
    from dsv3_plugin.config import DSv3Config

    cfg = DSv3Config.from_block({"preset": "tiny"})
    gamma, E = cfg.moe.bias_update_speed, cfg.moe.n_routed_experts
    s = runs["straight"]
    R = s[0]["routers"]
    assert R == 3  # 2 MoE decoder layers + the MTP layer
    # b <- b + gamma * sign(mean - load): every step moves each of R*E entries by 0 or exactly gamma.
    prev = 0.0
    for r in s:
        assert abs(r["router_bias_abs_sum"] - prev) <= R * E * gamma + 1e-6
        prev = r["router_bias_abs_sum"]
    assert 0 < s[0]["router_bias_abs_sum"] <= R * E * gamma + 1e-6
    assert s[-1]["router_bias_abs_sum"] > s[0]["router_bias_abs_sum"]


def test_checkpoint_resume_continues_exactly(runs):
    s, b = runs["straight"], runs["resumed"]
    assert [r["iteration"] for r in b] == [6, 7, 8, 9, 10]
    assert b == s[5:], (b, s[5:])  # losses and biases, bit for bit
    assert "successfully loaded checkpoint from" in runs["log_resumed"] and "at iteration 5" in runs["log_resumed"]
    assert Path(runs["ckpt"], "latest_checkpointed_iteration.txt").read_text().strip() == "10"
