"""The W split in training (DeepSeek-V3 §3.2.1): per-rank idle fraction of `dsv3 train`'s pipeline step with the
weight gradients deferred to the W ops vs computed inside B, on spawned gloo ranks.

Each rank wraps the same model in two `PipelinedEngine`s, `parallel.split_weight_grads` on and off, trained on the
same micro-batches in alternating order. A rank's idle fraction is idle / (busy + idle) over the measured steps
(the runtime's own accounting; DualPipe's mirror gradient exchange apart as `grad_sync_s`). `ours` = mean idle
fraction with the split, `baseline` without, `ratio` = baseline / ours; `w_closures` counts the deferred jobs.

Design notes (what a step runs, the accounting): docs/design_notes.md#bench-pipeline
"""

from __future__ import annotations

import torch

from benchmarks import positive_int
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.data.synthetic import MarkovData
from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
from dsv3_plugin.parallel.distributed import init_distributed, spawn
from dsv3_plugin.schedule_traits import SCHEDULES, check_chunks
from dsv3_plugin.training.pipelined import idle_figures
from dsv3_plugin.training.transforms import build_model

SCHEDULE_CHOICES = sorted(n for n, t in SCHEDULES.items() if t.has_w and n != "zb1p")  # what `dsv3 train` runs


def add_arguments(p):
    p.add_argument("--pp", type=positive_int, default=2, help="pipeline ranks (spawned gloo processes)")
    p.add_argument(
        "--schedule",
        choices=SCHEDULE_CHOICES + ["all"],
        default="all",
        help="pipeline schedule(s) to measure (default: all with W ops)",
    )
    p.add_argument("--preset", default="tiny", help="dsv3 preset of the model")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence")
    p.add_argument(
        "--mtp-depth",
        type=int,
        default=None,
        help="MTP depth (default: the preset's; 0 balances DualPipe(V)'s stages: MTP sits on the last one)",
    )
    p.add_argument("--micro-batch", type=positive_int, default=2, help="sequences per micro-batch")
    p.add_argument("--chunks", type=positive_int, default=8, help="micro-batches per step (>= 2 x pp)")
    p.add_argument("--steps", type=positive_int, default=4, help="measured steps per variant (after one warm-up)")


def _ds(a: dict, schedule: str, split: bool) -> dict:
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
            "parallel": {"pp": a["pp"], "schedule": schedule, "split_weight_grads": split},
            "train": {"seq_len": a["seq_len"], "seed": 1234},
            **({} if a["mtp_depth"] is None else {"mtp": {"depth": a["mtp_depth"]}}),
        },
    }


def _rank_main(a: dict) -> dict:
    torch.set_num_threads(1)
    init_distributed("gloo")
    out = {}
    for schedule in a["schedules"]:
        engines = {}
        for split in (True, False):
            ds = _ds(a, schedule, split)
            cfg = DSv3Config.from_block(ds["dsv3"])
            torch.manual_seed(cfg.train.seed)
            engines[split] = PipelinedEngine(build_model(cfg), ds, cfg)
        data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
        for step in range(a["steps"] + 1):
            parts = [data.batch(step, m, 0, a["micro_batch"]) for m in range(a["chunks"])]
            ids, labels = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            for split in (True, False) if step % 2 == 0 else (False, True):
                engines[split].train_step(ids, labels)
        res = {}
        for split, pe in engines.items():
            res["on" if split else "off"] = idle_figures(pe.step_times[1:])
        out[schedule] = res
    return out


def run(args) -> dict:
    import sys

    schedules = SCHEDULE_CHOICES if args.schedule == "all" else [args.schedule]
    a = {
        "pp": args.pp,
        "preset": args.preset,
        "layers": args.layers,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "chunks": args.chunks,
        "steps": args.steps,
        "mtp_depth": args.mtp_depth,
        "schedules": schedules,
    }
    try:
        for s in schedules:
            check_chunks(s, args.pp, args.chunks, chunks_key="--chunks", pp_key="--pp")
            DSv3Config.from_block(_ds(a, s, True)["dsv3"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    per_rank = spawn(_rank_main, args.pp, a, timeout_s=3600)
    res: dict = {k: v for k, v in a.items() if k != "schedules"}
    res["schedules"] = {}
    for s in schedules:
        on = [pr[s]["on"] for pr in per_rank]
        off = [pr[s]["off"] for pr in per_rank]
        mean_on = sum(r["idle_fraction"] for r in on) / len(on)
        mean_off = sum(r["idle_fraction"] for r in off) / len(off)
        res["schedules"][s] = {
            "idle_fraction_split": [r["idle_fraction"] for r in on],
            "idle_fraction_no_split": [r["idle_fraction"] for r in off],
            "idle_fraction_split_mean": mean_on,
            "idle_fraction_no_split_mean": mean_off,
            "ratio": mean_off / max(mean_on, 1e-12),
            "per_rank": [{"rank": i, "split": r_on, "no_split": r_off} for i, (r_on, r_off) in enumerate(zip(on, off))],
        }
    first = res["schedules"][schedules[0]]
    res["figure"] = f"mean idle fraction of {schedules[0]}'s training step, W split on (ours) vs off (baseline)"
    res["ours"], res["baseline"], res["ratio"] = (
        first["idle_fraction_split_mean"],
        first["idle_fraction_no_split_mean"],
        first["ratio"],
    )
    return res
