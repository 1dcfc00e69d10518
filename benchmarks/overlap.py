"""Computation-communication overlap (DeepSeek-V3 §3.2.1, Fig. 4): exposed EP all-to-all time of DualPipe's FB pairs
with the overlap hook vs F then B, in `dsv3 train`'s pipelined step on spawned gloo ranks.

pp x ep ranks each wrap the same model in two `PipelinedEngine`s, `parallel.overlap_ep_comm` on and off, trained
on the same micro-batches in alternating order; per op kind the runtime splits op time into all-to-all waits,
pipeline-peer waits and compute. `ours` = exposed all-to-all time per FB pair with the hook (mean over ranks),
`baseline` = the same F then B, `ratio` = baseline / ours; `fb_pair_wall_s` per variant. `--timeline PNG` draws
one measured FB pair as a computation and a communication lane; `--events JSON` writes its events.

Design notes (the engines, the accounting, the timeline's pair): docs/design_notes.md#bench-overlap
"""

from __future__ import annotations

import json

import torch

from benchmarks import positive_int
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.data.synthetic import MarkovData
from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
from dsv3_plugin.parallel import overlap
from dsv3_plugin.parallel.distributed import init_distributed, spawn
from dsv3_plugin.parallel.pipeline.overlap_timeline import plot_overlap_timeline
from dsv3_plugin.schedule_traits import SCHEDULES, check_chunks
from dsv3_plugin.training.transforms import build_model

SCHEDULE_CHOICES = sorted(n for n, t in SCHEDULES.items() if t.has_fb)
OPS = ("F", "B", "I", "W", "FB")


def add_arguments(p):
    p.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks")
    p.add_argument(
        "--ep",
        type=positive_int,
        default=2,
        help="expert-parallel degree (= data-parallel ranks; pp x ep spawned gloo processes)",
    )
    p.add_argument("--schedule", choices=SCHEDULE_CHOICES, default="dualpipev", help="pipeline schedule")
    p.add_argument("--preset", default="small", help="dsv3 preset of the model")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence")
    p.add_argument("--mtp-depth", type=int, default=0, help="MTP depth (0: DualPipe(V)'s stages balanced)")
    p.add_argument("--micro-batch", type=positive_int, default=2, help="sequences per micro-batch")
    p.add_argument("--chunks", type=positive_int, default=8, help="micro-batches per step (>= 2 x pp)")
    p.add_argument("--steps", type=positive_int, default=4, help="measured steps per variant (after one warm-up)")
    p.add_argument("--fp8-dispatch", action="store_true", help="FP8 dispatch payload (fp8.enabled, fp8.dispatch)")
    p.add_argument("--timeline", metavar="PNG", default=None, help="draw one measured FB pair with the hook")
    p.add_argument("--events", metavar="JSON", default=None, help="write that pair's timeline events")
    p.add_argument(
        "--timeline-rank",
        type=int,
        default=None,
        help="global rank whose pair is drawn (default: pp - 1, i.e. the last pipeline rank of dp rank 0)",
    )


def _ds(a: dict, hook: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": a["micro_batch"],
        "gradient_accumulation_steps": a["chunks"],
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {
            "preset": a["preset"],
            "model": {"num_hidden_layers": a["layers"]},
            "moe": {"ranks_per_node": 1},
            "parallel": {"pp": a["pp"], "ep": a["ep"], "schedule": a["schedule"], "overlap_ep_comm": hook},
            "mtp": {"depth": a["mtp_depth"]},
            **({"fp8": {"enabled": True, "dispatch": True}} if a["fp8_dispatch"] else {}),
            "train": {"seq_len": a["seq_len"], "seed": 1234},
        },
    }


def _per_op(times: list[dict]) -> dict:
    """Sums over the measured steps, per op kind: op_s, a2a_wait_s, p2p_wait_s, compute_s (the rest)."""
    out = {}
    for k in OPS:
        op = sum(t.get(f"op_s_{k}", 0.0) for t in times)
        if op == 0.0:
            continue
        a2a = sum(t.get(f"a2a_wait_s_{k}", 0.0) for t in times)
        p2p = sum(t.get(f"p2p_wait_s_{k}", 0.0) for t in times)
        out[k] = {"op_s": op, "a2a_wait_s": a2a, "p2p_wait_s": p2p, "compute_s": op - a2a - p2p}
    return out


def _rank_main(a: dict) -> dict:
    torch.set_num_threads(1)
    init_distributed("gloo")
    engines = {}
    for hook in (True, False):
        ds = _ds(a, hook)
        cfg = DSv3Config.from_block(ds["dsv3"])
        torch.manual_seed(cfg.train.seed)
        engines[hook] = PipelinedEngine(build_model(cfg), ds, cfg)
    pe = engines[True]
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    spec = pe.runtime.spec(a["chunks"])
    fb_ops = [op for op in spec.ops[pe.g.pp_rank] if op.kind == "FB"]
    pick = len(fb_ops) // 2
    events, losses = None, {True: [], False: []}
    for step in range(a["steps"] + 1):
        parts = [data.batch(step, m, pe.g.dp_rank, a["micro_batch"]) for m in range(a["chunks"])]
        ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        for hook in (True, False) if step % 2 == 0 else (False, True):
            if hook and step == a["steps"] and fb_ops:
                with overlap.recording(pair_index=pick) as rec:
                    losses[hook].append(engines[hook].train_step(ids, labels)["loss"])
                op = fb_ops[pick]
                events = [{**ev, "mb": op.mb if ev["chunk"] == "F" else op.mb2} for ev in rec.finished()]
            else:
                losses[hook].append(engines[hook].train_step(ids, labels)["loss"])
    res = {
        "events": events,
        "fb_op": str(fb_ops[pick]) if fb_ops else None,
        "n_fb": len(fb_ops),
        "losses_equal": losses[True] == losses[False],
        "losses": losses[True],
        "engines_overlap_ep": [engines[True].overlap_ep, engines[False].overlap_ep],
    }
    for hook, eng in engines.items():
        times = eng.step_times[1:]
        res["hook" if hook else "sequential"] = {
            "per_op": _per_op(times),
            "wall_s": sum(t["wall_s"] for t in times),
            "fb_hook": sum(t["fb_hook"] for t in times),
        }
    return res


def run(args) -> dict:
    import sys

    a = {
        "pp": args.pp,
        "ep": args.ep,
        "schedule": args.schedule,
        "preset": args.preset,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "mtp_depth": args.mtp_depth,
        "micro_batch": args.micro_batch,
        "chunks": args.chunks,
        "steps": args.steps,
        "fp8_dispatch": args.fp8_dispatch,
    }
    try:
        check_chunks(args.schedule, args.pp, args.chunks, chunks_key="--chunks", pp_key="--pp")
        if args.ep < 2:
            raise ConfigError("--ep: must be >= 2 (no all-to-all to overlap at ep = 1)")
        DSv3Config.from_block(_ds(a, True)["dsv3"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    rank = args.pp - 1 if args.timeline_rank is None else args.timeline_rank
    if not 0 <= rank < args.pp * args.ep:
        print(f"error: --timeline-rank: must be in [0, {args.pp * args.ep}) (got {rank})", file=sys.stderr)
        raise SystemExit(2)
    res = summarize(spawn(_rank_main, args.pp * args.ep, a, timeout_s=3600), a, rank)
    ev = res.pop("_events")
    if args.events and ev:
        with open(args.events, "w") as f:
            json.dump(ev, f, indent=1)
        res["events"] = args.events
    if args.timeline and ev:
        tl = res["timeline_pair"]
        title = (
            f"measured FB pair {tl['op']} on rank {rank} (pipeline rank {rank % args.pp}; {args.schedule}, "
            f"pp={args.pp}, ep={args.ep}, gloo, "
            f"{args.preset} x {args.layers} layers): {tl['pair_s'] * 1e3:.1f} ms, of which neither chunk "
            f"computes {tl['exposed_s'] * 1e3:.1f} ms"
        )
        res["timeline"] = plot_overlap_timeline(ev, args.timeline, title)
    return res


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize(per_rank: list[dict], a: dict, timeline_rank: int = 0) -> dict:
    """The bench's JSON from the ranks' results (`_rank_main`); the events of `timeline_rank`'s drawn pair under
    "_events"."""
    pp, steps = a["pp"], a["steps"]
    res: dict = dict(a)
    res["ranks"] = []
    for r, pr in enumerate(per_rank):
        n_fb = pr["n_fb"] * steps
        row = {"rank": r, "pp_rank": r % pp, "fb_pairs": n_fb}
        for v in ("hook", "sequential"):
            fb = pr[v]["per_op"].get("FB", {"op_s": 0.0, "a2a_wait_s": 0.0, "p2p_wait_s": 0.0, "compute_s": 0.0})
            row[v] = {
                "per_op": pr[v]["per_op"],
                "step_wall_s": pr[v]["wall_s"] / steps,
                "fb_pair_wall_s": fb["op_s"] / max(n_fb, 1),
                "fb_pair_a2a_wait_s": fb["a2a_wait_s"] / max(n_fb, 1),
                "fb_pairs_through_hook": pr[v]["fb_hook"],
            }
        res["ranks"].append(row)

    def mean(v, key):
        return sum(r[v][key] for r in res["ranks"]) / len(res["ranks"])

    ours, base = mean("hook", "fb_pair_a2a_wait_s"), mean("sequential", "fb_pair_a2a_wait_s")
    wall_h, wall_s = mean("hook", "fb_pair_wall_s"), mean("sequential", "fb_pair_wall_s")
    res["figure"] = (
        "exposed EP all-to-all time per FB pair (s, mean over ranks), overlap hook (ours) vs F then B "
        "(baseline), same run"
    )
    res["ours"], res["baseline"], res["ratio"] = ours, base, base / max(ours, 1e-12)
    res["fb_pair_wall_s"] = {"hook": wall_h, "sequential": wall_s, "ratio": wall_s / max(wall_h, 1e-12)}
    res["step_wall_s"] = {"hook": mean("hook", "step_wall_s"), "sequential": mean("sequential", "step_wall_s")}
    res["losses_equal"] = all(pr["losses_equal"] for pr in per_rank)
    ev = per_rank[timeline_rank]["events"]
    res["_events"] = ev
    if ev:
        pair = max(e["end"] for e in ev) - min(e["start"] for e in ev)
        busy = _union([(e["start"], e["end"]) for e in ev if e["lane"] == "compute"])
        res["timeline_pair"] = {
            "rank": timeline_rank,
            "op": per_rank[timeline_rank]["fb_op"],
            "pair_s": pair,
            "exposed_s": pair - busy,
        }
    return res
