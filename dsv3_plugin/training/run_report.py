"""The end of a training run: the summary (JSON and a short human text), the loss/MaxVio PNG, every rank's memory
facts, and the fingerprints tests compare (router biases, a parameter checksum).

`finish` is what `training.loop.run` calls after the last step; `window_maxvio` is MaxVio_global (paper §4.5.2:
max expert load / mean load − 1) over a fixed window of steps.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Any

import torch

from dsv3_plugin.model.moe.balancing import maxvio
from dsv3_plugin.training.rank_local import param_bytes
from dsv3_plugin.training.routing_plot import plot_routing
from dsv3_plugin.training.run_dir import RunDir
from dsv3_plugin.training.telemetry import read_metrics

__all__ = ["finish", "maxvio_of", "window_maxvio", "rss_bytes"]


def maxvio_of(stats: Any) -> list[float]:
    """Per-MoE-layer MaxVio from what `balancing.update_expert_bias` returned."""
    return [float(s["maxvio"]) for s in (stats or [])]


def finish(
    model,
    history: list[dict],
    run: RunDir,
    world: int,
    wall_s: float,
    loss_floor: float,
    echo: bool,
    summary: bool,
    checkpoint_bytes_read: int = 0,
    pipeline: dict | None = None,
    rss_before_model: int = 0,
    data_description: str = "",
    data_wait_s: float = 0.0,
    step_s: float = 0.0,
) -> dict:
    """End of a run: PNGs, the summary (JSON on stdout with `echo`, human text with `summary`; rank 0 prints, one
    summary per run) and final-state fingerprints (plain Python values, so they can cross process boundaries).

    Args:
        model: this rank's module (its stages at pp > 1): parameter bytes, router biases, checksum.
        history: the per-step metric records, identical on every rank.
        run: the run directory (metrics.jsonl, PNGs, checkpoints).
        world: number of ranks; wall_s: seconds of the step loop; loss_floor: the data's loss floor (nats; None:
            unknown, as for real text).
        checkpoint_bytes_read: bytes this rank read from `--init-from`.
        pipeline: the pipelined engine's per-rank busy/idle times, reported under the summary's "pipeline" key.
        rss_before_model: RSS just before the model was built (the runtime's share of the peak).
        data_description: what the run trained on, one line of the summary (so that no run hides its data).
        data_wait_s: seconds this rank's loop waited for its micro-batches, of `step_s` seconds in steps (the
            summary reports the rank that waited longest, also as a share of its step time).

    Returns:
        {"history", "summary" (with this rank's `peak_rss_bytes`, `rss_before_model_bytes`, `param_bytes`,
        `checkpoint_bytes_read` and every rank's under "ranks"), "router_bias": {buffer name: list},
        "param_checksum": float64 sum of all parameters, "notes": what the run directory said on stderr}.
        Collective when the process group is up: every rank calls it.
    """
    out = run.out
    files = []
    if run.rank == 0 and out and run.metrics_path:
        rows = read_metrics(run.metrics_path)
        files.append(run.metrics_path)
        if rows:
            _write_png(rows, os.path.join(out, "train.png"))
            files.append(os.path.join(out, "train.png"))
            if any(r.get("moe_layers") for r in rows):  # routing telemetry (the pipelined loop has none yet)
                files.append(plot_routing([out], os.path.join(out, "routing.png")))
    if run.ckpt and history:
        files.append(os.path.join(run.ckpt, f"step{history[-1]['step']}"))
    summ = _summary(history, world, wall_s, loss_floor, files, data_description)
    summ.update(_rank_memory(model, checkpoint_bytes_read, rss_before_model, data_wait_s, step_s))
    _data_wait(summ, history)
    peak = max(r["peak_rss_bytes"] for r in summ["ranks"])
    read = max(r["checkpoint_bytes_read"] for r in summ["ranks"])
    summ["text"] += (
        f"\n  memory         peak RSS {peak / 2**30:.2f} GiB (largest rank), parameters "
        f"{summ['param_bytes'] / 2**30:.3f} GiB on this rank"
        + (f", read {read / 1e9:.3f} GB of the checkpoint (largest rank)" if read else "")
    )
    if pipeline is not None and history:
        summ["pipeline"] = pipeline
        fr = ", ".join(f"{r['idle_fraction']:.3f}" for r in pipeline["ranks"])
        summ["text"] += (
            f"\n  pipeline       idle fraction per rank {fr} ({pipeline['schedule']}, W split "
            f"{'on' if pipeline['split_weight_grads'] else 'off'}, {pipeline['steps_measured']} steps)"
        )
        if any(r["grad_sync_s"] for r in pipeline["ranks"]):
            gs = ", ".join(f"{r['grad_sync_s'] / max(r['wall_s'], 1e-12):.3f}" for r in pipeline["ranks"])
            summ["text"] += f"\n  pipeline       mirror gradient exchange per rank {gs} of the step (not idle)"
    if run.rank == 0:
        if echo:
            print(json.dumps({"summary": {k: v for k, v in summ.items() if k != "text"}}), flush=True)
        if summary:
            print(summ["text"], file=sys.stderr if echo else sys.stdout, flush=True)
    with torch.no_grad():
        biases = {n: b.tolist() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {
        "history": history,
        "summary": summ,
        "router_bias": biases,
        "param_checksum": checksum,
        "notes": list(run.notes),
    }


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _data_wait(summ: dict, history: list[dict]) -> None:
    """`data_wait_s` (the largest rank's wait for micro-batches) and `data_wait_pct` (of that rank's step time,
    which includes the wait) into the summary, and a line of its text."""
    if not history:
        return
    worst = max(summ["ranks"], key=lambda r: r["data_wait_s"])
    summ["data_wait_s"] = worst["data_wait_s"]
    summ["data_wait_pct"] = 100.0 * worst["data_wait_s"] / worst["step_s"] if worst["step_s"] > 0 else None
    pct = f" = {summ['data_wait_pct']:.2f} % of the step time" if summ["data_wait_pct"] is not None else ""
    summ["text"] += f"\n  data wait      {summ['data_wait_s']:.3f} s (largest rank, reading micro-batches){pct}"


def _rank_memory(
    module, checkpoint_bytes_read: int, rss_before_model: int = 0, data_wait_s: float = 0.0, step_s: float = 0.0
) -> dict:
    """This rank's memory facts, and every rank's (gathered, in rank order, under "ranks"): peak RSS (ru_maxrss:
    KiB on Linux), the RSS just before the model was built (the process's runtime: Python, torch, DeepSpeed, the
    process groups; peak minus it is what the model, its optimizer and the steps added), bytes of its parameters
    (after the pipeline / EP split), bytes it read from `--init-from`. Collective when the process group is up:
    every rank calls it."""
    mine = {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_model_bytes": int(rss_before_model),
        "param_bytes": param_bytes(module),
        "checkpoint_bytes_read": int(checkpoint_bytes_read),
        "data_wait_s": float(data_wait_s),
        "step_s": float(step_s),
    }
    ranks = [mine]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    return {**mine, "ranks": [{"rank": r, **m} for r, m in enumerate(ranks)]}


def window_maxvio(rows: list[dict]) -> float | None:
    """MaxVio_global over a window of steps: per MoE layer, max/mean − 1 of the expert loads summed over `rows`
    (the same definition as the running `maxvio_global`, over a fixed number of steps), averaged over layers."""
    rows = [r for r in rows if r.get("moe_layers")]
    if not rows:
        return None
    vals = []
    for name in rows[0]["moe_layers"]:
        loads_E = torch.tensor([r["moe_layers"][name]["loads"] for r in rows], dtype=torch.float64).sum(0)
        vals.append(maxvio(loads_E))
    return sum(vals) / len(vals)


def _summary(
    history: list[dict], world: int, wall_s: float, loss_floor: float, files: list[str], data_description: str
) -> dict:
    if not history:
        text = "dsv3 train: nothing to do (already at the requested step)"
        return {"steps": 0, "line": text, "text": text}
    first, last = history[0], history[-1]
    n = len(history)
    k = max(1, min(10, n // 2))  # window: up to 10 steps at each end, never overlapping
    head, tail = history[:k], history[-k:]
    tps = sum(r["tokens_per_s"] for r in tail) / len(tail)
    mv_first, mv_last = window_maxvio(head), window_maxvio(tail)
    dropped = [r.get("tokens_dropped") for r in history if r.get("tokens_dropped") is not None]
    line = (
        f"dsv3 train: steps {first['step']}-{last['step']} on {world} rank(s) in {wall_s:.1f} s ({tps:,.0f} tokens/s)"
    )
    floor = "" if loss_floor is None else f"; the data's floor is {loss_floor:.2f}"
    lines = [
        line,
        f"  loss           {first['loss']:.3f} -> {last['loss']:.3f}   (LM {first['lm_loss']:.3f} -> "
        f"{last['lm_loss']:.3f}{floor})",
    ]
    evals = [(r["step"], r["eval_loss"]) for r in history if r.get("eval_loss") is not None]
    if evals:
        span = f"{evals[0][1]:.3f} (step {evals[0][0]}) -> " if len(evals) > 1 else ""
        lines.append(
            f"  eval_loss      {span}{evals[-1][1]:.3f} (step {evals[-1][0]})   (LM loss on the valid set, every "
            "rank's rows)"
        )
    if data_description:  # what the run trained on: no run hides its data
        lines.append(f"  data           {data_description}")
    if mv_first is not None and n > 1:
        s0, s1 = (f"steps {w[0]['step']}-{w[-1]['step']}" if k > 1 else f"step {w[0]['step']}" for w in (head, tail))
        lines.append(
            f"  MaxVio_global  {mv_first:.3f} over {s0} -> {mv_last:.3f} over {s1}   "
            f"(max expert load / mean - 1; 0 = balanced)"
        )
        lines.append(
            f"                 {last['maxvio_global']:.3f} over the whole run; per-step batches "
            f"(MaxVio_batch) {first['maxvio_batch']:.3f} -> {last['maxvio_batch']:.3f}"
        )
    else:
        lines.append(
            f"  MaxVio         {first['maxvio']:.3f} -> {last['maxvio']:.3f}   "
            f"(per step, mean over MoE layers; 0 = balanced)"
        )
    if dropped:
        lines.append(f"  tokens dropped {sum(dropped)}")
    if files:
        lines.append("  wrote " + ", ".join(files))
    ok = all(math.isfinite(r["loss"]) for r in history)
    return {
        "steps": n,
        "first_step": first["step"],
        "last_step": last["step"],
        "wall_s": wall_s,
        "first_loss": first["loss"],
        "last_loss": last["loss"],
        "first_maxvio": first["maxvio"],
        "last_maxvio": last["maxvio"],
        "window": k,
        "maxvio_global_first_window": mv_first,
        "maxvio_global_last_window": mv_last,
        "maxvio_global_run": last.get("maxvio_global"),
        "tokens_dropped": sum(dropped) if dropped else None,
        "tokens_per_s": tps,
        "eval_loss": evals[-1][1] if evals else None,
        "finite": ok,
        "files": files,
        "data": data_description,
        "line": line,
        "text": "\n".join(lines),
    }


def _write_png(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r["loss"] for r in rows], label="loss")
    a.plot(steps, [r["lm_loss"] for r in rows], label="lm_loss")
    a.plot(steps, [r["mtp_loss"] for r in rows], label="mtp_loss")
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if ev:  # the held-out LM loss, at the evaluation steps
        a.plot(*zip(*ev), "o-", color="C3", label="eval_loss")
    a.set_xlabel("step"), a.set_ylabel("nats"), a.legend(), a.set_title("losses")
    b.plot(steps, [r["maxvio"] for r in rows], color="C3")
    b.set_xlabel("step"), b.set_ylabel("MaxVio (mean over MoE layers)"), b.set_title("expert load imbalance")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
