"""Megatron's own `pretrain()` (`python -m dsv3_plugin.megatron.pretrain_gpt`, gloo on CPU) on two nodes: two
torchrun agents of one rank each on this host, sharing one c10d rendezvous (each agent is a node: torchrun's
GROUP_RANK). EP = 2 over the two agents with `moe.ranks_per_node` 1 (checked against the launch at the first EP
group, `parallel.node_layout`) and n_group 2 / topk_group 1: every token goes to experts of one node only
(node-limited routing across the agents). A run of 4 iterations saves at 2 and 4 (`--save`, one directory both
nodes see); a new two-agent launch loading iteration 2 (`--load`) reproduces iterations 3-4 bit for bit (same op
sequence: model, optimizer, LR schedule, RNG, data position and router biases restored).

Needs megatron-core >= 0.19 (`megatron.training`).
"""

import json
import os
import sys

import pytest
from helpers import MEGATRON_SPEC, needs_megatron_training, tiny_megatron_args, torchrun_agents

from dsv3_plugin.parallel.distributed import free_port

pytestmark = [pytest.mark.dist, needs_megatron_training]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = {"preset": "tiny", "moe": {"ranks_per_node": 1, "n_group": 2, "topk_group": 1}}
FLAGS = MEGATRON_SPEC + tiny_megatron_args(4, mbs=2, gbs=4, seq=16) + ["--expert-model-parallel-size", "2"]


def _two_agents(tmp, name, extra):
    """Two torchrun agents (1 rank each) running pretrain_gpt with the same flags; returns the metrics lines."""
    cfg, metrics = tmp / "ds.json", tmp / f"{name}.jsonl"
    cfg.write_text(json.dumps({"dsv3": BLOCK}))
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    cmd = launcher + ["-m", "dsv3_plugin.megatron.pretrain_gpt", "--dsv3-config", str(cfg)]
    cmd += ["--dsv3-metrics", str(metrics)] + FLAGS + extra
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    codes, text = torchrun_agents([cmd, cmd], tmp, env, cwd=ROOT)
    assert codes == [0, 0], text[-6000:]
    return [json.loads(line) for line in metrics.read_text().splitlines()], text


def test_two_agents_train_and_resume(tmp_path):
    ck = str(tmp_path / "ckpt")
    straight, _ = _two_agents(tmp_path, "straight", ["--save", ck, "--save-interval", "2"])
    assert [r["iteration"] for r in straight] == [1, 2, 3, 4]
    assert all(0 < r["lm_loss"] < 20 for r in straight)  # finite
    resumed, log = _two_agents(tmp_path, "resumed", ["--load", ck, "--ckpt-step", "2"])
    assert "successfully loaded checkpoint from" in log and "at iteration 2" in log
    assert resumed == straight[2:], (resumed, straight[2:])  # losses and router biases, bit for bit
