"""The training loop, framework-neutral: steps, telemetry, EMA, logging, checkpoint cadence, resume, summary.

`run(engine, data, run_dir, cfg, total)` drives any engine with the `TrainEngine` interface; the DeepSpeed
adapter implements it twice (`deepspeed.train`: the ZeRO-1 engine at pp = 1, the pipelined engine at pp > 1).
Per optimizer step the loop reads this data-parallel rank's `gas` micro-batches (a pure function of (seed, step,
micro-batch, rank), so the data position of a checkpoint is the next step index; the time it waits for them is
`data_wait_s`), lets the engine run the forwards, backwards, optimizer step and router-bias update, updates the EMA
shard, records routing telemetry, evaluates on the data's valid set (`eval_loss`, every `eval_every` steps and at
the end), logs one JSON line (rank 0; and to `metrics_sink`) and saves at `train.save_every` and at the end, with
the data position and the data's fingerprint in the client state. Metrics are means over micro-batches and ranks,
identical on every rank. `--resume` restores the engine's checkpoint, the telemetry totals and this rank's EMA
shard and continues at the saved step: the continued run's losses equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from tqdm import tqdm

from dsv3_plugin.data.batch import Batch
from dsv3_plugin.data.packed import SYNTHETIC_FINGERPRINT, data_change
from dsv3_plugin.errors import CheckpointError, DataError, Preempted
from dsv3_plugin.parallel.distributed import peer_failures
from dsv3_plugin.training.ema import EMA
from dsv3_plugin.training.metrics_file import metrics_line
from dsv3_plugin.training.preemption import StopRequests, exit_status
from dsv3_plugin.training.run_dir import RunDir
from dsv3_plugin.training.run_report import finish
from dsv3_plugin.training.telemetry import RoutingTelemetry

__all__ = ["TrainEngine", "StepResult", "run", "ema_shard", "ema_path", "atomic_save", "data_fingerprint"]


class StepResult(dict):
    """What `TrainEngine.train_step` returns (a dict): "loss", "lm_loss", "mtp_loss", "balance_loss" (means over
    the step's micro-batches and the data-parallel ranks), "step_tokens" (input tokens of all ranks in this step),
    "tokens_seen" (after the step), "gamma" (the bias update speed the step used), "maxvio_layers" (MaxVio of
    every MoE layer, model order) and "bias_stats" (what `balancing.update_expert_bias` returned, for the
    telemetry; None where the engine keeps no full-model telemetry)."""


class TrainEngine(Protocol):
    """One framework's optimizer step over this rank's model, as the loop sees it."""

    module: nn.Module  # this rank's parameters (its pipeline stages at pp > 1): EMA, summary, fingerprints
    micro_batch: int  # sequences per micro-batch
    gas: int  # micro-batches per optimizer step
    dp_rank: int  # which data-parallel rank's batches this rank reads
    dp: int  # data-parallel ranks
    batch_device: Any  # where the micro-batches go (None: CPU)
    telemetry: RoutingTelemetry | None  # full-model routing telemetry, or None
    description: str  # the progress bar's label

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        """One optimizer step over gas `data.batch.Batch` micro-batches (input_ids, labels [B, T], and packed rows'
        position_ids / padding token_mask when given; (input_ids, labels) tuples are read as `Batch(*t)`);
        collective. `step_tokens` / `tokens_seen` count input tokens (padding included)."""

    def eval_loss(self, micro_batches: list[Batch]) -> tuple[float, int]:
        """(the LM cross-entropy summed over the loss tokens, the number of loss tokens) of `micro_batches`, both
        summed over the data-parallel ranks; collective (every rank passes as many micro-batches), the same result
        on every rank. Under `torch.no_grad()`: no router-bias update, no expert loads counted, no telemetry, no
        optimizer state touched; the model's train mode is restored."""

    def lr(self) -> float:
        """The learning rate of the last step."""

    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (what clipping compared), None when not computed."""

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        """Weights, optimizer, non-parameter state and `client_state` under `ckpt_dir/tag`; collective. Must not
        write `latest` (`RunDir.save` writes it after the completion marker) and should raise a failed write
        (a full disk) only after its own collectives ran on every rank."""

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict:
        """Restore what `save_checkpoint` wrote; returns its `client_state`."""

    def finish(self) -> dict | None:
        """End of the run (collective): the engine's own report for the summary (pipeline busy/idle), or None."""


def data_fingerprint(data) -> dict:
    """What a checkpoint records of the data it was trained on (`dsv3_plugin.data.packed.data_change` compares)."""
    fp = getattr(data, "fingerprint", None)
    return fp() if fp is not None else dict(SYNTHETIC_FINGERPRINT)


def atomic_save(obj, path: str) -> None:
    """`torch.save` to a temporary name, then rename: a crash never leaves half a file under `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def ema_path(ckpt: str, tag: str | None, rank: int) -> str:
    """Where rank `rank` keeps its EMA shard inside checkpoint `tag` (None: the `latest` one)."""
    if tag is not None:
        return os.path.join(ckpt, tag, f"ema_rank{rank}.pt")
    latest = os.path.join(ckpt, "latest")
    if not os.path.isfile(latest):
        raise CheckpointError(f"{latest}: missing; cannot find the EMA shard to resume")
    with open(latest) as f:
        path = os.path.join(ckpt, f.read().strip(), f"ema_rank{rank}.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (the run was saved without dsv3.memory.ema)")
    return path


def ema_shard(module: nn.Module, cfg, dp_rank: int, dp: int) -> EMA | None:
    """memory.ema: this rank's CPU EMA shard of `module` (its pipeline stages at pp > 1). Every parameter is
    averaged by exactly one rank of the ranks holding it: dense parameters are split by name over the
    data-parallel group, this EP rank's experts over its expert-data-parallel group (dp/ep ranks)."""
    if not cfg.memory.ema:
        return None
    ep = cfg.parallel.ep
    dense = sorted(n for n, p in module.named_parameters() if getattr(p, "allreduce", True))
    expert = sorted(n for n, p in module.named_parameters() if not getattr(p, "allreduce", True))
    names = dense[dp_rank::dp] + expert[dp_rank // ep :: dp // ep]
    return EMA(module, cfg.memory.ema_decay, names=names)


def run(
    engine: TrainEngine,
    data,
    run_dir: RunDir,
    cfg,
    total: int,
    *,
    world: int,
    progress: bool = True,
    echo: bool = False,
    summary: bool = False,
    checkpoint_bytes_read: int = 0,
    rss_before_model: int = 0,
    data_note: str = "",
    metrics_sink: Callable[[dict], None] | None = None,
) -> dict:
    """Train from the run directory's resume point (or step 0) to step `total` on this rank.

    Args:
        engine: the framework's step (see `TrainEngine`).
        data: batches by `data.batch(step, micro, rank, batch_size[, device])` -> a `data.batch.Batch` (or
            (ids [B, T], labels [B, T]) from the synthetic data), handed to the engine as they are;
            `data.entropy_rate` is the loss floor (None: unknown), `data.description` the data source the summary
            names; optional `data.eval_batches(dp_rank[, device])` (the fixed valid micro-batches, evaluated every
            `cfg.train.data.eval_every` steps and at the end through `engine.eval_loss`) and `data.fingerprint()`
            (recorded with every checkpoint).
        run_dir: the locked run directory (metrics.jsonl, checkpoints, resume tag).
        cfg: the `DSv3Config` (train.log_every, train.save_every, memory.ema, parallel.p2p_timeout_s).
        total: the step index to reach.
        world: number of ranks; progress: a tqdm bar on rank 0; echo: JSON lines and summary on stdout;
        summary: the short human summary; checkpoint_bytes_read, rss_before_model: memory facts for the summary.
        data_note: appended to the summary's data line (e.g. that --init-from did not change the data).
        metrics_sink: called on rank 0 with each record written to metrics.jsonl, after it is written (the
            framework's experiment trackers, e.g. `deepspeed.monitor.MonitorSink`); None: none.

    Returns:
        What `run_report.finish` returns: history, summary, router biases, parameter checksum, notes.
    """
    rank, timeout = run_dir.rank, cfg.parallel.p2p_timeout_s
    fingerprint = data_fingerprint(data)
    ema = ema_shard(engine.module, cfg, engine.dp_rank, engine.dp)
    start = _resume(engine, ema, run_dir, fingerprint)
    run_dir.start_metrics(start)
    bar = _bar(progress and rank == 0, total, start, engine.description)
    history: list[dict] = []
    evaluate = _evaluator(engine, data, cfg, total)
    # SIGTERM / SIGINT / SIGUSR1 and the wall-clock budget: agreed by every rank at each step boundary
    stops = StopRequests(cfg.train.exit_after_minutes, _collective_device(engine)).install()

    def save(tag: str, done: int) -> None:
        client = {"data_step": done, "data": fingerprint}
        if engine.telemetry is not None:
            client["telemetry"] = engine.telemetry.state_dict()
        engine.save_checkpoint(run_dir.ckpt, tag, client)
        if ema is not None:  # each rank its own shard (client_state is written by one rank per model file)
            atomic_save(ema.state_dict(), ema_path(run_dir.ckpt, tag, rank))

    def save_tag(done: int) -> None:
        t0 = time.perf_counter()
        tag = f"step{done}"
        run_dir.save(tag, done, lambda: save(tag, done), engine.module)  # free space, marker, latest, keep_last
        stops.note_save(time.perf_counter() - t0)

    timing = [0.0, 0.0]  # seconds in steps, of which waiting for micro-batches (kept out of the JSON lines)
    t_run = time.perf_counter()
    try:
        for step in range(start, total):
            with peer_failures(f"training step {step + 1}", timeout):
                rec, step_s, wait_s = _step(engine, data, ema, step)
                timing[0] += step_s
                timing[1] += wait_s
                stops.note_step(step_s)
                evaluate(rec)
                history.append(rec)
                saved = _after_step(rec, run_dir, cfg, total, echo, bar, save_tag, metrics_sink)
                if rec["step"] < total:
                    _stop_if_asked(stops, rec["step"], total, saved, save_tag, run_dir, cfg)
    finally:
        if bar is not None:
            bar.close()
        if ema is not None:
            ema.close()
        stops.uninstall()
    wall = time.perf_counter() - t_run
    with peer_failures("end of the run (engine report)", timeout):
        report = engine.finish()
    return finish(
        engine.module,
        history,
        run_dir,
        world,
        wall,
        data.entropy_rate,
        echo,
        summary,
        checkpoint_bytes_read,
        pipeline=report,
        rss_before_model=rss_before_model,
        data_description=data.description + data_note,
        data_wait_s=timing[1],
        step_s=timing[0],
    )


def _resume(engine: TrainEngine, ema: EMA | None, run_dir: RunDir, fingerprint: dict) -> int:
    """With --resume: the engine's checkpoint, the telemetry totals and this rank's EMA shard. Returns the step to
    start from (the data position), after checking the checkpoint was trained on this data (the run directory
    checked its completion marker already; this is the checkpoint's own record)."""
    if not run_dir.resume_tag:
        return 0
    client = engine.load_checkpoint(run_dir.resume_ckpt, run_dir.resume_tag)
    why = data_change(client.get("data"), fingerprint)
    if why:
        raise DataError(f"--resume {run_dir.resume_ckpt}/{run_dir.resume_tag}: trained on other data ({why})")
    if engine.telemetry is not None and "telemetry" in client:  # running totals: metrics continue uninterrupted
        engine.telemetry.load_state_dict(client["telemetry"])
    if ema is not None:
        path = ema_path(run_dir.resume_ckpt, run_dir.resume_tag, run_dir.rank)
        ema.load_state_dict(torch.load(path, weights_only=True))
    return int(client["data_step"])


def _step(engine: TrainEngine, data, ema: EMA | None, step: int) -> tuple[dict, float, float]:
    """One optimizer step over this data-parallel rank's micro-batches; returns its metrics (identical on every
    rank), the step's seconds and the seconds of it spent reading the micro-batches."""
    t0 = time.perf_counter()
    kw = {} if engine.batch_device is None else {"device": engine.batch_device}
    batches = [data.batch(step, micro, engine.dp_rank, engine.micro_batch, **kw) for micro in range(engine.gas)]
    wait = time.perf_counter() - t0
    r = engine.train_step(batches)
    if ema is not None:
        ema.update()  # after the optimizer step; the copy to CPU overlaps the next step
    dt = time.perf_counter() - t0
    mv = r["maxvio_layers"]
    rec = {
        "step": step + 1,
        **{k: r[k] for k in ("loss", "lm_loss", "mtp_loss", "balance_loss")},
        "maxvio": sum(mv) / len(mv) if mv else 0.0,
        "tokens_per_s": r["step_tokens"] / dt,
        "tokens_seen": r["tokens_seen"],
        "gamma": r["gamma"],
        "lr": engine.lr(),
        "grad_norm": engine.grad_norm(),
        "maxvio_layers": mv,
    }
    if engine.telemetry is not None:  # collective: every rank records
        rec.update(engine.telemetry.record(r["bias_stats"]))
    return rec, dt, wait


def _evaluator(engine: TrainEngine, data, cfg, total: int):
    """`evaluate(rec)`: at the steps `dsv3.train.data.eval_every` names and at the last one, the LM loss on this
    data-parallel rank's fixed valid micro-batches, summed over every rank by the engine (sum of token losses /
    loss tokens), into `rec["eval_loss"]`. A no-op without a valid set. Collective."""
    eval_every = getattr(cfg.train.data, "eval_every", 0)
    if not callable(getattr(data, "eval_batches", None)):
        return lambda rec: None
    kw = {} if engine.batch_device is None else {"device": engine.batch_device}
    batches = data.eval_batches(engine.dp_rank, **kw)
    if not batches:
        return lambda rec: None

    def evaluate(rec: dict) -> None:
        done = rec["step"]
        if done == total or (eval_every and done % eval_every == 0):
            loss_sum, count = engine.eval_loss(batches)
            rec["eval_loss"] = float(loss_sum) / float(count) if count else None

    return evaluate


def _after_step(rec: dict, run_dir: RunDir, cfg, total: int, echo: bool, bar, save_tag, sink=None) -> bool:
    """Rank 0 logs the step (metrics.jsonl, then `sink`); at `train.save_every` and at the last step
    `save_tag(done)` writes the checkpoint (every rank: ZeRO-1 state is partitioned) and the run directory records
    it. Returns whether it saved."""
    done = rec["step"]
    if run_dir.rank == 0:
        _log_step(rec, done, total, cfg.train.log_every, echo, run_dir.metrics_path, bar, sink)
    if run_dir.ckpt and ((cfg.train.save_every and done % cfg.train.save_every == 0) or done == total):
        save_tag(done)
        return True
    return False


def _collective_device(engine: TrainEngine):
    """Where a small all-reduce over the world goes: the backend's device (CUDA under NCCL), else CPU (None)."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _stop_if_asked(stops: StopRequests, done: int, total: int, saved: bool, save_tag, run_dir: RunDir, cfg) -> None:
    """At the boundary after step `done`: if any rank was signalled (or the budget is spent), every rank saves
    step `done` (unless this step already saved) and raises `Preempted` with the exit status and the one line
    the launcher prints. Collective (one all-reduce, see `preemption.StopRequests.agree`)."""
    signum = stops.agree()
    if signum < 0:
        return
    reason = stops.reason(signum, cfg.train.exit_after_minutes)
    if run_dir.ckpt is None:
        where = "nothing saved (the run saves no checkpoints: no --out, or save disabled)"
    else:
        if not saved:
            stops.saving = True
            save_tag(done)
            stops.saving = False
        out = os.path.dirname(os.path.abspath(run_dir.ckpt))
        where = f"saved {os.path.join(run_dir.ckpt, f'step{done}')}; continue with the same command and --resume {out}"
    raise Preempted(f"dsv3 train: stopped after step {done} of {total} ({reason}); {where}", exit_status(signum))


def _log_step(rec: dict, done: int, total: int, log_every: int, echo: bool, metrics_path, bar, sink=None) -> None:
    """Rank 0: one JSON line every `dsv3.train.log_every` steps (and the last) to metrics.jsonl (flushed per line,
    so a crash tears at most the last line), with `echo` to stdout, and the same record to `sink`."""
    if done % log_every == 0 or done == total:
        line = metrics_line(rec)  # non-finite values as null: what read_jsonl accepts back
        if echo:
            print(line, flush=True)
        if metrics_path:
            with open(metrics_path, "a") as f:
                f.write(line + "\n")
        if sink is not None:
            sink(rec)
    if bar is not None:
        bar.set_postfix(loss=f"{rec['loss']:.3f}", maxvio=f"{rec['maxvio']:.3f}", refresh=False)
        bar.update(1)


def _bar(show: bool, total: int, start: int, desc: str):
    if not show:
        return None
    return tqdm(total=total, initial=start, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
