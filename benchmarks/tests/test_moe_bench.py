"""`python -m benchmarks moe` at a small shape through the runner: the JSON's structure, and the FLOP formula the
roofline uses equal to the matrix products our layer runs, counted call by call (no timing assertions); its pair of
layers is the same function."""

import json

import pytest
import torch
from tolerance import assert_within, reorder_bound

from benchmarks.__main__ import main

SMALL = ["--tokens", "64", "--hidden", "32", "--ffn", "16", "--experts", "8", "--top-k", "2", "--groups", "4"]
SMALL += ["--topk-group", "2", "--repeats", "1", "--gemm", "64", "--threads", "1"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_run_counts_the_products_the_formula_counts(dtype, capsys):
    assert main(["moe", "--json", *SMALL, "--dtype", dtype]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["bench"] == "moe" and d["shape"]["dtype"] == dtype
    g = d["ours_gemms"]
    assert g["calls"] > 0 and g["ms"] > 0 and g["roofline_fraction_gemms_only"] > 0
    if dtype == "float32":  # per-expert GEMMs: exactly the router, expert and shared-expert products
        assert g["gflop"] * 1e9 == pytest.approx(d["flops_per_step"], rel=1e-12)
    else:  # the padded layout's batched GEMMs also multiply its zero rows
        assert g["gflop"] * 1e9 > d["flops_per_step"]


def test_bench_pair_is_the_same_layer_as_transformers():
    """`python -m benchmarks moe` compares like with like: same outputs and gradients at a small shape."""
    from benchmarks.moe import build_pair

    ours, theirs, x = build_pair(tokens=48, hidden=32, ffn=16, experts=8, top_k=4, groups=4, topk_group=2)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(gy)
        outs.append((y.detach(), xi.grad))
    # Reordered: transformers runs a fused gate|up GEMM per expert on index-selected rows and sums the k
    # experts in its own order; ours sorts rows into grouped GEMMs. The router runs the same ops (same
    # selection). Longest reduction: a down_proj gradient over <= 48 tokens; 3 reductions forward (gate|up,
    # down, the k-sum + shared), 4 more backward (down ᵀ, gate|up ᵀ + their sum, the gates' normalization).
    # Magnitude: max|ref| of each tensor.
    pairs = {
        "y": (outs[0][0], outs[1][0], 3),
        "dx": (outs[0][1], outs[1][1], 7),
        "d down_proj": (ours.experts.down_proj.grad, theirs.experts.down_proj.grad, 7),
    }
    for name, (a, b, stages) in pairs.items():
        assert_within(a, b, reorder_bound(48, b.abs().max(), stages=stages), f"bench pair {name}: ours vs transformers")
