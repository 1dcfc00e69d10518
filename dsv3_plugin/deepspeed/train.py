"""`dsv3 train` on DeepSpeed: validation before any rank starts, the model in DeepSpeed's dtype, ZeRO-1 engines,
and the two `training.loop.TrainEngine`s the framework-neutral loop drives.

- `ZeroStepEngine` (pp = 1): per micro-batch engine(ids, labels) -> loss = LM + λ/D·ΣMTP + α·balance ->
  engine.backward -> engine.step (the last one steps the optimizer and runs the once-per-step bias update, see
  `dsv3_plugin.deepspeed.engine`); experts over DeepSpeed's MoE groups at ep > 1; routing telemetry.
- `PipelinedStepEngine` (pp > 1): one pipeline step of `PipelinedEngine` over the JSON's gas micro-batches, then
  the bias update over the ranks that saw the tokens.

`train(...)` runs in-process on each rank (self-spawned, torchrun, or the deepspeed launcher all call it the
same way after `init_distributed()`); `--steps` is the step to reach, not a count to add.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings

import torch

from dsv3_plugin.checkpoint.init_from import build_train_model, init_from_config
from dsv3_plugin.config import ConfigError, read_ds_json
from dsv3_plugin.data.packed import open_data
from dsv3_plugin.data.synthetic import MarkovData
from dsv3_plugin.data.tokenizer import has_tokenizer
from dsv3_plugin.deepspeed.config_keys import resolve_batch
from dsv3_plugin.deepspeed.engine import initialize, mixed_precision_dtype, quiet_deepspeed_logs
from dsv3_plugin.deepspeed.moe_layer import prepare_model  # experts sharded over parallel.ep (DeepSpeed MoE groups)
from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
from dsv3_plugin.deepspeed.validate import validate_ds_config
from dsv3_plugin.model.packing import lm_ce_sum
from dsv3_plugin.parallel.distributed import init_distributed, peer_failures, set_peer_timeout
from dsv3_plugin.training import loop
from dsv3_plugin.training.memory_estimate import host_memory_bytes
from dsv3_plugin.training.pipelined import as_batch, concat_batches
from dsv3_plugin.training.run_dir import RunDir
from dsv3_plugin.training.run_report import maxvio_of, rss_bytes
from dsv3_plugin.training.run_rules import data_line, with_data_flags
from dsv3_plugin.training.telemetry import RoutingTelemetry

__all__ = ["DEFAULT_DS_CONFIG", "train", "resolve_ds_config", "ZeroStepEngine", "PipelinedStepEngine"]

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


def _grad_norm(engine) -> float | None:
    """The global gradient norm of the last optimizer step (what gradient_clipping compared; every parameter
    counted once over all ranks), None when DeepSpeed did not compute one."""
    n = engine.get_global_grad_norm()
    return None if n is None else float(n)


def _f(x) -> float:
    """A loss term as a Python float (absent terms, e.g. MTP depth 0 or α = 0, are 0)."""
    return 0.0 if x is None else float(x.detach())


def _prepare(ds_config, steps, init_from, world_size: int | None = None):
    """Validate everything a rank would, before any process starts (bad input -> ConfigError, exit 2): the one
    validation (`dsv3_plugin.deepspeed.validate.validate_ds_config`, as `dsv3 check-config --nproc N` runs it) for
    `world_size` ranks (default: the initialised process group's) and this host's memory. Returns (the normalised
    DeepSpeed JSON, the `DSv3Config`, the step to reach); the data is not opened (see `_prepare_run`)."""
    ds, cfg, total, _ = _prepare_run(ds_config, steps, init_from, world_size, open_files=False)
    return ds, cfg, total


def _prepare_run(
    ds_config,
    steps,
    init_from,
    world_size: int | None = None,
    data_flags: dict | None = None,
    open_files=True,
    exit_after_minutes: float | None = None,
):
    """`_prepare` and the data: with `dsv3.train.data` an object (or --data flags, `data_flags` = the keyword
    arguments of `training.run_rules.with_data_flags`) and `open_files`, the prepared data opened and checked for
    this world's batch layout (`dsv3_plugin.data.packed.open_data`: tokenizer vocabulary, files, token ids, rows
    per rank). `exit_after_minutes` (--exit-after-minutes) sets `dsv3.train.exit_after_minutes`, validated with
    the rest. Returns (ds, cfg, total, PackedData or None for synthetic data)."""
    ds = resolve_ds_config(ds_config)
    if data_flags:
        ds = with_data_flags(ds, **data_flags)
    if exit_after_minutes is not None and isinstance(ds["dsv3"].setdefault("train", {}), dict):
        ds["dsv3"]["train"]["exit_after_minutes"] = exit_after_minutes
    if init_from:
        ds = init_from_config(ds, init_from)
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
    data = None
    if open_files and cfg.train.data != "synthetic":
        dp = max(1, (world_size or 1) // cfg.parallel.pp)
        full = checked.full()
        gas = resolve_batch(full, dp)  # (already resolved for this world by the validation: the same values)
        data = open_data(cfg, init_from, micro_batch=full["train_micro_batch_size_per_gpu"], gas=gas, dp=dp)
    return checked.full(), cfg, total, data


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
    data: list[str] | None = None,
    valid_data: list[str] | None = None,
    tokenizer: str | None = None,
    exit_after_minutes: float | None = None,
) -> dict:
    """Train on this rank (call after, or let it call, `init_distributed()`).

    Args:
        ds_config: the DeepSpeed JSON (path or dict) with a "dsv3" block; None: `DEFAULT_DS_CONFIG`.
        steps: the step index to reach (default `dsv3.train.steps`); with `resume` training continues from the
            checkpoint's step.
        out: the run directory OUT: OUT/metrics.jsonl (one JSON line per logged step, rank 0), OUT/ckpt (the
            DeepSpeed checkpoints), OUT/train.png and OUT/routing.png at the end. Locked for the call; a fresh run
            into an OUT holding a previous run is refused unless `overwrite` (which deletes that run's files).
        resume: a run directory (or its ckpt/) to continue; init_from: a released-format checkpoint directory
            (model shape from its config.json, training knobs from the "dsv3" block).
        progress: tqdm bar on stderr (rank 0); echo: the JSON lines and a JSON summary also on stdout; summary: a
            short human summary (stdout, or stderr with `echo`); save: write checkpoints.
        allow_non_finite: load a checkpoint holding NaN/Inf (refused otherwise).
        data, valid_data, tokenizer: `dsv3 train --data / --valid-data / --tokenizer` (see `with_data_flags`).
        exit_after_minutes: sets `dsv3.train.exit_after_minutes` (save and stop before this wall-clock budget).

    Returns:
        {"history": per-step metric dicts, "summary", "router_bias": {buffer name: list}, "param_checksum":
        float64 sum of all parameters} — identical on every rank — and "notes" (what rank 0 said on stderr about
        the run directory: a resume that fell back to an older tag, a dropped torn metrics line).

    Raises:
        ConfigError / CheckpointError / DataError: bad input, named by key or file, before any step.
        Preempted: SIGTERM / SIGINT / SIGUSR1 on any rank, or the wall-clock budget: every rank stopped at the
            same step boundary after saving it (`dsv3_plugin.training.preemption`); `exit_code` is the status.
    """
    rank, world = init_distributed()
    flags = {"data": data, "valid": valid_data, "tokenizer": tokenizer}
    ds, cfg, total, data = _prepare_run(
        ds_config, steps, init_from, world, flags, exit_after_minutes=exit_after_minutes
    )
    first_line, note = data_line(data, init_from)
    if rank == 0 and (progress or echo or summary):  # what the run trains on comes first, before any bar or line
        print(first_line, file=sys.stderr, flush=True)
    # Every wait on a peer is bounded by parallel.p2p_timeout_s: the world group (and any group already made) from
    # here, the groups made later by expert parallelism, the pipeline and deepspeed.initialize when they are made.
    set_peer_timeout(cfg.parallel.p2p_timeout_s)
    with peer_failures("dsv3 train (start-up, resume or end of the run)", cfg.parallel.p2p_timeout_s):
        fingerprint = loop.data_fingerprint(data)
        tok_dir = (
            data.tokenizer_dir if data is not None else (init_from if init_from and has_tokenizer(init_from) else None)
        )
        run = RunDir(out, resume, cfg, rank, world, overwrite, save, data=fingerprint, tokenizer=tok_dir)
        try:
            _setup_process(cfg)
            rss0 = rss_bytes()  # the runtime's share of peak_rss_bytes (Python, torch, DeepSpeed, process groups)
            dtype = mixed_precision_dtype(ds) or torch.float32
            model = build_train_model(cfg, init_from, allow_non_finite, rank, world, dtype)
            engine = PipelinedStepEngine(model, ds, cfg) if cfg.parallel.pp > 1 else ZeroStepEngine(model, ds, cfg)
            if data is None:
                data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
            elif (data.micro_batch, data.gas, data.dp) != (engine.micro_batch, engine.gas, engine.dp):
                raise ConfigError(  # the shards were cut for the validated layout; the engine must agree
                    f"train_micro_batch_size_per_gpu / gradient_accumulation_steps: the engine runs "
                    f"{(engine.micro_batch, engine.gas, engine.dp)} (micro-batch, accumulation, data-parallel), "
                    f"the data was cut for {(data.micro_batch, data.gas, data.dp)}"
                )
            return loop.run(
                engine,
                data,
                run,
                cfg,
                total,
                world=world,
                progress=progress,
                echo=echo,
                summary=summary,
                checkpoint_bytes_read=getattr(model, "checkpoint_bytes_read", 0),
                rss_before_model=rss0,
                data_note=note,
            )
        finally:
            run.close()


class ZeroStepEngine:
    """`training.loop.TrainEngine` over `dsv3_plugin.deepspeed.initialize`'s ZeRO-1 engine (pp = 1): experts
    sharded over parallel.ep (DeepSpeed MoE groups), the BF16-moment AdamW under memory.bf16_moments, routing
    telemetry."""

    def __init__(self, model, ds: dict, cfg):
        prepare_model(model, cfg)
        self.engine, _, _, _ = initialize(model, ds)
        self.module = model
        self.telemetry = RoutingTelemetry(model)
        self.dp_rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.dp = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        self.micro_batch = self.engine.train_micro_batch_size_per_gpu()
        self.gas = self.engine.gradient_accumulation_steps()
        self.batch_device = self.engine.device
        self.description = "dsv3 train"
        self.engine.train()

    def train_step(self, micro_batches) -> loop.StepResult:
        """One optimizer step over this rank's `data.batch.Batch` micro-batches (or (input_ids, labels) tuples):
        every field goes to the model (packed rows' positions, padding masks); collective."""
        engine = self.engine
        sums_4 = torch.zeros(4, dtype=torch.float64)  # loss, lm, mtp, balance summed over micro-batches
        for mb in micro_batches:
            b = as_batch(mb)
            if b.position_ids is None and b.token_mask is None:
                o = engine(b.input_ids, labels=b.labels)
            else:
                o = engine(b.input_ids, labels=b.labels, position_ids=b.position_ids, token_mask=b.token_mask)
            engine.backward(o.loss)
            engine.step()  # the last micro-batch's call steps the optimizer and the router biases
            terms = [_f(o.loss), _f(o.lm_loss), _f(o.mtp_loss), _f(o.balance_loss)]
            sums_4 += torch.tensor(terms, dtype=torch.float64)
        if torch.distributed.is_initialized():
            sums_4 = sums_4.to(engine.device)
            torch.distributed.all_reduce(sums_4)
            sums_4 = sums_4.cpu()
        means = (sums_4 / (len(micro_batches) * self.dp)).tolist()
        st = engine.dsv3.state
        return loop.StepResult(
            zip(("loss", "lm_loss", "mtp_loss", "balance_loss"), means),
            step_tokens=st.last_step_tokens,
            tokens_seen=st.tokens_seen,
            gamma=st.last_gamma,
            maxvio_layers=maxvio_of(st.last_stats),
            bias_stats=st.last_stats,
        )

    def eval_loss(self, micro_batches) -> tuple[float, int]:
        """(LM cross-entropy summed over the loss tokens, their count) of `micro_batches`, summed over all ranks
        (collective: every rank passes the same number of micro-batches; the same result on every rank). Under
        `torch.no_grad()` in eval mode: no expert loads counted, no bias update, no telemetry, the optimizer
        untouched; the model's train/eval mode is restored."""
        model = self.module
        sums_2 = torch.zeros(2, dtype=torch.float64)
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                for mb in micro_batches:
                    b = as_batch(mb)
                    o = model(b.input_ids, position_ids=b.position_ids, token_mask=b.token_mask)
                    sums_2[0] += float(lm_ce_sum(o.logits, b.labels))
                    sums_2[1] += b.loss_tokens
        finally:
            model.train(was)
        if torch.distributed.is_initialized():
            sums_2 = sums_2.to(self.engine.device)
            torch.distributed.all_reduce(sums_2)
            sums_2 = sums_2.cpu()
        return float(sums_2[0]), int(sums_2[1])

    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        return _grad_norm(self.engine)

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        # `latest` is the run directory's to write, after the completion marker (`RunDir.save`)
        self.engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state, save_latest=False)

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict:
        _, client = self.engine.load_checkpoint(ckpt_dir, tag=tag)
        return {**client, "data_step": int(client.get("data_step", self.engine.dsv3.state.optimizer_steps))}

    def finish(self) -> None:
        self.engine.dsv3.remove()


class PipelinedStepEngine:
    """`training.loop.TrainEngine` over `PipelinedEngine` (`"parallel": {"pp": P > 1, "schedule": ...}`): pipelines
    of P consecutive ranks, ZeRO-1 over the data-parallel group, experts over EP groups carved from it; one pipeline
    step over the JSON's gradient_accumulation_steps micro-batches per optimizer step. The data of a step belongs
    to the data-parallel rank, so every rank of a pipeline reads the same micro-batches."""

    telemetry = None  # routing telemetry needs every MoE layer on the rank; a pipeline rank holds its stages'

    def __init__(self, model, ds: dict, cfg):
        self.pe = PipelinedEngine(model, ds, cfg)
        self.cfg = cfg
        self.module = self.pe.module
        self.dp_rank, self.dp = self.pe.g.dp_rank, self.pe.g.dp
        self.micro_batch, self.gas = self.pe.micro_batch, self.pe.gas
        self.batch_device = None
        self.description = f"dsv3 train (pp={self.pe.g.pp}, {cfg.parallel.schedule})"
        self.tokens_seen = 0

    def train_step(self, micro_batches) -> loop.StepResult:
        """One pipeline step over the gas `data.batch.Batch` micro-batches (or (input_ids, labels) tuples), their
        positions and padding masks travelling with the activations; collective."""
        pe = self.pe
        b = concat_batches([as_batch(mb) for mb in micro_batches])
        ids = b.input_ids
        m = pe.train_step(ids, b.labels, float(self.tokens_seen), b.position_ids, b.token_mask)
        gamma = self.cfg.moe.gamma(float(self.tokens_seen))
        stats = pe.update_expert_bias(gamma)
        step_tokens = ids.numel() * pe.g.dp  # every rank of a pipeline trains on the same tokens
        # (MoE layer index, MaxVio) of every local MoE layer of every pipeline rank
        per_rank = pe.gather_pipeline([(s["moe_index"], float(s["maxvio"])) for s in stats])
        mv = [v for _, v in sorted(dict(x for xs in per_rank for x in xs).items())]  # model order, mirrors once
        self.tokens_seen += step_tokens
        return loop.StepResult(
            m, step_tokens=step_tokens, tokens_seen=self.tokens_seen, gamma=gamma, maxvio_layers=mv, bias_stats=None
        )

    def eval_loss(self, micro_batches) -> tuple[float, int]:
        """(LM cross-entropy summed over the loss tokens, their count) over the data-parallel ranks: forward-only
        pipeline steps (`PipelinedStages.eval_loss`: no gradients, loads, bias or optimizer update); collective."""
        return self.pe.eval_loss(micro_batches)

    def lr(self) -> float:
        return float(self.pe.engine.get_lr()[0])

    def grad_norm(self) -> float | None:
        return _grad_norm(self.pe.engine)

    def save_checkpoint(self, ckpt_dir: str, tag: str, client_state: dict) -> None:
        cs = {**client_state, "tokens_seen": self.tokens_seen}
        self.pe.save_checkpoint(ckpt_dir, tag=tag, client_state=cs, save_latest=False)  # `latest`: RunDir.save

    def load_checkpoint(self, ckpt_dir: str, tag: str) -> dict:
        client = self.pe.load_checkpoint(ckpt_dir, tag=tag)
        self.tokens_seen = int(client["tokens_seen"])
        return client

    def finish(self) -> dict:
        return self.pe.idle_report()


def _setup_process(cfg) -> None:
    """Threads, the weights' seed, and quiet DeepSpeed: stdout carries only the JSON lines and the summary."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(cfg.train.seed)
    quiet_deepspeed_logs()
    _drop_startup_warning()
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)


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
