"""Training under modeled Hopper FP8 hardware: loss curves with FP32 promotion every N_C = 128 vs none, against
the exact emulation (DeepSeek-V3 report §3.3.2).

Every run trains the same small DSv3 model (same weights, batches, AdamW) with all decoder-layer GEMMs in FP8
through one backend: `emulate` (exact FP8, FP32 per 128-chunk), `hopper-128` (mmaemu chains promoted every 128),
`hopper-none` (one chain over K) and `fp32` (no FP8). "No promotion" needs one scale per tensor
(`fp8.recipe = tensorwise`, the default here). Headline: `ours` = hopper-128's final loss (mean of the last `--tail`
steps), `baseline` = the emulation's, `ratio` = ours / baseline; `no_promotion` carries hopper-none's figures.

Design notes (the runs, the recipe, which GEMMs the modeled chains change): docs/design_notes.md#bench-fp8-hopper-train
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time

import torch

from benchmarks import positive_int
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.data.synthetic import MarkovData
from dsv3_plugin.precision.fp8.hopper import mmaemu_status
from dsv3_plugin.training.transforms import build_model

__all__ = ["add_arguments", "run", "RUNS", "train_run"]

RUNS = ("fp32", "emulate", "hopper-128", "hopper-none")


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=50)
    p.add_argument("--batch", type=positive_int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=positive_int, default=128, help="tokens per sequence (Wgrad K = batch × seq-len)")
    p.add_argument("--layers", type=positive_int, default=2, help="decoder layers (the first dense, the rest MoE)")
    p.add_argument("--experts", type=positive_int, default=4, help="routed experts (top-2, 2 groups)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--recipe", choices=("tensorwise", "blockwise"), default="tensorwise")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--tail", type=positive_int, default=5, help="final loss = mean of the last N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0 = torch's default)")
    p.add_argument("--png", default="runs/bench/fp8_hopper_train.png", help="loss curves ('' = none)")
    p.add_argument("--no-progress", action="store_true")


def _config(args, run_name: str) -> dict:
    ovr = {
        "preset": "tiny",
        "model": {"num_hidden_layers": args.layers},
        "moe": {"n_routed_experts": args.experts, "n_group": 2, "topk_group": 1, "top_k": 2},
        "mtp": {"depth": 0},
        "train": {"seq_len": args.seq_len},
    }
    if run_name == "fp32":
        return ovr
    fp8 = {"enabled": True, "recipe": args.recipe}
    if run_name == "emulate":
        fp8["backend"] = "emulate"
    else:
        nc = run_name.split("-", 1)[1]
        fp8.update(backend="hopper-emulated", promote_every=None if nc == "none" else int(nc))
    return {**ovr, "fp8": fp8}


def train_run(args, run_name: str, progress=None) -> dict:
    """Train one run; -> {"loss": [...], "s_per_step": float, "backend": str}."""
    cfg = DSv3Config.from_block(_config(args, run_name))
    torch.manual_seed(args.seed)
    m = build_model(cfg)
    m.reset_parameters(seed=args.seed)
    data = MarkovData(cfg.model.vocab_size, args.seq_len, seed=args.seed + 1)
    opt = torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    steps = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(  # 5-step warmup, cosine to 10% of the peak
        opt, lambda s: min(1.0, (s + 1) / 5) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        ids, lab = data.batch(step, 0, 0, args.batch)
        out = m(ids, lab)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(out.lm_loss.item())
        if not math.isfinite(losses[-1]):
            break
        if progress is not None:
            progress.update()
    rep = getattr(m, "fp8_report", None)
    return {
        "loss": losses,
        "s_per_step": (time.perf_counter() - t0) / max(1, len(losses)),
        "backend": rep.backend if rep is not None else "fp32 (no FP8)",
        "recipe": rep.recipe if rep is not None else None,
    }


def run(args) -> dict:
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> dict:
    if any(r.startswith("hopper") for r in args.runs):
        ok, why = mmaemu_status()
        if not ok:
            raise SystemExit(f"python -m benchmarks fp8-hopper-train: {why}")
    if args.recipe == "blockwise" and "hopper-none" in args.runs:
        raise SystemExit(
            "python -m benchmarks fp8-hopper-train: --runs hopper-none needs --recipe tensorwise (a per-128 "
            "scale is applied at promotion, so there is no 'no promotion' with blockwise scales)"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    t0 = time.perf_counter()
    res = {}
    for name in args.runs:
        with tqdm(total=args.steps, desc=name, file=sys.stderr, disable=args.no_progress) as bar:
            res[name] = train_run(args, name, bar)
    tail = min(args.tail, args.steps)
    for r in res.values():
        r["final_loss"] = statistics.mean(r["loss"][-tail:])
    out = {
        "bench": "fp8-hopper-train",
        "setup": {
            "steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "tokens_per_step": args.batch * args.seq_len,
            "layers": args.layers,
            "experts": args.experts,
            "recipe": args.recipe,
            "lr": args.lr,
            "seed": args.seed,
            "tail": tail,
        },
        "runs": res,
        "seconds": time.perf_counter() - t0,
    }
    if "emulate" in res:
        ref = res["emulate"]["loss"]
        for name, r in res.items():
            n = min(len(ref), len(r["loss"]))
            r["max_rel_diff_vs_emulate"] = max(abs(a - b) / abs(b) for a, b in zip(r["loss"][:n], ref[:n]))
        if "hopper-128" in res:
            ours, base = res["hopper-128"]["final_loss"], res["emulate"]["final_loss"]
            out.update(
                ours=ours,
                baseline=base,
                ratio=ours / base,
                headline="final loss: Hopper-modeled FP8 with promotion every 128 (ours) vs exact emulation",
            )
        if "hopper-none" in res:
            out["no_promotion"] = {
                "final_loss": res["hopper-none"]["final_loss"],
                "ratio_vs_emulate": res["hopper-none"]["final_loss"] / res["emulate"]["final_loss"],
            }
    if args.png:
        out["png"] = plot(out, args.png)
    return out


def plot(out: dict, path: str) -> str:
    """Left: loss per step of every run. Right: each FP8 run's loss minus the exact emulation's. Atomic write."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.6))
    colors = {"fp32": "tab:gray", "emulate": "k", "hopper-128": "tab:blue", "hopper-none": "tab:red"}
    for name, r in runs.items():
        ax.plot(range(1, len(r["loss"]) + 1), r["loss"], label=name, color=colors.get(name), lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (next token)")
    ax.legend()
    ax.grid(alpha=0.3)
    if "emulate" in runs:
        ref = runs["emulate"]["loss"]
        for name, r in runs.items():
            if name == "emulate":
                continue
            n = min(len(ref), len(r["loss"]))
            ax2.plot(
                range(1, n + 1),
                [a - b for a, b in zip(r["loss"][:n], ref[:n])],
                label=f"{name} − emulate",
                color=colors.get(name),
                lw=1.3,
            )
        ax2.axhline(0, color="k", lw=0.8)
        ax2.set_xlabel("step")
        ax2.set_ylabel("loss difference to the exact emulation")
        ax2.legend()
        ax2.grid(alpha=0.3)
    s = out["setup"]
    fig.suptitle(
        f"FP8 ({s['recipe']}) training under modeled Hopper accumulation: {s['layers']} layers, "
        f"{s['tokens_per_step']} tokens/step (Wgrad K), {s['steps']} steps"
    )
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=d)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
