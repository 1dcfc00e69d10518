"""`dsv3 memory-plan`: per-rank memory (params, grads, optimizer, activations by component) for each pipeline
schedule (`training.memory_plan`)."""

import json

from dsv3_plugin.config import ConfigError, load_config
from dsv3_plugin.training.memory_plan import SCHEDULES, GiB, format_table, plan, plan_ranks, rank_param_count
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local


def register(sub):
    p = sub.add_parser("memory-plan", help="estimate per-rank training memory for each pipeline schedule")
    p.add_argument("--preset", default=None, help="tiny / small / v3-671b (default: the config's, else v3-671b)")
    p.add_argument("--config", default=None, help='DeepSpeed JSON with a "dsv3" block')
    p.add_argument("--pp", type=int, default=None, help="pipeline ranks (default: dsv3.parallel.pp)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel ranks (default: dsv3.parallel.ep)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel replicas per stage (EP is carved from DP)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="tokens per micro-batch (default seq_len)")
    p.add_argument("--recompute", choices=["none", "norm_and_mla_up", "full"], default=None)
    p.add_argument("--fp8", dest="fp8", action="store_true", default=None, help="FP8 GEMM input caching")
    p.add_argument("--no-fp8", dest="fp8", action="store_false")
    p.add_argument("--bf16-moments", dest="bf16_moments", action="store_true", default=None)
    p.add_argument("--fp32-moments", dest="bf16_moments", action="store_false")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all-ranks", action="store_true", help="every pipeline rank, not only each schedule's worst")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="also build one rank's model for real (BF16, CPU, rank-local) and report its measured "
        "parameter bytes beside the plan's (a v3-671b DualPipe end rank takes ~9.2 GiB)",
    )
    p.add_argument("--schedule", default=None, help="schedule of the --materialize rank (default: the config's)")
    p.add_argument("--pp-rank", type=int, default=0, help="pipeline rank to --materialize (default 0)")
    p.add_argument("--ep-rank", type=int, default=0, help="expert-parallel rank to --materialize (default 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    from dataclasses import asdict

    if args.config and args.preset:
        raise ConfigError('dsv3.preset: give either --preset or --config (whose "dsv3" block names its preset)')
    if args.config:
        cfg = load_config(args.config)
    else:
        cfg = load_config({"preset": args.preset or "v3-671b"})
    pp = args.pp or cfg.parallel.pp
    ep = args.ep or cfg.parallel.ep
    if args.all_ranks:
        mb = (1, args.micro_batch_tokens) if args.micro_batch_tokens else None
        rows = [
            r
            for sched in SCHEDULES
            if not (sched == "dualpipe" and pp % 2)
            for r in plan_ranks(
                cfg,
                sched,
                pp,
                ep,
                args.dp,
                micro_batch=mb,
                recompute=args.recompute,
                fp8=args.fp8,
                bf16_moments=args.bf16_moments,
            )
        ]
    else:
        rows = plan(cfg, pp, ep, args.dp, args.micro_batch_tokens, args.recompute, args.fp8, args.bf16_moments)
    head = {
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
    built = (
        _materialize(cfg, args.schedule or cfg.parallel.schedule, pp, ep, args.pp_rank, args.ep_rank)
        if args.materialize
        else None
    )
    if args.json:
        print(json.dumps({**head, "ranks": [asdict(r) for r in rows], **({"materialized": built} if built else {})}))
    else:
        print(" ".join(f"{k}={v}" for k, v in head.items()))
        print(format_table(rows))
        print(
            f"({'every' if args.all_ranks else 'the worst'} pipeline rank per schedule, GiB; inflight: micro-batches "
            "in flight per local chunk at the rank's activation peak, from the schedule's op lists; activations "
            "= saved-for-backward bytes of those micro-batches)"
        )
        if built:
            print(
                f"materialized {built['schedule']} pipeline rank {built['pp_rank']}, EP rank {built['ep_rank']} "
                f"(layers {built['layers']}) in BF16: parameters {built['param_bytes'] / GiB:.3f} GiB measured, "
                f"{built['plan_param_bytes'] / GiB:.3f} GiB planned (ratio {built['ratio']:.4f}; the router "
                f"stays fp32); RSS grew {built['rss_growth_bytes'] / GiB:.3f} GiB, peak RSS "
                f"{built['peak_rss_bytes'] / GiB:.3f} GiB, built in {built['build_s']:.1f} s"
            )
    return 0


def _materialize(cfg, schedule: str, pp: int, ep: int, pp_rank: int, ep_rank: int) -> dict:
    """Build one rank's model for real (rank-local: meta, then only its parameters, in BF16 on CPU) and measure
    it: parameter bytes, RSS growth (/proc/self/statm) and peak RSS (ru_maxrss), beside the plan's figure."""
    import os
    import resource
    import time

    import torch

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    lay = RankLayout.of(cfg, pp_rank, ep_rank, pp=pp, ep=ep, schedule=schedule)
    before, t0 = rss(), time.perf_counter()
    model = build_rank_local(cfg, lay, dtype=torch.bfloat16, transforms=False)
    dt = time.perf_counter() - t0
    measured = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    planned = 2 * rank_param_count(cfg, schedule, pp, ep, pp_rank)["total"]
    out = {
        "schedule": schedule,
        "pp_rank": pp_rank,
        "ep_rank": ep_rank,
        "layers": lay.layer_ids,
        "param_bytes": measured,
        "plan_param_bytes": planned,
        "ratio": measured / planned,
        "rss_growth_bytes": rss() - before,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "build_s": dt,
    }
    del model
    return out
