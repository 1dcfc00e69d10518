"""Dispatch/combine over 4 gloo ranks equals a single-process reference (outputs and gradients), for
per-expert and node-deduplicated dispatch, with EP = world and EP < world (DP x EP)."""

import torch
from helpers import run_ranks
from tolerance import assert_within, reorder_bound, unit_roundoff

from dsv3_plugin.parallel.dispatch import BF16Codec, moe_dispatch_combine
from dsv3_plugin.parallel.distributed import init_distributed
from dsv3_plugin.parallel.groups import build_ep_groups

E, H, K = 8, 6, 3


def _data(rank, T):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]  # K distinct experts per token
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    gout = torch.randn(T, H, generator=g, dtype=torch.float64)
    return x, idx, w, gout


def _weights():
    return torch.randn(E, H, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _toy_expert(W_LHH):
    def fn(x_NH, e_N):
        return torch.tanh(torch.bmm(x_NH.unsqueeze(1), W_LHH[e_N]).squeeze(1))

    return fn


def _reference(ranks, tokens):
    W = _weights().requires_grad_(True)
    outs, grads = {}, {}
    loss = 0
    for r in ranks:
        x, idx, w, gout = _data(r, tokens[r])
        x.requires_grad_(True)
        w.requires_grad_(True)
        y = torch.tanh(torch.einsum("th,tkhj->tkj", x, W[idx]))
        out = (y * w[..., None]).sum(1)
        loss = loss + (out * gout).sum()
        outs[r] = out
        grads[r] = (x, w)
    loss.backward()
    return ({r: o.detach() for r, o in outs.items()}, {r: (x.grad, w.grad) for r, (x, w) in grads.items()}, W.grad)


def _run(layouts, tokens):
    init_distributed()
    return [_run_layout(ep, rpn, tokens) for ep, rpn in layouts]


def _run_layout(ep, rpn, tokens):
    rank = torch.distributed.get_rank()
    res = []
    for dedup in (False, True):
        for codec in (None, BF16Codec()) if dedup else (None,):
            g = build_ep_groups(ep, rpn)
            W = _weights()
            W_loc = W[g.local_expert_range(E).start : g.local_expert_range(E).stop].clone().requires_grad_(True)
            x, idx, w, gout = _data(rank, tokens[rank])
            x.requires_grad_(True)
            w.requires_grad_(True)
            out, st = moe_dispatch_combine(x, idx, w, _toy_expert(W_loc), E, g, dedup=dedup, codec=codec)
            (out * gout).sum().backward()
            ref_out, ref_grads, ref_W = _reference(g.ep_ranks, tokens)
            lr = g.local_expert_range(E)
            # (got, ref) pairs, float64; checked in the parent (_check)
            pairs = {"out": (out.detach(), ref_out[rank])}
            if codec is None:
                pairs.update(
                    {
                        "x.grad": (x.grad, ref_grads[rank][0]),
                        "w.grad": (w.grad, ref_grads[rank][1]),
                        "W.grad": (W_loc.grad, ref_W[lr.start : lr.stop]),
                    }
                )
            else:  # BF16 payload: forward within bf16 rounding, backward still flows
                pairs["W.grad nonzero"] = bool(W_loc.grad.abs().sum() > 0)
            res.append(((dedup, codec is not None), pairs, st.as_dict()))
    return res


def _bf16_payload_bound(rank, tokens):
    """The BF16 codec rounds each dispatched x to bf16 (|δx| <= u_bf16·|x|); tanh' <= 1, so a token's output
    moves by <= Σ_k w_k · u_bf16 · (|x| @ |W_e|)."""
    x, idx, w, _ = _data(rank, tokens[rank])
    W = _weights()
    env = (torch.einsum("th,tkhj->tkj", x.abs(), W[idx].abs()) * w[..., None].abs()).sum(1)
    return unit_roundoff(torch.bfloat16) * env


def _check(results, ep, rpn, tokens):
    # Reordered (float64): each expert's bmm over the rows its rank received vs the reference einsum
    # (K = H = 6), the k = 3 outputs summed in arrival order, and each weight gradient summed over the EP
    # group's tokens (K = their count) across ranks: 2 reductions forward, 5 with the backward.
    # Magnitude: max|ref| of the compared tensor.
    K = max(H, sum(tokens))
    for rank, rank_res in enumerate(results):
        for mode, pairs, st in rank_res:
            what = f"EP={ep} ranks/node={rpn} rank {rank} dedup={mode[0]} bf16={mode[1]}"
            got, ref = pairs["out"]
            fp64 = reorder_bound(K, ref.abs().max() if ref.numel() else 0.0, torch.float64, stages=2)
            if mode[1]:
                assert_within(got, ref, _bf16_payload_bound(rank, tokens) + fp64, what + " out (bf16 payload)")
                assert pairs["W.grad nonzero"], what
            else:
                assert_within(got, ref, fp64, what + " out")
                for n in ("x.grad", "w.grad", "W.grad"):
                    got, ref = pairs[n]
                    mag = ref.abs().max() if ref.numel() else 0.0
                    assert_within(got, ref, reorder_bound(K, mag, torch.float64, stages=5), f"{what} {n}")
            if mode[0] and ep // rpn > 1:
                assert st["cross_node_copies"] <= st["tokens"] * (ep // rpn - 1)


def test_dispatch_four_ranks_nodes_and_dp():
    tokens = [11, 0, 7, 5]  # an empty rank exercises zero-size splits
    # EP=4 over two 2-rank nodes; EP=2 x DP=2 with 1-rank nodes
    res = run_ranks(_run, 4, [(4, 2), (2, 1)], tokens)
    _check([r[0] for r in res], 4, 2, tokens)
    _check([r[1] for r in res], 2, 1, tokens)
    # per-expert vs dedup from the same tokens: dedup never sends more cross-node copies
    for r in res:
        per_expert, dedup = r[0][0][2], r[0][1][2]
        assert dedup["cross_node_copies"] <= per_expert["cross_node_copies"]
