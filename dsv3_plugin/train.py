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
import sys
import time
import warnings
from typing import Any

import torch

__all__ = ["DEFAULT_DS_CONFIG", "train", "resolve_ds_config", "checkpoint_dir", "maxvio_of"]

# What `dsv3 train` runs with no --config (kept equal to examples/deepspeed/ds_config.json by a test).
DEFAULT_DS_CONFIG: dict = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 10,
                             "warmup_type": "linear"}},
    "dsv3": {"preset": "tiny", "moe": {"bias_update_speed": 0.01}, "train": {"seq_len": 64, "steps": 60, "seed": 1234}},
}


def resolve_ds_config(config: "str | os.PathLike | dict | None") -> dict:
    """The DeepSpeed JSON as a dict (the built-in default when None)."""
    if config is None:
        return copy.deepcopy(DEFAULT_DS_CONFIG)
    if isinstance(config, dict):
        return copy.deepcopy(config)
    from .config import ConfigError
    path = os.fspath(config)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"dsv3: config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"dsv3: {path} is not valid JSON ({e})") from None


def checkpoint_dir(path: "str | os.PathLike") -> str:
    """A run's OUT dir or its `ckpt/` dir -> the DeepSpeed checkpoint dir (the one with `latest`)."""
    path = os.fspath(path)
    sub = os.path.join(path, "ckpt")
    return sub if os.path.isfile(os.path.join(sub, "latest")) else path


def _ema_path(ckpt: str, tag: str | None, rank: int) -> str:
    """Where rank `rank` keeps its EMA shard inside DeepSpeed checkpoint `tag` (None: the `latest` one)."""
    from .errors import CheckpointError
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


def _f(x) -> float:
    """A loss term as a Python float (absent terms, e.g. MTP depth 0 or α = 0, are 0)."""
    return 0.0 if x is None else float(x.detach())


def _build_model(cfg, init_from: str | None):
    if init_from:
        # Shape from the released config.json, training knobs from the "dsv3" block (see _init_from_config).
        from .checkpoint.hf import load_pretrained
        d = cfg.to_dict()
        return load_pretrained(init_from, dtype=torch.float32, device="cpu",
                               **{sec: d[sec] for sec in ("moe", "mtp", "parallel", "fp8", "memory", "train")})
    from .model import DSv3Model
    return DSv3Model(cfg)


def _init_from_config(ds: dict, init_from: str) -> dict:
    """Model shape from the released config.json; training knobs (γ, λ, α schedules, train.*) from the JSON."""
    from .config import ConfigError, DSv3Config, load_config
    from .errors import CheckpointError
    if not isinstance(ds.get("dsv3"), dict):
        raise ConfigError("dsv3: the DeepSpeed JSON has no \"dsv3\" block")
    hf_path = os.path.join(init_from, "config.json")
    if not os.path.isfile(hf_path):
        raise CheckpointError(f"{hf_path}: not found (--init-from needs a released-format checkpoint dir)")
    asked = load_config({"dsv3": ds["dsv3"]})
    user = ds["dsv3"]
    hf = DSv3Config.from_hf(hf_path).to_dict()
    block = {"preset": None, "model": hf["model"], "moe": hf["moe"], "mtp": hf["mtp"]}
    for sec in ("moe", "mtp"):  # training-time knobs the user set explicitly win over the released file
        for k, v in (user.get(sec) or {}).items():
            block[sec][k] = v
    for sec in ("parallel", "fp8", "memory", "train"):
        block[sec] = asked.to_dict()[sec]
    out = dict(ds)
    out["dsv3"] = block
    return out


def _prepare(ds_config, steps, init_from):
    """Validate everything a rank would, before any process starts (bad input -> ConfigError, exit 2)."""
    from .deepspeed.engine import split_ds_config
    ds = resolve_ds_config(ds_config)
    if init_from:
        ds = _init_from_config(ds, init_from)
    _, cfg = split_ds_config(ds)
    total = steps if steps is not None else cfg.train.steps
    if total <= 0:
        from .config import ConfigError
        raise ConfigError(f"dsv3.train.steps: must be > 0 (got {total})")
    return ds, cfg, total


def _rewrite_metrics(path: str, keep_until: int) -> None:
    rows = []
    if keep_until and os.path.isfile(path):
        with open(path) as f:
            rows = [x for x in f if x.strip() and json.loads(x)["step"] <= keep_until]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(rows)
    os.replace(tmp, path)


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


def train(ds_config: "str | os.PathLike | dict | None" = None, *, steps: int | None = None,
          out: str | None = None, resume: str | None = None, init_from: str | None = None,
          progress: bool = True, echo: bool = True, save: bool = True) -> dict:
    """Train on this rank (call after, or let it call, `init_distributed()`).

    Returns {"history": per-step metric dicts, "summary", "router_bias": {buffer name: list},
    "param_checksum": float64 sum of all parameters} — identical on every rank.

    `steps` is the step index to reach (default `dsv3.train.steps`); with `resume` training continues from the
    checkpoint's step. Rank 0 prints one JSON line per step (if `echo`), a tqdm bar on stderr (if `progress`),
    appends the lines to OUT/metrics.jsonl, saves the DeepSpeed checkpoint in OUT/ckpt and a PNG of the curves.
    """
    from .distributed import init_distributed
    rank, world = init_distributed()
    ds, cfg, total = _prepare(ds_config, steps, init_from)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(cfg.train.seed)

    from .deepspeed import initialize, quiet_deepspeed_logs
    from .data import MarkovData
    quiet_deepspeed_logs()  # stdout carries only the JSON lines and the summary
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    if cfg.memory.bf16_moments:
        from .config import ConfigError
        raise ConfigError("dsv3.memory.bf16_moments: not wired into dsv3 train's DeepSpeed optimizer yet; "
                          "use dsv3_plugin.bf16_adamw.make_optimizer as a client optimizer (docs/fp8.md)")
    model = _build_model(cfg, init_from)
    if cfg.parallel.pp > 1:
        if cfg.memory.ema:
            from .config import ConfigError
            raise ConfigError("dsv3.memory.ema: not supported together with parallel.pp > 1 in dsv3 train")
        if cfg.parallel.ep > 1:
            from .config import ConfigError
            raise ConfigError(f"dsv3.parallel.ep: expert parallelism together with pipeline parallelism "
                              f"(pp = {cfg.parallel.pp}) is not supported by dsv3 train (got ep = {cfg.parallel.ep})")
        return _train_pipelined(model, ds, cfg, total, rank, world, out=out, resume=resume, progress=progress,
                                echo=echo, save=save)
    from .deepspeed.moe_layer import prepare_model  # experts sharded over parallel.ep (DeepSpeed MoE groups)
    from .telemetry import RoutingTelemetry
    prepare_model(model, cfg)
    engine, _, _, _ = initialize(model, ds)
    telemetry = RoutingTelemetry(model)  # loads, MaxVio_batch/global, cross-node copies, dropped tokens
    from .ema import EMA
    ema = EMA.from_config(model, cfg, rank, world)  # memory.ema: CPU shadow, updated after each step
    device = engine.device
    start = 0
    if resume:
        _, client = engine.load_checkpoint(checkpoint_dir(resume))
        start = int(client.get("data_step", engine.dsv3.state.optimizer_steps))
        if ema is not None:
            ema.load_state_dict(torch.load(_ema_path(checkpoint_dir(resume), None, rank), weights_only=True))
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    mbs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()

    metrics_path = ckpt = None
    if rank == 0 and out:
        os.makedirs(out, exist_ok=True)
        metrics_path = os.path.join(out, "metrics.jsonl")
        same_dir = resume and os.path.abspath(checkpoint_dir(resume)) == os.path.abspath(os.path.join(out, "ckpt"))
        # A fresh run (or a resume into a new dir) starts a new file; a resume into the same dir keeps the
        # lines up to the checkpoint's step (drops those of an interrupted run past it).
        _rewrite_metrics(metrics_path, keep_until=start if same_dir else 0)
    if out:
        ckpt = os.path.join(out, "ckpt")

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=start, desc="dsv3 train", unit="step", file=sys.stderr, dynamic_ncols=True)
    history: list[dict] = []
    engine.train()
    for step in range(start, total):
        t0 = time.perf_counter()
        sums_4 = torch.zeros(4, dtype=torch.float64)  # loss, lm, mtp, balance summed over micro-batches
        for micro in range(gas):
            ids, labels = data.batch(step, micro, rank, mbs, device=device)
            o = engine(ids, labels=labels)
            engine.backward(o.loss)
            engine.step()
            sums_4 += torch.tensor([_f(o.loss), _f(o.lm_loss), _f(o.mtp_loss), _f(o.balance_loss)],
                                   dtype=torch.float64)
        if torch.distributed.is_initialized():
            sums_4 = sums_4.to(device)
            torch.distributed.all_reduce(sums_4)
            sums_4 = sums_4.cpu()
        means = (sums_4 / (gas * world)).tolist()
        if ema is not None:
            ema.update()  # after the optimizer step; the copy to CPU overlaps the next step
        dt = time.perf_counter() - t0
        st = engine.dsv3.state
        mv = maxvio_of(st.last_stats)
        rec = {"step": step + 1, "loss": means[0], "lm_loss": means[1], "mtp_loss": means[2],
               "balance_loss": means[3], "maxvio": sum(mv) / len(mv) if mv else 0.0,
               "tokens_per_s": st.last_step_tokens / dt, "tokens_seen": st.tokens_seen,
               "gamma": st.last_gamma, "lr": float(engine.get_lr()[0]), "maxvio_layers": mv,
               **telemetry.record(st.last_stats)}  # collective: every rank records
        history.append(rec)
        done = step + 1
        if rank == 0:
            _log_step(rec, done, total, cfg.train.log_every, echo, metrics_path, bar)
        if save and ckpt and ((cfg.train.save_every and done % cfg.train.save_every == 0) or done == total):
            engine.save_checkpoint(ckpt, tag=f"step{done}", client_state={"data_step": done})
            if ema is not None:  # each rank its own shard (DeepSpeed's client_state is written by rank 0 only)
                _atomic_save(ema.state_dict(), _ema_path(ckpt, f"step{done}", rank))
    if bar is not None:
        bar.close()
    if ema is not None:
        ema.close()
    engine.dsv3.remove()
    return _finish(model, history, rank, world, out, metrics_path, ckpt if save else None, echo)


def _train_pipelined(model, ds: dict, cfg, total: int, rank: int, world: int, *, out, resume, progress, echo,
                     save) -> dict:
    """`"parallel": {"pp": P > 1, "schedule": ...}`: pipelines of P consecutive ranks, ZeRO-1 over the
    data-parallel group (`dsv3_plugin.deepspeed.pipeline.PipelinedEngine`); one pipeline step over the JSON's
    gradient_accumulation_steps micro-batches per optimizer step; the data of a step belongs to the
    data-parallel rank, so every rank of a pipeline reads the same micro-batches."""
    from .config import ConfigError
    from .data import MarkovData
    from .deepspeed.pipeline import PipelinedEngine
    if resume:
        raise ConfigError("dsv3.parallel.pp: --resume with pipeline parallelism is not supported yet")
    pe = PipelinedEngine(model, ds, cfg)
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    mbs, gas, g = pe.micro_batch, pe.gas, pe.g
    metrics_path = ckpt = None
    if rank == 0 and out:
        os.makedirs(out, exist_ok=True)
        metrics_path = os.path.join(out, "metrics.jsonl")
        _rewrite_metrics(metrics_path, keep_until=0)
    if out:
        ckpt = os.path.join(out, "ckpt")
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=f"dsv3 train (pp={g.pp}, {cfg.parallel.schedule})", unit="step",
                   file=sys.stderr, dynamic_ncols=True)
    history: list[dict] = []
    tokens_seen = 0
    for step in range(total):
        t0 = time.perf_counter()
        parts = [data.batch(step, micro, g.dp_rank, mbs) for micro in range(gas)]
        ids = torch.cat([p[0] for p in parts])
        labels = torch.cat([p[1] for p in parts])
        m = pe.train_step(ids, labels, tokens_seen=float(tokens_seen))
        gamma = cfg.moe.gamma(float(tokens_seen))
        stats = pe.update_expert_bias(gamma)
        step_tokens = ids.numel() * g.dp            # every rank of a pipeline trains on the same tokens
        tokens_seen += step_tokens
        per_rank = [None] * g.pp                    # (MoE layer index, MaxVio) of every local MoE layer
        torch.distributed.all_gather_object(per_rank, [(s["moe_index"], float(s["maxvio"])) for s in stats],
                                            group=g.pp_group)
        mv = [v for _, v in sorted(x for xs in per_rank for x in xs)]   # model order
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, **m, "maxvio": sum(mv) / len(mv) if mv else 0.0,
               "tokens_per_s": step_tokens / dt, "tokens_seen": tokens_seen, "gamma": gamma,
               "lr": float(pe.engine.get_lr()[0]), "maxvio_layers": mv}
        history.append(rec)
        done = step + 1
        if rank == 0:
            _log_step(rec, done, total, cfg.train.log_every, echo, metrics_path, bar)
        if save and ckpt and ((cfg.train.save_every and done % cfg.train.save_every == 0) or done == total):
            pe.engine.save_checkpoint(ckpt, tag=f"step{done}", client_state={"data_step": done,
                                                                           "tokens_seen": tokens_seen})
    if bar is not None:
        bar.close()
    return _finish(pe.module, history, rank, world, out, metrics_path, ckpt if save else None, echo)


def _log_step(rec: dict, done: int, total: int, log_every: int, echo: bool, metrics_path, bar) -> None:
    """Rank 0: one JSON line every `dsv3.train.log_every` steps (and the last) to stdout and metrics.jsonl."""
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


def _finish(model, history: list[dict], rank: int, world: int, out, metrics_path, ckpt, echo: bool) -> dict:
    """End of a run (both loops): summary line, loss PNG, and final-state fingerprints (plain Python values,
    so they can cross process boundaries)."""
    summary = _summary(history, world, out, ckpt)
    if rank == 0 and out and metrics_path:
        with open(metrics_path) as f:
            rows = [json.loads(x) for x in f if x.strip()]
        if rows:
            _write_png(rows, os.path.join(out, "train.png"))
    if rank == 0 and echo:
        print(summary["line"], flush=True)
    with torch.no_grad():
        biases = {n: b.tolist() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return {"history": history, "summary": summary, "router_bias": biases, "param_checksum": checksum}


def _summary(history: list[dict], world: int, out: str | None, ckpt: str | None) -> dict:
    if not history:
        return {"steps": 0, "line": "dsv3 train: nothing to do (already at the requested step)"}
    first, last = history[0], history[-1]
    tail = history[-min(10, len(history)):]
    tps = sum(r["tokens_per_s"] for r in tail) / len(tail)
    line = (f"dsv3 train: steps {first['step']}-{last['step']} on {world} rank(s): loss {first['loss']:.3f} -> "
            f"{last['loss']:.3f}, maxvio {first['maxvio']:.3f} -> {last['maxvio']:.3f}, "
            f"{tps:,.0f} tokens/s" + (f", checkpoint {ckpt}" if ckpt else "") +
            (f", metrics {os.path.join(out, 'metrics.jsonl')}" if out else ""))
    ok = all(math.isfinite(r["loss"]) for r in history)
    return {"steps": len(history), "first_loss": first["loss"], "last_loss": last["loss"],
            "first_maxvio": first["maxvio"], "last_maxvio": last["maxvio"], "tokens_per_s": tps,
            "finite": ok, "line": line}
