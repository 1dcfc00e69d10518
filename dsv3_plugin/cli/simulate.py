"""`dsv3 simulate`: per-rank timeline, bubble, activations and parameter copies of a pipeline schedule,
computed from the same op lists the runtime executes; `--png` draws it, `--table` prints the comparison
with the published formulas."""
from __future__ import annotations

import json
import sys
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.simulate import Durations, comparison_table, plot_timeline, simulate
from dsv3_plugin.schedule_traits import SCHEDULES


def register(sub):
    p = sub.add_parser("simulate", help="simulate a pipeline schedule (bubble, memory, timeline PNG)")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="dualpipev")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (DualPipeV runs 2*pp stages on them)")
    p.add_argument("--chunks", type=int, default=None, help="micro-batches per step (default 4*pp)")
    p.add_argument("--f", type=float, default=1.0, help="forward time of one stage chunk")
    p.add_argument("--b", type=float, default=2.0, help="full backward time (input + weight grads)")
    p.add_argument("--w", type=float, default=1.0, help="weight-grad part of --b")
    p.add_argument("--fb", type=float, default=None, help="time of an overlapped F&B pair (default f+b)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeline", action="store_true", help="include every op's start/end in the JSON")
    p.add_argument("--png", default=None, help="write the timeline picture here")
    p.add_argument("--table", action="store_true", help="print the simulated-vs-published comparison table")
    p.set_defaults(func=run)


def _bad(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:

    if args.pp < 1:
        return _bad(f"--pp must be >= 1 (got {args.pp})")
    if args.table:
        rows, text = comparison_table(args.pp, args.chunks)
        print(json.dumps({"pp": args.pp, "rows": rows}) if args.json else text)
        return 0
    if min(args.f, args.b, args.w) < 0 or args.w > args.b:
        return _bad(f"need f, b, w >= 0 and w <= b (got f={args.f}, b={args.b}, w={args.w})")
    if args.fb is not None and args.fb <= 0:
        return _bad(f"--fb must be > 0 (got {args.fb})")
    chunks = args.chunks or 4 * args.pp
    try:
        spec = build_schedule(args.schedule, args.pp, chunks)
    except ValueError as e:
        return _bad(f"--schedule {args.schedule}: {e}")
    res = simulate(spec, Durations(args.f, args.b, args.w, args.fb))
    if args.png:
        plot_timeline(res, args.png)
    if args.json:
        print(json.dumps(res.to_json(with_timeline=args.timeline)))
    else:
        formula = "outside its exact domain" if res.formula is None else f"{res.formula:g}"
        print(f"{res.schedule}: pp={res.pp} ranks, {res.chunks} micro-batches, makespan {res.makespan:g}")
        print(f"  bubble (max idle over ranks) {res.bubble:g}; published {res.formula_text} = "
              f"{res.formula_unchecked} ({formula})")
        print(f"  idle per rank {[round(i, 6) for i in res.idle]}")
        print(f"  peak activations per rank {res.peak_activations}; parameter copies per rank {res.param_copies}")
        if args.png:
            print(f"  timeline: {args.png}")
    return 0
