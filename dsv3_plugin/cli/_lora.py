"""The `--lora-*` flags of `dsv3 memory-plan` and `dsv3 simulate`: they mirror the config's `dsv3.lora` block
(rank, experts, targets) and are written into it, so the config's own checks judge them; and the LoRA table of
`dsv3 memory-plan` (`training.lora_memory`)."""

from __future__ import annotations

import json
from dataclasses import asdict

from dsv3_plugin.config import ConfigError, DSv3Config, lora_targets
from dsv3_plugin.training.lora_memory import format_lora_table, lora_plan, lora_plan_ranks

__all__ = ["add_lora_flags", "lora_flags", "plan_head", "run_lora_plan"]


def add_lora_flags(p, what: str) -> None:
    """Add --lora-rank, --lora-experts, --lora-targets to parser `p`; `what` says what they change."""
    g = p.add_argument_group(f"LoRA on the frozen FP8 base (the dsv3.lora block; {what})")
    g.add_argument("--lora-rank", type=int, default=None, help="adapters' rank r (dsv3.lora.rank)")
    g.add_argument(
        "--lora-experts",
        action="store_true",
        default=None,
        help="adapters on the routed experts too, sharded with them (dsv3.lora.experts)",
    )
    g.add_argument(
        "--lora-targets",
        nargs="+",
        default=None,
        metavar="NAME",
        help="module names to adapt, e.g. q_a_proj o_proj (dsv3.lora.targets; default: every attention, "
        "dense-MLP and shared-expert projection)",
    )


def lora_flags(args) -> list[tuple[str, object, str]]:
    """[(flag as the user wrote it, value, dsv3.lora key)] of the given --lora-* flags, in order."""
    out = []
    if args.lora_rank is not None:
        out.append((f"--lora-rank {args.lora_rank}", args.lora_rank, "rank"))
    if args.lora_experts:
        out.append(("--lora-experts", True, "experts"))
    if args.lora_targets is not None:
        out.append((f"--lora-targets {' '.join(args.lora_targets)}", list(args.lora_targets), "targets"))
    return out


def plan_head(args, cfg: DSv3Config) -> dict:
    """The layout line of `dsv3 memory-plan`'s output (its JSON's top-level keys) for the validated `cfg`."""
    pp, ep = cfg.parallel.pp, cfg.parallel.ep
    return {
        "preset": cfg.preset,
        "pp": pp,
        "ep": ep,
        "dp": args.dp,
        "world_size": pp * args.dp,
        "micro_batch_tokens": args.micro_batch_tokens or cfg.train.seq_len,
        "recompute": args.recompute or cfg.memory.recompute,
        "fp8": cfg.fp8.enabled if args.fp8 is None else args.fp8,
        "bf16_moments": cfg.memory.bf16_moments if args.bf16_moments is None else args.bf16_moments,
    }


def run_lora_plan(args, cfg: DSv3Config, schedules: list, not_planned: dict) -> int:
    """Print `dsv3 memory-plan`'s LoRA plan of the validated `cfg` (which has a lora block) for `schedules`."""
    if args.materialize:
        raise ConfigError("--materialize: builds a full-fine-tuning rank in BF16, not LoRA's FP8 base; drop it or "
                          "the lora block")  # fmt: skip
    pp, ep, lo = cfg.parallel.pp, cfg.parallel.ep, cfg.lora
    kw = dict(
        micro_batch_tokens=args.micro_batch_tokens,
        recompute=args.recompute,
        fp8=args.fp8,
        bf16_moments=args.bf16_moments,
    )
    if args.all_ranks:
        rows = [r for s in schedules for r in lora_plan_ranks(cfg, s, pp, ep, args.dp, **kw)]
    else:
        rows = lora_plan(cfg, pp, ep, args.dp, schedules, **kw)
    head = {
        **plan_head(args, cfg),
        "lora_rank": lo.rank,
        "lora_experts": lo.experts,
        "lora_targets": ",".join(lora_targets(cfg)),
        "lora_mtp": lo.mtp,
    }
    if args.json:
        print(json.dumps({**head, "ranks": [asdict(r) for r in rows], "not_planned": not_planned}))
        return 0
    print(" ".join(f"{k}={v}" for k, v in head.items()))
    print(format_lora_table(rows))
    print(
        f"({'every' if args.all_ranks else 'the worst'} pipeline rank per schedule, GiB; LoRA: the base frozen as "
        "released (FP8 + block scales, BF16 embedding / head / norms / router), FP32 adapters, their gradients and "
        "ZeRO-1 optimizer state; gemm_temp: one frozen weight dequantized (fp8=False) or its FP8 transpose)"
    )
    for sched, why in not_planned.items():
        print(f"not planned: {sched} ({why})")
    return 0
