"""Cross-node token copies and bytes: node-deduplicated vs per-expert dispatch (K=8, M=4, 8 simulated nodes).

Runs the real expert-parallel MoE layer on `--nproc` gloo ranks on loopback (8 nodes of `--ranks-per-node`
ranks), routes every rank's tokens with the node-limited router (64 experts in 8 groups = nodes, top-8,
at most M=4 nodes per token), dispatches them both ways and sums the copies that crossed a node boundary.
Both modes must give the same layer output (checked). `ratio` = per-expert copies / dedup copies (> 1: dedup
sends fewer). Combine sends the same rows back along the same routes, so it has the same counts.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import positive_int
from dsv3_plugin.config import MoEConfig
from dsv3_plugin.model.moe.layer import DeepSeekMoE
from dsv3_plugin.parallel.distributed import init_distributed, spawn
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE
from dsv3_plugin.parallel.groups import build_ep_groups

__all__ = ["add_arguments", "run"]


def add_arguments(p) -> None:
    p.add_argument("--nodes", type=positive_int, default=8)
    p.add_argument("--ranks-per-node", type=positive_int, default=1)
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per rank")
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--experts", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--max-nodes", type=positive_int, default=4, help="M, nodes per token (router topk_group)")
    p.add_argument("--seed", type=int, default=0)


def _rank_main(a: dict) -> dict:
    import torch.distributed as dist

    rank, world = init_distributed()
    groups = build_ep_groups(world, a["ranks_per_node"])
    cfg = MoEConfig(
        n_routed_experts=a["experts"],
        n_shared_experts=0,
        intermediate_size=32,
        top_k=a["top_k"],
        n_group=a["nodes"],
        topk_group=a["max_nodes"],
        seq_aux_alpha=0.0,
    )
    torch.manual_seed(a["seed"])  # same weights on every rank
    full = DeepSeekMoE(a["hidden"], cfg).eval()
    with torch.no_grad():
        full.gate.weight.normal_(0, 0.5)
    g = torch.Generator().manual_seed(a["seed"] + 1 + rank)
    x = torch.randn(1, a["tokens"], a["hidden"], generator=g)
    res, outs = {}, {}
    for mode, dedup in (("per_expert", False), ("dedup", True)):
        layer = ExpertParallelMoE.from_dense(full, groups, dedup=dedup)
        with torch.no_grad():
            outs[mode] = layer(x)
        res[mode] = layer.last_dispatch.as_dict()
    # the most nodes any one token crossed to (dedup: <= M by node-limited routing)
    idx = full.gate(x[0]).topk_idx_TK
    node_TK = idx // (a["experts"] // a["nodes"])
    hit = torch.zeros(idx.shape[0], a["nodes"], dtype=torch.bool).scatter_(1, node_TK, True)
    hit[:, groups.node] = False
    res["max_cross_node_per_token"] = int(hit.sum(1).max())
    res["max_abs_diff"] = float((outs["dedup"] - outs["per_expert"]).abs().max())
    dist.barrier()
    return res


def run(args) -> dict:

    nproc = args.nodes * args.ranks_per_node
    a = {
        k: getattr(args, k)
        for k in ("nodes", "ranks_per_node", "tokens", "hidden", "experts", "top_k", "max_nodes", "seed")
    }
    print(f"[bench dispatch] {nproc} gloo ranks ({args.nodes} nodes x {args.ranks_per_node})", file=sys.stderr)
    per_rank = spawn(_rank_main, nproc, a)
    out = {
        "bench": "dispatch",
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "tokens": args.tokens * nproc,
        "hidden": args.hidden,
        "experts": args.experts,
        "top_k": args.top_k,
        "max_nodes_per_token": args.max_nodes,
        "dtype": "float32",
    }
    for mode in ("per_expert", "dedup"):
        copies = sum(r[mode]["cross_node_copies"] for r in per_rank)
        bts = sum(r[mode]["cross_node_bytes"] for r in per_rank)
        meta = sum(r[mode]["cross_node_meta_bytes"] for r in per_rank)
        out[mode] = {
            "cross_node_copies": copies,
            "cross_node_bytes": bts,
            "cross_node_meta_bytes": meta,
            "cross_node_copies_per_token": copies / out["tokens"],
            "intra_node_copies": sum(r[mode]["intra_node_copies"] for r in per_rank),
        }
    out["ratio"] = out["per_expert"]["cross_node_copies"] / max(out["dedup"]["cross_node_copies"], 1)
    out["bytes_ratio"] = (out["per_expert"]["cross_node_bytes"] + out["per_expert"]["cross_node_meta_bytes"]) / max(
        out["dedup"]["cross_node_bytes"] + out["dedup"]["cross_node_meta_bytes"], 1
    )
    out["max_cross_node_per_token"] = max(r["max_cross_node_per_token"] for r in per_rank)
    out["outputs_max_abs_diff"] = max(r["max_abs_diff"] for r in per_rank)
    # For routing that does not favour the sender's own node, E[per-expert] / E[dedup] = (K - p·K/M) /
    # (M - p) = K/M, with p the chance the own node is selected: the expected ratio here is K/M = 2.
    out["expected_ratio_uniform_routing"] = args.top_k / args.max_nodes
    return out
