"""`dsv3 simulate`: per-rank timeline, bubble, activations and parameter copies of a pipeline schedule,
computed from the same op lists the runtime executes; `--png` draws it, `--table` prints the comparison
with the published formulas. With per-component durations (attention / dispatch / MLP / combine, §3.2.1) or
`--paper-setup` (the report's PP16 / EP64 H800 setup from first principles) an overlapped F&B pair is the
two-lane schedule of Fig. 4, and `--fig4 PATH` draws one pair. `--lora-rank` (with --paper-setup): LoRA on the
frozen base, whose W ops keep only the adapters' weight gradients."""

from __future__ import annotations

import json
import math
import sys

from dsv3_plugin.cli._lora import add_lora_flags, lora_flags
from dsv3_plugin.config import ConfigError, DSv3Config, lora_targets
from dsv3_plugin.parallel.pipeline.comm_model import (
    DEFAULT_MFU,
    IB_GBPS,
    LAYERS_PER_CHUNK,
    MICRO_BATCHES_PER_STEP,
    PAPER_PP,
    REPORTED_TOKENS_PER_S_PER_GPU,
    TOKENS_PER_MICRO_BATCH,
    Hardware,
    break_even_mfu,
    paper_setup,
)
from dsv3_plugin.parallel.pipeline.fb_overlap import ChunkComponents, two_lane_pair
from dsv3_plugin.parallel.pipeline.overlap_timeline import plot_overlap_timeline
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.simulate import Durations, comparison_table, plot_timeline, simulate
from dsv3_plugin.schedule_traits import SCHEDULES

# flag -> ChunkComponents field; forward, backward for input (run in reverse), backward for weights
_COMPONENT_FLAGS = {
    "attention": "attention",
    "dispatch": "dispatch",
    "mlp": "mlp",
    "combine": "combine",
    "combine_b": "combine-b",
    "mlp_b": "mlp-b",
    "dispatch_b": "dispatch-b",
    "attention_b": "attention-b",
    "mlp_w": "mlp-w",
    "attention_w": "attention-w",
}


def register(sub):
    p = sub.add_parser("simulate", help="simulate a pipeline schedule (bubble, memory, timeline PNG)")
    p.add_argument(
        "--schedule", choices=list(SCHEDULES), default=None, help="default dualpipev (dualpipe with --paper-setup)"
    )
    p.add_argument(
        "--pp",
        type=int,
        default=None,
        help=f"pipeline ranks (DualPipeV runs 2*pp stages on them); default 4 ({PAPER_PP} with --paper-setup)",
    )
    p.add_argument(
        "--chunks",
        type=int,
        default=None,
        help=f"micro-batches per step (default 4*pp; {MICRO_BATCHES_PER_STEP} with --paper-setup)",
    )
    p.add_argument("--f", type=float, default=None, help="forward time of one stage chunk (default 1)")
    p.add_argument("--b", type=float, default=None, help="full backward time (input + weight grads; default 2)")
    p.add_argument("--w", type=float, default=None, help="weight-grad part of --b (default 1)")
    p.add_argument("--fb", type=float, default=None, help="time of an overlapped F&B pair (default f+b)")
    g = p.add_argument_group("per-component durations of one layer (F, B, W and F&B are then derived)")
    for name, flag in _COMPONENT_FLAGS.items():
        g.add_argument(f"--{flag}", dest=name, type=float, default=None)
    g.add_argument(
        "--layers", type=int, default=None, help=f"layers per chunk (default 1; {LAYERS_PER_CHUNK} with --paper-setup)"
    )
    g.add_argument("--pp-comm", type=float, default=None, help="PP send of one chunk's boundary tensor (default 0)")
    g.add_argument("--no-overlap", action="store_true", help="run each F&B pair's halves back to back")
    g.add_argument(
        "--paper-setup",
        action="store_true",
        help="derive the components for DeepSeek-V3 671B, PP16 / EP64 on H800 (1x4096-token micro-batch)",
    )
    g.add_argument(
        "--mfu",
        type=float,
        default=None,
        help=f"--paper-setup: fraction of dense peak the computation reaches (default {DEFAULT_MFU})",
    )
    g.add_argument("--ib-gbps", type=float, default=None, help=f"--paper-setup: IB GB/s per GPU (default {IB_GBPS})")
    add_lora_flags(p, "--paper-setup: frozen base, the W op is the adapters' weight gradients")
    g.add_argument("--fig4", default=None, help="draw one overlapped F&B pair (two lanes, Fig. 4 style) here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeline", action="store_true", help="include every op's start/end in the JSON")
    p.add_argument("--png", default=None, help="write the timeline picture here")
    p.add_argument("--table", action="store_true", help="print the simulated-vs-published comparison table")
    p.set_defaults(func=run)


def _bad(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def _components(args) -> tuple[ChunkComponents | None, dict | None, str | None]:
    """(components or None, paper-setup details or None, error message or None)."""
    if args.layers is not None and args.layers < 1:
        return None, None, f"--layers must be >= 1 (got {args.layers})"
    given = [f for f in _COMPONENT_FLAGS if getattr(args, f) is not None]
    plain = [f"--{f}" for f in ("f", "b", "w", "fb") if getattr(args, f) is not None]
    if args.paper_setup:
        if given:
            return None, None, f"--paper-setup derives the components; drop --{_COMPONENT_FLAGS[given[0]]}"
        if plain:
            return None, None, f"--paper-setup derives F, B, W and F&B; drop {plain[0]}"
        if args.pp_comm is not None:
            return None, None, "--paper-setup derives the PP send time; drop --pp-comm"
        try:
            hw = Hardware(
                mfu=DEFAULT_MFU if args.mfu is None else args.mfu,
                ib_gbps=IB_GBPS if args.ib_gbps is None else args.ib_gbps,
            )
        except ValueError as e:
            flag = "--mfu" if "mfu" in str(e) else "--ib-gbps"
            return None, None, f"{flag}: {e}"
        block: dict = {"preset": "v3-671b"}
        for text, val, key in lora_flags(args):  # into dsv3.lora, judged by its checks
            block.setdefault("lora", {})[key] = val
            try:
                cfg = DSv3Config.from_block(block)
            except ConfigError as e:
                return None, None, f"{text}: {e}"
        cfg = DSv3Config.from_block(block)
        comp, details = paper_setup(hw, LAYERS_PER_CHUNK if args.layers is None else args.layers, cfg=cfg)
        details["break_even_mfu"] = break_even_mfu(hw, comp.layers, cfg=cfg)
        details["break_even_mfu_a2a_only"] = break_even_mfu(hw, comp.layers, cfg=cfg, with_pp=False)
        if cfg.lora is not None:
            details["lora"] = {"rank": cfg.lora.rank, "experts": cfg.lora.experts, "targets": lora_targets(cfg)}
        return comp, details, None
    if lora_flags(args):
        return None, None, f"{lora_flags(args)[0][0]}: needs --paper-setup (the W cost is derived from its GEMMs)"
    for flag, v in (("--mfu", args.mfu), ("--ib-gbps", args.ib_gbps)):
        if v is not None:
            return None, None, f"{flag} only applies with --paper-setup"
    if not given:
        if args.pp_comm is not None or args.layers is not None:
            return None, None, "--layers / --pp-comm need the component durations (--attention ... --attention-w)"
        return None, None, None
    if plain:
        return None, None, f"{plain[0]} cannot be combined with component durations (F, B, W, F&B are derived)"
    missing = [f"--{flag}" for f, flag in _COMPONENT_FLAGS.items() if getattr(args, f) is None]
    if missing:
        return None, None, f"component durations need all ten flags; missing {', '.join(missing)}"
    for f, flag in _COMPONENT_FLAGS.items():
        v = getattr(args, f)
        if not (math.isfinite(v) and v >= 0):
            return None, None, f"--{flag} must be a finite number >= 0 (got {v})"
    if args.pp_comm is not None and not (math.isfinite(args.pp_comm) and args.pp_comm >= 0):
        return None, None, f"--pp-comm must be a finite number >= 0 (got {args.pp_comm})"
    comp = ChunkComponents(
        *(getattr(args, f) for f in _COMPONENT_FLAGS), layers=args.layers or 1, pp=args.pp_comm or 0.0
    )
    return comp, None, None


def run(args) -> int:
    pp = args.pp if args.pp is not None else (PAPER_PP if args.paper_setup else 4)
    schedule = args.schedule or ("dualpipe" if args.paper_setup else "dualpipev")
    if pp < 1:
        return _bad(f"--pp must be >= 1 (got {pp})")
    if args.table:
        rows, text = comparison_table(pp, args.chunks)
        print(json.dumps({"pp": pp, "rows": rows}) if args.json else text)
        return 0
    comp, details, err = _components(args)
    if err:
        return _bad(err)
    if comp is None:
        if args.no_overlap or args.fig4:
            return _bad("--no-overlap / --fig4 need component durations (--attention ... or --paper-setup)")
        f, b, w = (
            (1.0 if args.f is None else args.f),
            (2.0 if args.b is None else args.b),
            (1.0 if args.w is None else args.w),
        )
        if min(f, b, w) < 0 or w > b:
            return _bad(f"need f, b, w >= 0 and w <= b (got f={f}, b={b}, w={w})")
        if args.fb is not None and args.fb <= 0:
            return _bad(f"--fb must be > 0 (got {args.fb})")
        d = Durations(f, b, w, args.fb)
    else:
        d = Durations.from_components(comp, overlap=not args.no_overlap)
    chunks = args.chunks or (MICRO_BATCHES_PER_STEP if args.paper_setup else 4 * pp)
    try:
        spec = build_schedule(schedule, pp, chunks)
    except ValueError as e:
        return _bad(f"--schedule {schedule}: {e}")
    res = simulate(spec, d)
    out = res.to_json(with_timeline=args.timeline)
    if comp is not None:
        pair = two_lane_pair(comp, mb_f=0, mb_b=1)
        other = simulate(spec, Durations.from_components(comp, overlap=args.no_overlap))
        with_ov, without = (other, res) if args.no_overlap else (res, other)
        out["components"] = {f: getattr(comp, f) for f in _COMPONENT_FLAGS} | {"layers": comp.layers, "pp": comp.pp}
        out["fb_pair"] = pair.to_json()
        out["step"] = {
            "makespan_overlap": with_ov.makespan,
            "makespan_no_overlap": without.makespan,
            "speedup": without.makespan / with_ov.makespan,
            "exposed_comm_overlap": max(with_ov.comm["exposed"]),
            "exposed_comm_no_overlap": max(without.comm["exposed"]),
        }
        if details is not None:
            out["paper_setup"] = details
            # tokens of one replica's step over its pp GPUs; the report's figure for comparison (§1, Table 1)
            out["step"]["tokens_per_s_per_gpu"] = chunks * TOKENS_PER_MICRO_BATCH / (with_ov.makespan / 1e3) / pp
            out["step"]["report_tokens_per_s_per_gpu"] = REPORTED_TOKENS_PER_S_PER_GPU
        if args.fig4:
            stats = (
                f"computation {pair.compute:.3g}, communication {pair.comm:.3g}, exposed {pair.exposed_comm:.3g}, "
                f"F&B {pair.makespan:.3g} (F+B {pair.serial:.3g})"
            )
            if details is None:
                title = f"one F&B pair, {comp.layers} layer(s): {stats}"
            else:
                hw = details["hardware"]
                layers = f"{comp.layers} MoE layer{'s' if comp.layers > 1 else ''}"
                title = (
                    f"DeepSeek-V3 F&B pair (model, ms): {TOKENS_PER_MICRO_BATCH}-token micro-batches, {layers}, "
                    f"EP{details['ep']} over {details['nodes']} nodes, IB {hw['ib_gbps']:g} GB/s, "
                    f"MFU {hw['mfu']:g} on {hw['compute_sms']}/{hw['sms']} SMs\n{stats}"
                )
            plot_overlap_timeline(pair.events, args.fig4, title)
    if args.png:
        plot_timeline(res, args.png)
    if args.json:
        print(json.dumps(out))
        return 0
    formula = "outside its exact domain" if res.formula is None else f"{res.formula:g}"
    print(f"{res.schedule}: pp={res.pp} ranks, {res.chunks} micro-batches, makespan {res.makespan:g}")
    print(
        f"  bubble (max idle over ranks) {res.bubble:g}; published {res.formula_text} = "
        f"{res.formula_unchecked} ({formula})"
    )
    print(f"  idle per rank {[round(i, 6) for i in res.idle]}")
    print(f"  peak activations per rank {res.peak_activations}; parameter copies per rank {res.param_copies}")
    if comp is not None:
        fp, st = out["fb_pair"], out["step"]
        ratio = "n/a" if fp["compute_to_a2a"] is None else f"{fp['compute_to_a2a']:.3g}"
        print(
            f"  F&B pair: computation {fp['compute']:.4g}, communication {fp['comm']:.4g} (all-to-all "
            f"{fp['a2a']:.4g}; computation:all-to-all = {ratio}:1), exposed {fp['exposed_comm']:.4g}, "
            f"F&B {fp['fb']:.4g} vs F+B {fp['serial_f_plus_b']:.4g}"
        )
        print(
            f"  step makespan {st['makespan_overlap']:.6g} with overlap, {st['makespan_no_overlap']:.6g} without "
            f"({st['speedup']:.3f}x)"
        )
        if details is not None and "lora" in details:
            lo = details["lora"]
            print(
                f"  LoRA rank {lo['rank']} on {','.join(lo['targets'])}{' + routed experts' if lo['experts'] else ''}"
                f": frozen base, W = the adapters' weight gradients ({comp.w:.4g} of B {comp.b:.4g} per chunk)"
            )
        if details is not None:
            be = details["break_even_mfu"]
            be2 = details["break_even_mfu_a2a_only"]
            print(
                f"  communication fully hidden in a pair up to MFU {'> 1' if be is None else f'{be:.3f}'} "
                f"({'> 1' if be2 is None else f'{be2:.3f}'} without the PP sends)"
            )
    if args.png:
        print(f"  timeline: {args.png}")
    if args.fig4:
        print(f"  F&B pair: {args.fig4}")
    return 0
