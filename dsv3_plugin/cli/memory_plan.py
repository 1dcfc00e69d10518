"""`dsv3 memory-plan`: per-rank memory (params, grads, optimizer, activations by component) for each pipeline
schedule (`training.memory_plan`).

The layout it plans is first validated as `dsv3 check-config` / `dsv3 train` would validate it (`_validated`:
`deepspeed.run_config.validate_ds_config` on the --config file with the flags written into its "dsv3" block, or,
for a --preset without DeepSpeed keys, the same block rules: `DSv3Config.from_block` +
`deepspeed.validate.check_layout`), for the world of pp x dp ranks. A layout they refuse is refused here, with
exit 2 and the same reason, led by the flag that made it wrong (each flag is applied in turn, so the first one
that breaks a rule is named); nothing is planned for it. The other schedules of the table are validated the same
way: one that the rules refuse for this layout is listed as not planned, with the reason.
"""

import json

from dsv3_plugin.cli._lora import add_lora_flags, lora_flags, plan_head, run_lora_plan
from dsv3_plugin.config import ConfigError, DSv3Config, read_ds_json
from dsv3_plugin.deepspeed.run_config import validate_ds_config
from dsv3_plugin.deepspeed.validate import check_layout
from dsv3_plugin.schedule_traits import check_chunks
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
    add_lora_flags(p, "with a lora block the plan is LoRA's: FP8 base, adapters, their state")
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


def _with(block: dict, over: dict) -> dict:
    """`block` with `over`'s {section: {key: value}} written into it (a section that is not an object is left for
    the validation to name)."""
    out = dict(block)
    for sec, vals in over.items():
        cur = out.get(sec)
        if cur is None or isinstance(cur, dict):
            out[sec] = {**(cur or {}), **vals}
    return out


def _validated(ds: dict | None, block: dict, over: dict, world: int | None) -> DSv3Config:
    """The validation `dsv3 check-config` runs (target train), on the block with `over` written into it: the whole
    DeepSpeed JSON when there is one (`ds`), else the block's own rules."""
    b = _with(block, over)
    if ds is None:
        cfg = DSv3Config.from_block(b)
        check_layout(cfg, target="train", world_size=world)
        return cfg
    return validate_ds_config({**ds, "dsv3": b}, target="train", world_size=world).cfg


def _check_flags(args) -> None:
    for flag, val, least in (
        ("--pp", args.pp, 1),
        ("--ep", args.ep, 1),
        ("--dp", args.dp, 1),
        ("--micro-batch-tokens", args.micro_batch_tokens, 2),
        ("--pp-rank", args.pp_rank, 0),
        ("--ep-rank", args.ep_rank, 0),
        ("--lora-rank", args.lora_rank, 1),
    ):
        if val is not None and val < least:
            raise ConfigError(f"{flag}: must be >= {least} (got {val})")
    if args.config and args.preset:
        raise ConfigError('dsv3.preset: give either --preset or --config (whose "dsv3" block names its preset)')
    if args.schedule is not None and not args.materialize:
        raise ConfigError("--schedule: names the schedule of the --materialize rank; without --materialize the "
                          "table plans every schedule")  # fmt: skip


def _checked_layout(args) -> tuple[DSv3Config, dict | None, dict, dict]:
    """The validated config for the planned layout, the DeepSpeed JSON (None for a preset), its block, and the
    flags' overrides; ConfigError led by the flag that breaks a rule."""
    if args.config:
        ds = read_ds_json(args.config)
        block = ds.pop("dsv3")
        if not isinstance(block, dict):
            raise ConfigError(f"dsv3: must be an object (got {type(block).__name__})")
    else:
        ds, block = None, {"preset": args.preset or "v3-671b"}
    cfg = _validated(ds, block, {}, None)  # the config's own errors, as check-config reports them
    over: dict = {}
    flags = (
        ("--pp", args.pp, "parallel", "pp"),
        ("--ep", args.ep, "parallel", "ep"),
        ("--schedule", args.schedule, "parallel", "schedule"),
        ("--micro-batch-tokens", args.micro_batch_tokens, "train", "seq_len"),
        ("--recompute", args.recompute, "memory", "recompute"),
        ("--fp8" if args.fp8 else "--no-fp8", args.fp8, "fp8", "enabled"),
        ("--bf16-moments" if args.bf16_moments else "--fp32-moments", args.bf16_moments, "memory", "bf16_moments"),
    )
    for flag, val, sec, key in flags:
        if val is None:
            continue
        over.setdefault(sec, {})[key] = val
        try:
            cfg = _validated(ds, block, over, None)
        except ConfigError as e:
            raise ConfigError(f"{flag if isinstance(val, bool) else f'{flag} {val}'}: {e}") from None
    for text, val, key in lora_flags(args):  # into dsv3.lora, judged by its checks
        over.setdefault("lora", {})[key] = val
        try:
            cfg = _validated(ds, block, over, None)
        except ConfigError as e:
            raise ConfigError(f"{text}: {e}") from None
    world = cfg.parallel.pp * args.dp
    try:  # the world the plan is for: pp x dp ranks
        cfg = _validated(ds, block, over, world)
    except ConfigError as e:
        raise ConfigError(f"--dp {args.dp}: {e}") from None
    return cfg, ds, block, over


def _plannable(cfg: DSv3Config, ds: dict | None, block: dict, over: dict, world: int) -> tuple[list, dict]:
    """(the schedules the validation accepts for this layout, {schedule: why not} for the others)."""
    ok, why = [], {}
    for sched in SCHEDULES:
        try:
            check_chunks(sched, cfg.parallel.pp, pp_key="dsv3.parallel.pp")  # also at pp = 1 (the table's rows)
            if sched != cfg.parallel.schedule:
                _validated(ds, block, {**over, "parallel": {**over.get("parallel", {}), "schedule": sched}}, world)
            ok.append(sched)
        except ConfigError as e:
            why[sched] = str(e)
    return ok, why


def run(args) -> int:
    from dataclasses import asdict

    _check_flags(args)
    cfg, ds, block, over = _checked_layout(args)
    pp, ep = cfg.parallel.pp, cfg.parallel.ep
    for flag, rank, n in (("--pp-rank", args.pp_rank, pp), ("--ep-rank", args.ep_rank, ep)):
        if args.materialize and rank >= n:
            raise ConfigError(f"{flag} {rank}: outside 0..{n - 1} (the layout has {n} such ranks)")
    schedules, not_planned = _plannable(cfg, ds, block, over, pp * args.dp)
    if cfg.lora is not None:
        return run_lora_plan(args, cfg, schedules, not_planned)
    if args.all_ranks:
        mb = (1, args.micro_batch_tokens) if args.micro_batch_tokens else None
        rows = [
            r
            for sched in schedules
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
        rows = plan(
            cfg,
            pp,
            ep,
            args.dp,
            args.micro_batch_tokens,
            args.recompute,
            args.fp8,
            args.bf16_moments,
            schedules=schedules,
        )
    head = plan_head(args, cfg)
    built = _materialize(cfg, cfg.parallel.schedule, pp, ep, args.pp_rank, args.ep_rank) if args.materialize else None
    if args.json:
        out = {**head, "ranks": [asdict(r) for r in rows], "not_planned": not_planned}
        print(json.dumps({**out, **({"materialized": built} if built else {})}))
    else:
        print(" ".join(f"{k}={v}" for k, v in head.items()))
        print(format_table(rows))
        print(
            f"({'every' if args.all_ranks else 'the worst'} pipeline rank per schedule, GiB; inflight: micro-batches "
            "in flight per local chunk at the rank's activation peak, from the schedule's op lists; activations "
            "= saved-for-backward bytes of those micro-batches)"
        )
        for sched, why in not_planned.items():
            print(f"not planned: {sched} ({why})")
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
