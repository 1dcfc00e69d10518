"""examples/megatron/train_tiny.py runs as a user would run it (its own `main`, self-spawned 2 gloo ranks):
Megatron DDP + Megatron optimizer + finalize_model_grads on the plugin's GPTModel; losses finite and falling."""

import json
import math
import os
import sys

import pytest

pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_example_driver_trains(capfd):
    sys.path.insert(0, os.path.join(ROOT, "examples", "megatron"))  # spawned ranks inherit sys.path
    import train_tiny as mod

    assert mod.main(["--nproc", "2", "--steps", "3", "--seq-len", "16", "--micro-batch", "2"]) == 0
    lines = [json.loads(l) for l in capfd.readouterr().out.splitlines() if l.startswith("{")]
    steps, summary = lines[:-1], lines[-1]
    assert [l["step"] for l in steps] == [1, 2, 3]
    assert all(math.isfinite(l["loss"]) and math.isfinite(l["grad_norm"]) and l["grad_norm"] > 0 for l in steps)
    assert all(l["bias_update_rate"] == 0.001 for l in steps)
    assert summary["held_out_loss_after"] < summary["held_out_loss_before"]
