"""`dsv3 bench moe` at a small shape through the CLI: the JSON's structure, and the FLOP formula the roofline uses
equal to the matrix products our layer runs, counted call by call (no timing assertions)."""

import json

import pytest

from dsv3_plugin.cli import main

SMALL = ["--tokens", "64", "--hidden", "32", "--ffn", "16", "--experts", "8", "--top-k", "2", "--groups", "4"]
SMALL += ["--topk-group", "2", "--repeats", "1", "--gemm", "64", "--threads", "1"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_run_counts_the_products_the_formula_counts(dtype, capsys):
    assert main(["bench", "moe", "--json", *SMALL, "--dtype", dtype]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bench"] == "moe" and d["shape"]["dtype"] == dtype
    g = d["ours_gemms"]
    assert g["calls"] > 0 and g["ms"] > 0 and g["roofline_fraction_gemms_only"] > 0
    if dtype == "float32":  # per-expert GEMMs: exactly the router, expert and shared-expert products
        assert g["gflop"] * 1e9 == pytest.approx(d["flops_per_step"], rel=1e-12)
    else:  # the padded layout's batched GEMMs also multiply its zero rows
        assert g["gflop"] * 1e9 > d["flops_per_step"]
