"""`make gpu-check` (examples/gpu_check.py) in its --dry-run mode, so that the GPU script cannot rot: argument
parsing, shapes, every section's code path that runs without a GPU, and the JSON keys the GPU run reports."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gpu_check.py"
SECTIONS = ["env", "fp8_gemm", "te_linear", "tiny_logits", "fp8_model_steps", "grouped_mm", "lora_fp8_base", "moe"]


def _run(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # many tiny ops: one thread is fastest on a shared machine
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = _run("--dry-run", "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert json.loads(out.read_text()) == res
    assert res["ok"] is True and res["failures"] == [] and res["dry_run"] is True
    assert set(SECTIONS) <= set(res) and {"shapes", "seconds"} <= set(res)
    for s in SECTIONS:
        assert res[s]["status"] in ("ok", "skipped"), (s, res[s])
    assert res["te_linear"]["status"] == "skipped" and res["te_linear"]["reason"]  # no TE / GPU here
    for kind in ("fprop", "dgrad", "wgrad"):  # the Hopper-modeled backend ran against the emulation
        row = res["fp8_gemm"][kind]
        assert row["hopper_within_bound"] is True and 0 <= row["hopper_vs_emulate"]["bit_equal_fraction"] <= 1
    assert res["tiny_logits"]["max_abs_diff"] <= 1e-5
    assert {"y", "dx", "dw1", "dw3", "dw2", "kernel_selected"} <= set(res["grouped_mm"])
    for e in (8, 32):
        row = res["moe"][f"local_experts_{e}"]
        assert {
            "ours",
            "ours_fp8",
            "transformers_eager",
            "ratio_vs_best_transformers",
            "ratio_fp8_vs_best_transformers",
            "flops_per_pass",
            "ours_vs_transformers",
        } <= set(row)
        assert row["ours"]["tokens_per_s"] > 0 and row["ours_vs_transformers"]["normwise_rel_diff"] < 1e-5
        # Megatron-Core's MoELayer with our weights (SequentialMLP on CPU): same output, timed; its FP8 needs TE
        assert row["megatron_core"]["experts"] == "SequentialMLP" and row["megatron_core"]["tokens_per_s"] > 0
        assert row["ours_vs_megatron_core"]["within_bound"] is True
        assert row["megatron_core_fp8"].startswith("unavailable (") and "Transformer Engine" in row["megatron_core_fp8"]
        assert row["ratio_ours_vs_megatron_core"] > 0 and row["ratio_fp8_vs_ours_bf16"] > 0
    assert res["shapes"]["moe_local_experts"] == [8, 32]
    lo = res["lora_fp8_base"]  # FP8 frozen base vs BF16 base: the layer within its bound, both models timed
    assert lo["layer"]["ok"] is True and lo["layer"]["y"]["within_bound"] and lo["layer"]["dx"]["within_bound"]
    for k in ("fp8", "bf16"):
        assert lo["model"][k]["ms"] > 0 and lo["model"][k]["peak_mib"] is None  # no CUDA peak on CPU
    assert lo["model"]["fp8"]["backend"] == "emulate" and lo["model"]["bf16_over_fp8_frozen"] > 1.5


def test_usage_errors_and_section_selection():
    p = _run("--sections", "nope")
    assert p.returncode == 2 and "--sections" in p.stderr
    p = _run("--dry-run", "--sections", "env")
    res = json.loads(p.stdout)
    assert p.returncode == 0 and res["env"]["status"] == "ok"
    assert res["moe"] == {"status": "skipped", "reason": "not requested (--sections)"}


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lora_fp8_base_bound_holds_and_catches_a_wrong_base():
    """The FP8-vs-BF16 comparison of one adapted Linear: within its derived bound, and not when the FP8 side's
    weight is off by one block's scale (as a mis-read `weight_scale_inv` would make it)."""
    gc = _module()
    g = torch.Generator().manual_seed(0)
    w, A, B = (
        torch.randn(64, 256, generator=g) * 0.02,
        torch.randn(4, 256, generator=g),
        torch.randn(64, 4, generator=g),
    )
    x = torch.randn(8, 256, generator=g).bfloat16()
    lin8, linb, _ = gc.lora_linear_pair(w, A, B, 0.5, torch.device("cpu"))
    gemm = lin8.kernel.inner.gemm
    w_q, w_s = lin8.weight.clone(), lin8.weight_scale_inv.clone()  # the base both sides should hold

    def within():
        y8, yb = lin8(x), linb(x)
        base8 = gemm.fwd(x, lin8.weight, lin8.weight_scale_inv).bfloat16()
        bound = gc.fp8_vs_bf16_bound(x, gc.Fp8Recipe().act(x.float()), w_q, w_s, (base8, y8), (x @ linb.weight.t(), yb))
        return gc._within(y8, yb, bound)

    assert within()
    lin8.weight_scale_inv[0, 1] *= 1.5
    assert not within()
    s = gc.lora_fp8_summary(
        {"ms": 2.0, "peak_mib": 10.0, "frozen_mib": 1.0, "loss": 1.0},
        {"ms": 3.0, "peak_mib": 15.0, "frozen_mib": 2.0, "loss": 1.5},
    )
    assert s == {"bf16_over_fp8_ms": 1.5, "bf16_over_fp8_peak": 1.5, "bf16_over_fp8_frozen": 2.0, "loss_diff": 0.5}


def test_without_cuda_the_check_refuses_and_runs_nothing():
    p = _run("--sections", "env", "lora_fp8_base", "--device", "cuda:99")  # no such GPU, on any machine
    res = json.loads(p.stdout)
    assert p.returncode == 1 and res["env"]["status"] == "error" and res["failures"] == ["env"]
    assert res["lora_fp8_base"] == {"status": "skipped", "reason": "environment unusable (see env)"}
