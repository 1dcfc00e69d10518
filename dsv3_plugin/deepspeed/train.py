"""The `dsv3 train` loop: DeepSpeed ZeRO-1 on synthetic data, one JSON line per optimizer step.

`train(...)` runs in-process on each rank (self-spawned, torchrun, or the deepspeed launcher all call it the
same way after `init_distributed()`); it returns the per-step metrics, identical on every rank.

Per step: for each of the `gradient_accumulation_steps` micro-batches, engine(ids, labels) -> loss = LM +
λ/D·ΣMTP + α·balance -> engine.backward -> engine.step (the last one steps the optimizer and runs the
once-per-step bias update, see `dsv3_plugin.deepspeed`). Metrics are means over micro-batches and ranks.

Resume: `--steps` is the step to reach, not a count to add; a checkpoint stores the next step index (the
data position: batches are a pure function of (seed, step, micro-batch, rank)) and the engine's dsv3 state.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
from dsv3_plugin.config import ConfigError, load_config, read_ds_json
from dsv3_plugin.deepspeed import initialize, quiet_deepspeed_logs
from dsv3_plugin.deepspeed.engine import mixed_precision_dtype
from dsv3_plugin.deepspeed.moe_layer import prepare_model  # experts sharded over parallel.ep (DeepSpeed MoE groups)
from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
from dsv3_plugin.deepspeed.train_memory import host_memory_bytes
from dsv3_plugin.deepspeed.validate import validate_ds_config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.moe.balancing import maxvio
from dsv3_plugin.parallel.distributed import init_distributed, peer_failures, set_peer_timeout
from dsv3_plugin.training.data import MarkovData
from dsv3_plugin.training.ema import EMA
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local, param_bytes
from dsv3_plugin.training.routing_plot import plot_routing
from dsv3_plugin.training.run_dir import RunDir, checkpoint_dir
from dsv3_plugin.training.telemetry import RoutingTelemetry, read_metrics
from dsv3_plugin.training.transforms import build_model

__all__ = ["DEFAULT_DS_CONFIG", "train", "resolve_ds_config", "checkpoint_dir", "maxvio_of", "window_maxvio"]

# What `dsv3 train` runs with no --config (kept equal to examples/deepspeed/ds_config.json by a test).
DEFAULT_DS_CONFIG: dict = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 1},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10, "warmup_type": "linear"},
    },
    "dsv3": {"preset": "tiny", "moe": {"bias_update_speed": 0.01}, "train": {"seq_len": 64, "steps": 60, "seed": 1234}},
}


def resolve_ds_config(config: str | os.PathLike | dict | None) -> dict:
    """The DeepSpeed JSON as a dict (the built-in default when None), read by the one reader `config.read_ds_json`
    (ConfigError naming the file when it is not UTF-8 JSON with a "dsv3" block)."""
    if config is None:
        return copy.deepcopy(DEFAULT_DS_CONFIG)
    return read_ds_json(config)


def _ema_path(ckpt: str, tag: str | None, rank: int) -> str:
    """Where rank `rank` keeps its EMA shard inside DeepSpeed checkpoint `tag` (None: the `latest` one)."""
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


def _atomic_save(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def maxvio_of(stats: Any) -> list[float]:
    """Per-MoE-layer MaxVio from what `balancing.update_expert_bias` returned."""
    return [float(s["maxvio"]) for s in (stats or [])]


def _grad_norm(engine) -> float | None:
    """The global gradient norm of the last optimizer step (what gradient_clipping compared; every parameter
    counted once over all ranks), None when DeepSpeed did not compute one."""
    n = engine.get_global_grad_norm()
    return None if n is None else float(n)


def _f(x) -> float:
    """A loss term as a Python float (absent terms, e.g. MTP depth 0 or α = 0, are 0)."""
    return 0.0 if x is None else float(x.detach())


def _build_model(
    cfg,
    init_from: str | None,
    allow_non_finite: bool = False,
    rank: int = 0,
    world: int = 1,
    dtype: torch.dtype = torch.float32,
):
    """This rank's model, its parameters created directly in `dtype` (DeepSpeed's bf16/fp16 dtype: the same values
    DeepSpeed's own cast of an FP32 build gives, since every tensor is drawn or dequantized in FP32 and rounded
    once; router weight, bias and counts FP32, see `engine.prepare_mixed_precision`). With pp > 1 or ep > 1 only
    what this rank owns (`training.rank_local`: its stages' layers, its experts; built on `meta`), and with
    `init_from` only its tensors read."""
    layout = RankLayout.for_rank(cfg, rank, world)
    direct = not layout.is_full or dtype != torch.float32  # the FP32 full build is the plain one
    if init_from:
        # Shape from the released config.json, training knobs from the "dsv3" block (see _init_from_config).
        d = cfg.to_dict()
        return load_pretrained(
            init_from,
            dtype=dtype,
            device="cpu",
            allow_non_finite=allow_non_finite,
            layout=layout if direct else None,
            **{sec: d[sec] for sec in ("moe", "mtp", "parallel", "fp8", "memory", "train")},
        )
    return build_rank_local(cfg, layout, dtype) if direct else build_model(cfg)


def _init_from_config(ds: dict, init_from: str) -> dict:
    """Model shape from the released config.json; training knobs (γ, λ, α schedules, train.*) from the JSON."""
    if not isinstance(ds.get("dsv3"), dict):
        raise ConfigError('dsv3: the DeepSpeed JSON has no "dsv3" block')
    hf_path = os.path.join(init_from, "config.json")
    if not os.path.isfile(hf_path):
        raise CheckpointError(f"{hf_path}: not found (--init-from needs a released-format checkpoint dir)")
    asked = load_config({"dsv3": ds["dsv3"]})
    user = ds["dsv3"]
    hf = pretrained_config(init_from).to_dict()  # config.json, index, headers, tensor set: CheckpointError
    block = {"preset": None, "model": hf["model"], "moe": hf["moe"], "mtp": hf["mtp"]}
    for sec in ("moe", "mtp"):  # training-time knobs the user set explicitly win over the released file
        for k, v in (user.get(sec) or {}).items():
            block[sec][k] = v
    for sec in ("parallel", "fp8", "memory", "train"):
        block[sec] = asked.to_dict()[sec]
    out = dict(ds)
    out["dsv3"] = block
    return out


def _prepare(ds_config, steps, init_from, world_size: int | None = None):
    """Validate everything a rank would, before any process starts (bad input -> ConfigError, exit 2): the one
    validation (`dsv3_plugin.deepspeed.validate.validate_ds_config`, as `dsv3 check-config --nproc N` runs it) for
    `world_size` ranks (default: the initialised process group's) and this host's memory."""
    ds = resolve_ds_config(ds_config)
    if init_from:
        ds = _init_from_config(ds, init_from)
    if world_size is None and torch.distributed.is_initialized():
        world_size = torch.distributed.get_world_size()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks_on_host = int(local) if local and local.isdigit() and int(local) > 0 else (world_size or 1)
    checked = validate_ds_config(
        ds, target="train", world_size=world_size, ranks_on_host=ranks_on_host, host_memory=host_memory_bytes()
    )
    cfg = checked.cfg
    total = steps if steps is not None else cfg.train.steps
    if total <= 0:
        raise ConfigError(f"dsv3.train.steps: must be > 0 (got {total})")
    return checked.full(), cfg, total


def train(
    ds_config: str | os.PathLike | dict | None = None,
    *,
    steps: int | None = None,
    out: str | None = None,
    resume: str | None = None,
    init_from: str | None = None,
    progress: bool = True,
    echo: bool = False,
    summary: bool = False,
    save: bool = True,
    overwrite: bool = False,
    allow_non_finite: bool = False,
) -> dict:
    """Train on this rank (call after, or let it call, `init_distributed()`).

    Returns {"history": per-step metric dicts, "summary", "router_bias": {buffer name: list},
    "param_checksum": float64 sum of all parameters} — identical on every rank — and "notes" (what rank 0 said
    on stderr about the run directory: a resume that fell back to an older tag, a dropped torn metrics line).

    `steps` is the step index to reach (default `dsv3.train.steps`); with `resume` training continues from the
    checkpoint's step. Rank 0 shows a tqdm bar on stderr (if `progress`), appends one JSON line per logged step
    to OUT/metrics.jsonl, saves the DeepSpeed checkpoint in OUT/ckpt, and at the end writes OUT/train.png and
    OUT/routing.png. `echo`: the JSON lines and a JSON summary also go to stdout; `summary`: a short human summary
    (stdout, or stderr with `echo`). OUT is locked for the call; a fresh run into an OUT holding a previous run
    is refused unless `overwrite` (which deletes that run's files).
    """
    rank, world = init_distributed()
    ds, cfg, total = _prepare(ds_config, steps, init_from, world_size=world)
    # Every wait on a peer is bounded by parallel.p2p_timeout_s: the world group (and any group already made) from
    # here, the groups made later by expert parallelism, the pipeline and deepspeed.initialize when they are made.
    set_peer_timeout(cfg.parallel.p2p_timeout_s)
    with peer_failures("dsv3 train (start-up, resume or end of the run)", cfg.parallel.p2p_timeout_s):
        run = RunDir(out, resume, cfg, rank, world, overwrite, save)
        try:
            return _train(
                run,
                ds,
                cfg,
                total,
                rank,
                world,
                init_from=init_from,
                progress=progress,
                echo=echo,
                summary=summary,
                allow_non_finite=allow_non_finite,
            )
        finally:
            run.close()


# --- the loop ----------------------------------------------------------------------------------------
def _train(
    run: RunDir,
    ds: dict,
    cfg,
    total: int,
    rank: int,
    world: int,
    *,
    init_from,
    progress,
    echo,
    summary,
    allow_non_finite=False,
) -> dict:
    """Setup, resume, then one `_step` per optimizer step, each logged and checkpointed by `_after_step`."""
    _setup_process(cfg)
    rss0 = _rss_bytes()  # the runtime's share of peak_rss_bytes (Python, torch, DeepSpeed, process groups)
    model = _build_model(cfg, init_from, allow_non_finite, rank, world, mixed_precision_dtype(ds) or torch.float32)
    model.rss_before_model_bytes = rss0
    if cfg.parallel.pp > 1:
        return _train_pipelined(model, run, ds, cfg, total, rank, world, progress=progress, echo=echo, summary=summary)
    loop = _setup(model, ds, cfg, rank, world)
    start = _resume(loop, run)
    run.start_metrics(start)
    bar = _bar(progress and rank == 0, total, start, "dsv3 train")
    history: list[dict] = []
    loop.engine.train()
    t_run = time.perf_counter()
    for step in range(start, total):
        with peer_failures(f"training step {step + 1}", cfg.parallel.p2p_timeout_s):
            rec = _step(loop, step)
            history.append(rec)
            _after_step(rec, run, cfg, total, echo, bar, save=lambda tag, done: _save(loop, run, tag, done))
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    if loop.ema is not None:
        loop.ema.close()
    loop.engine.dsv3.remove()
    return _finish(
        model,
        history,
        run,
        world,
        wall,
        loop.data.entropy_rate,
        echo,
        summary,
        getattr(model, "checkpoint_bytes_read", 0),
        rss_before_model=model.rss_before_model_bytes,
    )


@dataclass
class _Loop:
    """What the pp = 1 loop holds across steps."""

    engine: Any  # DeepSpeed engine with the dsv3 hooks (`engine.dsv3`)
    telemetry: Any  # RoutingTelemetry: loads, MaxVio_batch/global, cross-node copies, dropped tokens
    ema: Any  # EMA or None (memory.ema)
    data: Any  # MarkovData
    rank: int
    world: int

    @property
    def micro_batches(self) -> tuple[int, int]:
        """(sequences per micro-batch, micro-batches per optimizer step)."""
        return self.engine.train_micro_batch_size_per_gpu(), self.engine.gradient_accumulation_steps()


def _setup_process(cfg) -> None:
    """Threads, the weights' seed, and quiet DeepSpeed: stdout carries only the JSON lines and the summary."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(cfg.train.seed)
    quiet_deepspeed_logs()
    _drop_startup_warning()
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)


def _setup(model, ds: dict, cfg, rank: int, world: int) -> _Loop:
    """Experts sharded over parallel.ep, the ZeRO-1 engine (with the BF16-moment AdamW under
    memory.bf16_moments), routing telemetry, the CPU EMA shard, the synthetic data."""
    prepare_model(model, cfg)
    engine, _, _, _ = initialize(model, ds)
    telemetry = RoutingTelemetry(model)
    ema = _ema(model, cfg, rank, world)  # memory.ema: CPU shadow, updated after each step
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    return _Loop(engine, telemetry, ema, data, rank, world)


def _resume(loop: _Loop, run: RunDir) -> int:
    """With --resume: the engine's checkpoint (weights, optimizer, dsv3 state, RNG), the telemetry totals and this
    rank's EMA shard. Returns the step to start from (the data position)."""
    if not run.resume_tag:
        return 0
    _, client = loop.engine.load_checkpoint(run.resume_ckpt, tag=run.resume_tag)
    start = int(client.get("data_step", loop.engine.dsv3.state.optimizer_steps))
    if "telemetry" in client:  # running totals (MaxVio_global): metrics continue as if uninterrupted
        loop.telemetry.load_state_dict(client["telemetry"])
    if loop.ema is not None:
        loop.ema.load_state_dict(torch.load(_ema_path(run.resume_ckpt, run.resume_tag, loop.rank), weights_only=True))
    return start


def _step(loop: _Loop, step: int) -> dict:
    """One optimizer step over the accumulation window; returns its metrics (identical on every rank)."""
    engine, (mbs, gas) = loop.engine, loop.micro_batches
    t0 = time.perf_counter()
    sums_4 = torch.zeros(4, dtype=torch.float64)  # loss, lm, mtp, balance summed over micro-batches
    for micro in range(gas):
        ids, labels = loop.data.batch(step, micro, loop.rank, mbs, device=engine.device)
        o = engine(ids, labels=labels)
        engine.backward(o.loss)
        engine.step()  # the last micro-batch's call steps the optimizer and the router biases
        sums_4 += torch.tensor([_f(o.loss), _f(o.lm_loss), _f(o.mtp_loss), _f(o.balance_loss)], dtype=torch.float64)
    if torch.distributed.is_initialized():
        sums_4 = sums_4.to(engine.device)
        torch.distributed.all_reduce(sums_4)
        sums_4 = sums_4.cpu()
    means = (sums_4 / (gas * loop.world)).tolist()
    if loop.ema is not None:
        loop.ema.update()  # after the optimizer step; the copy to CPU overlaps the next step
    dt = time.perf_counter() - t0
    st = engine.dsv3.state
    mv = maxvio_of(st.last_stats)
    return {
        "step": step + 1,
        "loss": means[0],
        "lm_loss": means[1],
        "mtp_loss": means[2],
        "balance_loss": means[3],
        "maxvio": sum(mv) / len(mv) if mv else 0.0,
        "tokens_per_s": st.last_step_tokens / dt,
        "tokens_seen": st.tokens_seen,
        "gamma": st.last_gamma,
        "lr": float(engine.get_lr()[0]),
        "grad_norm": _grad_norm(engine),
        "maxvio_layers": mv,
        **loop.telemetry.record(st.last_stats),
    }  # collective: every rank records


def _save(loop: _Loop, run: RunDir, tag: str, done: int) -> None:
    """The DeepSpeed checkpoint with the data position and telemetry, and this rank's EMA shard."""
    loop.engine.save_checkpoint(
        run.ckpt, tag=tag, client_state={"data_step": done, "telemetry": loop.telemetry.state_dict()}
    )
    if loop.ema is not None:  # each rank its own shard (DeepSpeed's client_state is written by rank 0 only)
        _atomic_save(loop.ema.state_dict(), _ema_path(run.ckpt, tag, loop.rank))


def _after_step(rec: dict, run: RunDir, cfg, total: int, echo: bool, bar, save) -> None:
    """Both loops: rank 0 logs the step; at `train.save_every` and at the last step `save(tag, done)` writes the
    checkpoint (every rank: ZeRO-1 state is partitioned) and the run directory records it."""
    done = rec["step"]
    if run.rank == 0:
        _log_step(rec, done, total, cfg.train.log_every, echo, run.metrics_path, bar)
    if run.ckpt and ((cfg.train.save_every and done % cfg.train.save_every == 0) or done == total):
        tag = f"step{done}"
        save(tag, done)
        run.saved(tag, done)


def _drop_startup_warning() -> None:
    """WarmupLR's constructor asks itself for a learning rate before step 0 and logs a warning about it, once per
    rank and run; the schedule is right (the first step uses warmup_min_lr). Drop only that record."""
    import logging

    from deepspeed.utils import logger

    msg = "Attempting to get learning rate from scheduler before it has started"
    if not any(getattr(f, "dsv3_msg", None) == msg for f in logger.filters):
        f = logging.Filter()
        f.dsv3_msg = msg
        f.filter = lambda record: not str(record.msg).startswith(msg)
        logger.addFilter(f)


def _bar(show: bool, total: int, start: int, desc: str):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)


def _ema(module, cfg, dp_rank: int, dp: int):
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


def _train_pipelined(
    model, run: RunDir, ds: dict, cfg, total: int, rank: int, world: int, *, progress, echo, summary
) -> dict:
    """`"parallel": {"pp": P > 1, "schedule": ...}`: pipelines of P consecutive ranks, ZeRO-1 over the
    data-parallel group (`dsv3_plugin.deepspeed.pipeline.PipelinedEngine`), experts over EP groups carved from
    it; one pipeline step over the JSON's gradient_accumulation_steps micro-batches per optimizer step; the data
    of a step belongs to the data-parallel rank, so every rank of a pipeline reads the same micro-batches.
    `--resume`: the engine's checkpoint (weights, optimizer, router biases, RNG), the data position and tokens
    seen, and this rank's EMA shard."""
    pe = PipelinedEngine(model, ds, cfg)
    ema = _ema(pe.module, cfg, pe.g.dp_rank, pe.g.dp)
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    start = tokens_seen = 0
    if run.resume_tag:
        client = pe.load_checkpoint(run.resume_ckpt, tag=run.resume_tag)
        start, tokens_seen = int(client["data_step"]), int(client["tokens_seen"])
        if ema is not None:
            ema.load_state_dict(torch.load(_ema_path(run.resume_ckpt, run.resume_tag, rank), weights_only=True))
    run.start_metrics(start)
    bar = _bar(progress and rank == 0, total, start, f"dsv3 train (pp={pe.g.pp}, {cfg.parallel.schedule})")
    history: list[dict] = []

    def save(tag: str, done: int) -> None:
        pe.save_checkpoint(run.ckpt, tag=tag, client_state={"data_step": done, "tokens_seen": tokens_seen})
        if ema is not None:  # each rank its own shard, like pp = 1
            _atomic_save(ema.state_dict(), _ema_path(run.ckpt, tag, rank))

    t_run = time.perf_counter()
    for step in range(start, total):
        with peer_failures(f"training step {step + 1}", cfg.parallel.p2p_timeout_s):
            rec = _step_pipelined(pe, data, cfg, step, tokens_seen)
            if ema is not None:
                ema.update()  # after the optimizer step; the arithmetic overlaps the next step
            tokens_seen = rec["tokens_seen"]
            history.append(rec)
            _after_step(rec, run, cfg, total, echo, bar, save=save)
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    if ema is not None:
        ema.close()
    with peer_failures("end of the run (pipeline busy/idle times)", cfg.parallel.p2p_timeout_s):
        pipe = pe.idle_report()
    return _finish(
        pe.module,
        history,
        run,
        world,
        wall,
        data.entropy_rate,
        echo,
        summary,
        getattr(model, "checkpoint_bytes_read", 0),
        pipeline=pipe,
        rss_before_model=model.rss_before_model_bytes,
    )


def _step_pipelined(pe, data, cfg, step: int, tokens_seen: int) -> dict:
    """One pipeline step over this data-parallel rank's micro-batches, the bias update, and its metrics."""
    t0 = time.perf_counter()
    g = pe.g
    parts = [data.batch(step, micro, g.dp_rank, pe.micro_batch) for micro in range(pe.gas)]
    ids = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    m = pe.train_step(ids, labels, tokens_seen=float(tokens_seen))
    gamma = cfg.moe.gamma(float(tokens_seen))
    stats = pe.update_expert_bias(gamma)
    step_tokens = ids.numel() * g.dp  # every rank of a pipeline trains on the same tokens
    # (MoE layer index, MaxVio) of every local MoE layer of every pipeline rank
    per_rank = pe.gather_pipeline([(s["moe_index"], float(s["maxvio"])) for s in stats])
    mv = [v for _, v in sorted(dict(x for xs in per_rank for x in xs).items())]  # model order, DualPipe's mirrors once
    dt = time.perf_counter() - t0
    return {
        "step": step + 1,
        **m,
        "maxvio": sum(mv) / len(mv) if mv else 0.0,
        "tokens_per_s": step_tokens / dt,
        "tokens_seen": tokens_seen + step_tokens,
        "gamma": gamma,
        "lr": float(pe.engine.get_lr()[0]),
        "grad_norm": _grad_norm(pe.engine),
        "maxvio_layers": mv,
    }


def _log_step(rec: dict, done: int, total: int, log_every: int, echo: bool, metrics_path, bar) -> None:
    """Rank 0: one JSON line every `dsv3.train.log_every` steps (and the last) to metrics.jsonl (flushed per line,
    so a crash tears at most the last line) and, with `echo`, to stdout."""
    if done % log_every == 0 or done == total:
        line = json.dumps(rec)
        if echo:
            print(line, flush=True)
        if metrics_path:
            with open(metrics_path, "a") as f:
                f.write(line + "\n")
    if bar is not None:
        bar.set_postfix(loss=f"{rec['loss']:.3f}", maxvio=f"{rec['maxvio']:.3f}", refresh=False)
        bar.update(1)


def _finish(
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
) -> dict:
    """End of a run (both loops): PNGs, summary (JSON with `echo`, human with `summary`), and final-state
    fingerprints (plain Python values, so they can cross process boundaries). The summary carries this rank's
    `peak_rss_bytes`, `rss_before_model_bytes`, `param_bytes` and `checkpoint_bytes_read`, and under "ranks" every
    rank's (rank 0 prints
    it: one summary line per run). `pipeline`: the pipelined loop's per-rank busy/idle times
    (`PipelinedEngine.idle_report`), reported under the summary's "pipeline" key."""
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
    summ = _summary(history, world, wall_s, loss_floor, files)
    summ.update(_rank_memory(model, checkpoint_bytes_read, rss_before_model))
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


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _rank_memory(module, checkpoint_bytes_read: int, rss_before_model: int = 0) -> dict:
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


def _summary(history: list[dict], world: int, wall_s: float, loss_floor: float, files: list[str]) -> dict:
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
    lines = [
        line,
        f"  loss           {first['loss']:.3f} -> {last['loss']:.3f}   (LM {first['lm_loss']:.3f} -> "
        f"{last['lm_loss']:.3f}; the data's floor is {loss_floor:.2f})",
    ]
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
        "finite": ok,
        "files": files,
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
    a.set_xlabel("step"), a.set_ylabel("nats"), a.legend(), a.set_title("losses")
    b.plot(steps, [r["maxvio"] for r in rows], color="C3")
    b.set_xlabel("step"), b.set_ylabel("MaxVio (mean over MoE layers)"), b.set_title("expert load imbalance")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
