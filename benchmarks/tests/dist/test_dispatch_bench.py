"""`python -m benchmarks dispatch` at a tiny shape on its spawned gloo ranks: node-deduplicated dispatch sends each
token's rows to a node once, and its outputs equal per-expert dispatch's within the derived reordering bound."""

import torch
from tolerance import reorder_bound


def test_dispatch_bench_small():
    """`python -m benchmarks dispatch` code path at a tiny shape: 2 nodes, M = 1 (each token uses one node)."""
    import argparse

    from benchmarks import dispatch as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(
        ["--nodes", "2", "--tokens", "24", "--hidden", "16", "--experts", "8", "--top-k", "4", "--max-nodes", "1"]
    )
    out = bench.run(args)
    assert out["max_cross_node_per_token"] <= 1
    # M = 1: a token goes to one node with all 4 experts; dedup sends it once instead of 4 times
    assert out["per_expert"]["cross_node_copies"] == 4 * out["dedup"]["cross_node_copies"] > 0
    # per-expert vs deduplicated dispatch of the same rows: the grouped expert GEMMs (K <= 32, the bench's
    # expert width) see other row blocks and the k = 4 outputs arrive in another order: 3 reductions,
    # float32, magnitude the largest output (the bench's layer, rebuilt here from its seed)
    assert out["outputs_max_abs_diff"] <= reorder_bound(32, _bench_output_scale(args), stages=3)


def _bench_output_scale(a):
    """max |output| of `python -m benchmarks dispatch`'s single-process layer on every rank's tokens (same seeds)."""
    from dsv3_plugin.config import MoEConfig
    from dsv3_plugin.model.moe.layer import DeepSeekMoE

    cfg = MoEConfig(
        n_routed_experts=a.experts,
        n_shared_experts=0,
        intermediate_size=32,
        top_k=a.top_k,
        n_group=a.nodes,
        topk_group=a.max_nodes,
        seq_aux_alpha=0.0,
    )
    torch.manual_seed(a.seed)
    full = DeepSeekMoE(a.hidden, cfg).eval()
    with torch.no_grad():
        full.gate.weight.normal_(0, 0.5)
        xs = [
            torch.randn(1, a.tokens, a.hidden, generator=torch.Generator().manual_seed(a.seed + 1 + r))
            for r in range(a.nodes * a.ranks_per_node)
        ]
        return max(float(full(x).abs().max()) for x in xs)
