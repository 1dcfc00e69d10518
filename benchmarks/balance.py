"""Aux-loss-free balancing on a skewed synthetic task: MaxVio_global with the bias update (γ > 0) vs without.

Trains the tiny model (AdamW, in-process, single rank, experts behind the expert-parallel layer at EP = 1 so
dispatch counters are measured) on Zipf-distributed tokens, whose frequent tokens overload the experts
they prefer. The only difference between the two runs is γ (same seed, data, init). Each run writes
`OUT/gamma_<γ>/metrics.jsonl` (the telemetry lines of `dsv3 train`) and the bench writes `OUT/routing.png`
(`dsv3 plot-routing`). `ratio` = MaxVio_global(γ=0) / MaxVio_global(γ) (> 1: the bias update balances).
"""

from __future__ import annotations

import os
import sys

import torch

from benchmarks import positive_int
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.moe.balancing import update_expert_bias
from dsv3_plugin.parallel.expert_parallel import expert_parallel
from dsv3_plugin.parallel.groups import single_process_groups
from dsv3_plugin.training.metrics_file import metrics_line
from dsv3_plugin.training.routing_plot import plot_routing
from dsv3_plugin.training.telemetry import RoutingTelemetry
from dsv3_plugin.training.transforms import build_model

__all__ = ["add_arguments", "run", "train_balance"]


def add_arguments(p) -> None:
    p.add_argument("--steps", type=positive_int, default=200)
    p.add_argument("--warmup", type=int, default=60, help="steps excluded from MaxVio_global")
    p.add_argument("--gamma", type=float, default=0.005, help="bias update speed of the balanced run")
    p.add_argument("--batch", type=positive_int, default=16)
    p.add_argument("--seq", type=positive_int, default=64)
    p.add_argument("--zipf", type=float, default=0.8, help="Zipf exponent of the token distribution")
    p.add_argument("--out", default="runs/balance", help="directory for metrics.jsonl files and routing.png")
    p.add_argument("--seed", type=int, default=0)


def _batch(gen, V, B, T, s):
    p = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** s
    ids = torch.multinomial(p / p.sum(), B * (T + 1), replacement=True, generator=gen).view(B, T + 1)
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(99))
    ids = perm[ids]
    return ids[:, :-1], (ids[:, 1:] * 7 + ids[:, :-1]) % V  # a learnable, token-dependent target


def train_balance(
    gamma: float,
    out_dir: str,
    steps: int,
    warmup: int,
    batch: int,
    seq: int,
    zipf: float,
    seed: int,
    progress: bool = True,
) -> list[dict]:

    cfg = DSv3Config.from_block(
        {"preset": "tiny", "moe": {"bias_update_speed": gamma, "seq_aux_alpha": 0.0}, "mtp": {"depth": 0}}
    )
    torch.manual_seed(seed)
    model = build_model(cfg)
    model.reset_parameters(seed=seed)
    expert_parallel(model, single_process_groups())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    tel = RoutingTelemetry(model, warmup_steps=warmup)
    gen = torch.Generator().manual_seed(seed + 1)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, "metrics.jsonl.tmp")
    rows = []
    with open(tmp, "w") as f:
        for step in range(1, steps + 1):
            ids, labels = _batch(gen, cfg.model.vocab_size, batch, seq, zipf)
            out = model(ids, labels=labels)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            stats = update_expert_bias(model, gamma)
            rec = {"step": step, "loss": float(out.loss.detach()), "gamma": gamma, **tel.record(stats)}
            rec["maxvio"] = rec["maxvio_batch"]
            rows.append(rec)
            f.write(metrics_line(rec) + "\n")  # non-finite values as null, as dsv3 train writes them
            if progress and (step % 25 == 0 or step == steps):
                print(
                    f"[bench balance] γ={gamma:g} step {step}: loss {rec['loss']:.3f} maxvio_batch "
                    f"{rec['maxvio_batch']:.3f} maxvio_global {rec['maxvio_global'] or float('nan'):.3f}",
                    file=sys.stderr,
                )
    os.replace(tmp, os.path.join(out_dir, "metrics.jsonl"))
    return rows


def run(args) -> dict:

    runs = {}
    for g in (args.gamma, 0.0):
        d = os.path.join(args.out, f"gamma_{g:g}")
        runs[g] = (d, train_balance(g, d, args.steps, args.warmup, args.batch, args.seq, args.zipf, args.seed))
    png = plot_routing([runs[args.gamma][0], runs[0.0][0]], os.path.join(args.out, "routing.png"))
    ours, base = runs[args.gamma][1][-1], runs[0.0][1][-1]
    return {
        "bench": "balance",
        "steps": args.steps,
        "warmup": args.warmup,
        "gamma": args.gamma,
        "ours": {
            "maxvio_global": ours["maxvio_global"],
            "maxvio_batch_last": ours["maxvio_batch"],
            "loss_last": ours["loss"],
            "tokens_dropped": ours["tokens_dropped"],
        },
        "theirs": {
            "name": "same run with γ = 0 (no bias update)",
            "maxvio_global": base["maxvio_global"],
            "maxvio_batch_last": base["maxvio_batch"],
            "loss_last": base["loss"],
            "tokens_dropped": base["tokens_dropped"],
        },
        "ratio": base["maxvio_global"] / max(ours["maxvio_global"], 1e-12),
        "png": png,
        "runs": [runs[args.gamma][0], runs[0.0][0]],
    }
