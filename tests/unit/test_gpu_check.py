"""`make gpu-check` (examples/gpu_check.py) in its --dry-run mode, so that the GPU script cannot rot: argument
parsing, shapes, every section's code path that runs without a GPU, and the JSON keys the GPU run reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "gpu_check.py"
SECTIONS = ["env", "fp8_gemm", "te_linear", "tiny_logits", "fp8_model_steps", "grouped_mm", "moe"]


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


def test_usage_errors_and_section_selection():
    p = _run("--sections", "nope")
    assert p.returncode == 2 and "--sections" in p.stderr
    p = _run("--dry-run", "--sections", "env")
    res = json.loads(p.stdout)
    assert p.returncode == 0 and res["env"]["status"] == "ok"
    assert res["moe"] == {"status": "skipped", "reason": "not requested (--sections)"}
