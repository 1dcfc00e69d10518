"""`python -m benchmarks fp8 --json` runs and reports the issue's figures (no timing assertions)."""

import json

from benchmarks.__main__ import main


def test_bench_fp8_json(capsys):
    assert main(["fp8", "--json", "--tokens", "64", "--hidden", "512", "--repeat", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"ours", "baseline", "ratio", "error", "quantize", "gemm", "env"} <= set(d)
    assert d["error"]["tile_1x128"] < d["error"]["per_tensor"] and d["ratio"] > 2
    assert d["quantize"]["ours_GBps"] > 0 and d["quantize"]["memcpy_GBps"] > 0
    assert d["gemm"]["backend"] == "emulate" and d["gemm"]["rel_err_vs_fp32"] < 0.06
