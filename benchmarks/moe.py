"""MoE layer forward+backward tokens/s vs transformers' DeepseekV3MoE (same weights, same inputs, same run).

Also reports our achieved GFLOP/s and a large single GEMM's GFLOP/s measured in the same run; their quotient
is `roofline_fraction` (how close the grouped expert computation gets to what the machine's GEMM can do).
FLOPs counted: router, routed experts (3 GEMMs per (token, expert) pair) and shared experts, forward
(2·m·n·k per GEMM) plus backward (2× forward). Element-wise work is not counted. `--dtype bfloat16` runs both
layers and the reference GEMM in BF16 (on CPUs with AMX / AVX512-BF16, oneDNN's BF16 GEMM is several times the FP32
one, so the roofline moves with the dtype). `ours_gemms`: our layer's matrix products alone, counted and timed
under torch's profiler (`benchmarks/_gemm_profile.py`), and the roofline fraction they alone allow.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks import positive_int
from benchmarks._gemm_profile import profile_gemms
from dsv3_plugin.config import MoEConfig
from dsv3_plugin.model.moe.layer import DeepSeekMoE

__all__ = ["add_arguments", "run", "build_pair", "moe_flops"]


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=positive_int, default=2048)
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--ffn", type=positive_int, default=128, help="expert FFN width (moe_intermediate_size)")
    p.add_argument("--experts", type=positive_int, default=64)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--groups", type=positive_int, default=8, help="n_group (node-limited routing)")
    p.add_argument("--topk-group", type=positive_int, default=4)
    p.add_argument("--shared", type=positive_int, default=1, help="n_shared_experts")
    p.add_argument("--repeats", type=positive_int, default=7, help="timed forward+backward passes per side")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--gemm", type=positive_int, default=2048, help="size n of the n×n×n reference GEMM")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="compute dtype of both layers and of the reference GEMM (bfloat16: the routers stay fp32, as trained)",
    )


def build_pair(tokens=2048, hidden=256, ffn=128, experts=64, top_k=8, groups=8, topk_group=4, shared=1, seed=0):
    """(ours, theirs, x): our DeepSeekMoE and transformers' DeepseekV3MoE holding identical fp32 weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = MoEConfig(
        n_routed_experts=experts,
        n_shared_experts=shared,
        intermediate_size=ffn,
        top_k=top_k,
        n_group=groups,
        topk_group=topk_group,
        route_scale=2.5,
        seq_aux_alpha=0.0,
    )
    ours = DeepSeekMoE(hidden, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        ours.gate.weight.mul_(4)  # spread the router's scores as a trained router would
        ours.gate.e_score_correction_bias.copy_(torch.randn(experts, generator=g) * 0.01)
    hc = DeepseekV3Config(
        hidden_size=hidden,
        moe_intermediate_size=ffn,
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        n_group=groups,
        topk_group=topk_group,
        n_shared_experts=shared,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        intermediate_size=4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=32,
    )
    theirs = DeepseekV3MoE(hc)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.gate.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate_proj, ours.experts.up_proj], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.down_proj)
        if shared:
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(theirs.shared_experts, n).weight.copy_(getattr(ours.shared_experts, n).weight)
    ours.train()
    theirs.train()
    x = torch.randn(1, tokens, hidden, generator=g)
    return ours, theirs, x


def moe_flops(tokens, hidden, ffn, experts, top_k, shared) -> float:
    """Forward + backward GEMM FLOPs of one MoE layer (backward = 2× forward)."""
    fwd = 2 * tokens * hidden * experts  # router
    fwd += 2 * tokens * top_k * 3 * hidden * ffn  # routed experts: gate, up, down
    fwd += 2 * tokens * 3 * hidden * ffn * shared  # shared experts
    return 3.0 * fwd


def _fwd_bwd(mod, x, g_out):
    xi = x.detach().requires_grad_(True)
    y = mod(xi)
    y.backward(g_out)
    return y


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ours, theirs, x = build_pair(
        args.tokens,
        args.hidden,
        args.ffn,
        args.experts,
        args.top_k,
        args.groups,
        args.topk_group,
        args.shared,
        args.seed,
    )
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32:  # both layers cast alike (ours keeps its router's state fp32: `Router._apply`)
        ours.to(dtype), theirs.to(dtype)
        x = x.to(dtype)
    g_out = torch.randn_like(x)
    # Same numbers first (a faster wrong layer is worthless).
    y1 = _fwd_bwd(ours, x, g_out)
    y2 = _fwd_bwd(theirs, x, g_out)
    max_abs_diff = float((y1 - y2).detach().abs().max())
    grad_diff = float((ours.experts.down_proj.grad - theirs.experts.down_proj.grad).abs().max())
    a = torch.randn(args.gemm, args.gemm, dtype=dtype)
    b = torch.randn(args.gemm, args.gemm, dtype=dtype)
    t_ours, t_theirs, t_gemm = [], [], []
    # Interleave the three measurements so that machine load hits them alike.
    for i in range(args.repeats + 1):
        for mod in (ours, theirs):
            mod.zero_grad(set_to_none=True)
        to = _time(lambda: _fwd_bwd(ours, x, g_out))
        tt = _time(lambda: _fwd_bwd(theirs, x, g_out))
        tg = _time(lambda: torch.mm(a, b))
        if i:  # first round warms caches/allocator
            t_ours.append(to), t_theirs.append(tt), t_gemm.append(tg)
        print(
            f"[bench moe] round {i}: ours {to * 1e3:.1f} ms, transformers {tt * 1e3:.1f} ms, gemm {tg * 1e3:.1f} ms",
            file=sys.stderr,
        )
    # Best of N for all three (the run least disturbed by other load on a shared machine); medians are
    # reported too.
    to, tt, tg = min(t_ours), min(t_theirs), min(t_gemm)
    med = {
        "ours_ms": statistics.median(t_ours) * 1e3,
        "theirs_ms": statistics.median(t_theirs) * 1e3,
        "gemm_ms": statistics.median(t_gemm) * 1e3,
    }
    flops = moe_flops(args.tokens, args.hidden, args.ffn, args.experts, args.top_k, args.shared)
    gemm_gflops = 2 * args.gemm**3 / tg / 1e9
    # our layer's matrix products alone (one more fwd + bwd under the profiler; `gflop` as executed, the BF16
    # padded layout's zero rows included): the roofline fraction the layer would reach if everything else in it
    # took no time, i.e. the most that faster non-GEMM work could give with today's GEMMs
    ours.zero_grad(set_to_none=True)
    prods = profile_gemms(lambda: _fwd_bwd(ours, x, g_out))
    prods["roofline_fraction_gemms_only"] = flops / (prods["ms"] / 1e3) / 1e9 / gemm_gflops  # wall times both
    ours_gflops = flops / to / 1e9
    theirs_gflops = flops / tt / 1e9
    impl = getattr(theirs.config, "_experts_implementation", None) or "eager"
    return {
        "bench": "moe",
        "shape": {
            "tokens": args.tokens,
            "hidden": args.hidden,
            "ffn": args.ffn,
            "experts": args.experts,
            "top_k": args.top_k,
            "n_group": args.groups,
            "topk_group": args.topk_group,
            "shared": args.shared,
            "dtype": args.dtype,
        },
        "ours": {"tokens_per_s": args.tokens / to, "ms": to * 1e3, "gflops": ours_gflops},
        "theirs": {
            "name": f"transformers DeepseekV3MoE ({impl} experts)",
            "tokens_per_s": args.tokens / tt,
            "ms": tt * 1e3,
            "gflops": theirs_gflops,
        },
        "ratio": tt / to,
        "gemm_gflops": gemm_gflops,
        "roofline_fraction": ours_gflops / gemm_gflops,
        "ours_gemms": prods,
        "theirs_roofline_fraction": theirs_gflops / gemm_gflops,
        "max_abs_diff": max_abs_diff,
        "max_abs_grad_diff": grad_diff,
        "flops_per_step": flops,
        "repeats": args.repeats,
        "timing": "best of repeats (interleaved ours / transformers / GEMM)",
        "median": med,
        "ratio_median": med["theirs_ms"] / med["ours_ms"],
    }
