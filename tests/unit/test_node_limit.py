"""Node-limited routing (paper §3.2.2, M nodes per token): property test over random scores and biases.
Nodes are contiguous expert blocks (EP rank j owns E/P experts; nodes are blocks of ranks_per_node ranks);
the router's groups tile the nodes, so at most `topk_group` = M nodes are ever selected, and dedup dispatch
makes at most M cross-node copies per token."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv3_plugin.config import MoEConfig
from dsv3_plugin.model.moe.router import Router, group_limited_topk
from dsv3_plugin.parallel.dispatch import count_cross_node_copies


@st.composite
def routing_case(draw):
    nodes = draw(st.sampled_from([2, 4, 8]))
    groups_per_node = draw(st.sampled_from([1, 2]))
    n_group = nodes * groups_per_node
    per_group = draw(st.sampled_from([2, 3, 4]))
    E = n_group * per_group
    M = draw(st.integers(1, n_group))
    top_k = draw(st.integers(M, min(M * per_group, E)))
    T = draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    bias_scale = draw(st.sampled_from([0.0, 0.01, 1.0, 10.0]))
    return nodes, n_group, E, M, top_k, T, seed, bias_scale


@settings(max_examples=150, deadline=None)
@given(routing_case())
def test_no_token_uses_more_than_M_nodes(case):
    nodes, n_group, E, M, top_k, T, seed, bias_scale = case
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    bias = torch.randn(E, generator=g) * bias_scale
    idx = group_limited_topk(scores + bias, top_k, n_group, M)
    assert idx.shape == (T, top_k)
    assert bool((idx.sort(1).values.diff(dim=1) > 0).all()), "an expert was selected twice"
    node_TK = idx // (E // nodes)
    hit = torch.zeros(T, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
    assert int(hit.sum(1).max()) <= min(M, nodes)
    # and dedup dispatch from any source rank crosses at most M node boundaries per token
    for src in range(nodes):
        cross, _ = count_cross_node_copies(idx, E, nodes, 1, src_rank=src, dedup=True)
        assert cross <= T * min(M, nodes)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3]))
def test_router_forward_respects_node_limit(seed, M):
    # 4 nodes x 1 group each, 16 experts, top-6: the Router module itself (weights, bias) obeys the limit
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=16, intermediate_size=4, top_k=min(6, 4 * M), n_group=4, topk_group=M)
    r = Router(8, cfg)
    with torch.no_grad():
        r.weight.normal_(0, 1.0)
        r.e_score_correction_bias.normal_(0, 0.5)
    out = r(torch.randn(32, 8))
    nodes_used = torch.zeros(32, 4, dtype=torch.bool).scatter_(1, out.topk_idx_TK // 4, True).sum(1)
    assert int(nodes_used.max()) <= M
