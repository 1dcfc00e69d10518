"""Pipeline bubble in Megatron's `pretrain()`: DualPipeV (and DualPipe) vs 1F1B (the plugin's schedules as Megatron's
forward-backward function), idle fraction per pipeline rank and step time, measured on gloo ranks.

Each schedule is one run of `python -m dsv3_plugin.megatron.pretrain_gpt --nproc P` (mock data, tiny preset, same
flags but `--dsv3-pipeline-schedule`); figures from the runtime's per-step accounting in `--dsv3-metrics`: a rank's
idle fraction = idle / (busy + idle) over the measured iterations. `ours` = DualPipeV's mean idle fraction,
`baseline` = 1F1B's, `ratio` = baseline / ours. `--ep N` > 1 also runs both DualPipes with the FB-pair overlap off
and reports the exposed all-to-all and step time on and off. Needs megatron-core >= 0.19 (`megatron.training`);
with an older one it prints why and exits 2.

Design notes (what is summed, step time, the overlap runs): docs/design_notes.md#bench-megatron-pipeline
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks import ROOT, positive_int

__all__ = ["add_arguments", "run", "summarize"]

SCHEDULES = ("dualpipev", "dualpipe", "1f1b")  # ours, DualPipe, the baseline


def add_arguments(p):
    p.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (spawned gloo processes)")
    p.add_argument(
        "--ep", type=positive_int, default=1, help="expert-parallel ranks per stage (> 1: the FB overlap on vs off)"
    )
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers of the tiny preset")
    p.add_argument("--micro-batch", type=positive_int, default=2, help="--micro-batch-size")
    p.add_argument("--chunks", type=positive_int, default=8, help="micro-batches per step (>= 2 x pp)")
    p.add_argument("--seq-len", type=positive_int, default=64, help="--seq-length")
    p.add_argument("--iters", type=positive_int, default=8, help="iterations per schedule")
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out of the figures")


def summarize(rows: list[dict], warmup: int) -> dict:
    """Per-rank idle fractions and the step time from `--dsv3-metrics` lines.

    Args:
        rows: the JSON lines of one run (each with `pipeline_ranks`).
        warmup: how many of the first iterations to leave out.

    Returns:
        {"iterations", "idle_fraction" (per rank), "idle_fraction_mean", "busy_s", "idle_s" (per rank, summed),
        "a2a_wait_s" (per rank, summed), "step_s" (median over iterations of the slowest rank's wall time)}.
    """
    rows = rows[warmup:]
    if not rows:
        raise ValueError("no measured iterations (--iters must exceed --warmup)")
    P = len(rows[0]["pipeline_ranks"])
    busy, idle, a2a = [0.0] * P, [0.0] * P, [0.0] * P
    for r in rows:
        for e in r["pipeline_ranks"]:
            busy[e["pp"]] += e["busy_s"]
            idle[e["pp"]] += e["idle_s"]
            a2a[e["pp"]] += e["a2a_wait_s"]
    frac = [i / (b + i) if b + i > 0 else 0.0 for b, i in zip(busy, idle)]
    return {
        "iterations": [r["iteration"] for r in rows],
        "idle_fraction": frac,
        "idle_fraction_mean": sum(frac) / P,
        "busy_s": busy,
        "idle_s": idle,
        "a2a_wait_s": a2a,
        "step_s": statistics.median(max(e["wall_s"] for e in r["pipeline_ranks"]) for r in rows),
    }


def _flags(args, schedule: str, cfg_path: str, metrics: str) -> list[str]:
    return [
        "--nproc",
        str(args.pp * args.ep),
        "--expert-model-parallel-size",
        str(args.ep),
        "--dsv3-config",
        cfg_path,
        "--dsv3-metrics",
        metrics,
        "--dsv3-pipeline-schedule",
        schedule,
        "--spec",
        "dsv3_plugin.megatron",
        "layer_spec",
        "--pipeline-model-parallel-size",
        str(args.pp),
        "--micro-batch-size",
        str(args.micro_batch),
        "--global-batch-size",
        str(args.micro_batch * args.chunks * args.ep),  # data parallel = ep: `chunks` micro-batches per replica
        "--seq-length",
        str(args.seq_len),
        "--train-iters",
        str(args.iters),
        "--lr",
        "1e-3",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--log-interval",
        "1",
        "--eval-interval",
        "1000000",
        "--eval-iters",
        "0",
        "--seed",
        "1234",
    ]


def run(args) -> dict:
    from importlib.util import find_spec

    if find_spec("megatron") is None or find_spec("megatron.training") is None:
        print(
            "error: python -m benchmarks megatron-pipeline: needs megatron-core >= 0.19 (megatron.training, Megatron's "
            "pretrain() loop); this environment has none",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.chunks < 2 * args.pp:
        print(f"error: --chunks {args.chunks}: DualPipeV needs >= 2 x --pp = {2 * args.pp}", file=sys.stderr)
        raise SystemExit(2)
    if args.pp % 2 or args.chunks % 2:
        print(f"error: --pp {args.pp} --chunks {args.chunks}: DualPipe needs both even", file=sys.stderr)
        raise SystemExit(2)
    if args.warmup < 0 or args.warmup >= args.iters:
        print(f"error: --warmup {args.warmup}: must be >= 0 and < --iters {args.iters}", file=sys.stderr)
        raise SystemExit(2)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    res: dict = {
        "pp": args.pp,
        "layers": args.layers,
        "micro_batch": args.micro_batch,
        "chunks": args.chunks,
        "seq_len": args.seq_len,
        "iters": args.iters,
        "warmup": args.warmup,
        "schedules": {},
    }
    with tempfile.TemporaryDirectory(prefix="dsv3-bench-megatron-pipeline-") as tmp:
        block = {"preset": "tiny", "model": {"num_hidden_layers": args.layers}}
        runs = [(s, s, block) for s in SCHEDULES]
        if args.ep > 1:  # the two-chunk schedules once more, their FB pairs run forward then backward
            off = {**block, "parallel": {"overlap_ep_comm": False}}
            runs += [(f"{s}_no_overlap", s, off) for s in ("dualpipev", "dualpipe")]
        for name, s, blk in runs:
            cfg_path, metrics = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.jsonl")
            with open(cfg_path, "w") as f:
                json.dump({"dsv3": blk}, f)
            cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", *_flags(args, s, cfg_path, metrics)]
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"pretrain_gpt --dsv3-pipeline-schedule {s} ({name}) failed:\n{p.stderr[-4000:]}")
            with open(metrics) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            res["schedules"][name] = summarize(rows, args.warmup)
    ours, base = res["schedules"]["dualpipev"], res["schedules"]["1f1b"]
    res["figure"] = "mean idle fraction per pipeline rank in Megatron's pretrain(): DualPipeV (ours) vs 1F1B (baseline)"
    res["ours"], res["baseline"] = ours["idle_fraction_mean"], base["idle_fraction_mean"]
    res["ratio"] = base["idle_fraction_mean"] / max(ours["idle_fraction_mean"], 1e-12)
    res["step_s"] = {s: res["schedules"][s]["step_s"] for s in SCHEDULES}
    res["step_ratio"] = base["step_s"] / ours["step_s"]
    both = res["schedules"]["dualpipe"]
    res["dualpipe_ratio"] = base["idle_fraction_mean"] / max(both["idle_fraction_mean"], 1e-12)
    res["dualpipe_step_ratio"] = base["step_s"] / both["step_s"]
    if args.ep > 1:
        res["ep"] = args.ep
        res["overlap"] = {}
        for s in ("dualpipev", "dualpipe"):
            on, off = res["schedules"][s], res["schedules"][f"{s}_no_overlap"]
            a_on, a_off = sum(on["a2a_wait_s"]), sum(off["a2a_wait_s"])
            res["overlap"][s] = {
                "a2a_wait_s": {"on": a_on, "off": a_off},
                "a2a_wait_ratio": a_off / max(a_on, 1e-12),
                "step_s": {"on": on["step_s"], "off": off["step_s"]},
                "step_ratio": off["step_s"] / on["step_s"],
            }
    return res
