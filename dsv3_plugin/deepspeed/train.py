"""`dsv3 train` on DeepSpeed: validation before any rank starts, the model in DeepSpeed's dtype, ZeRO-1 engines,
and the two `training.loop.TrainEngine`s the framework-neutral loop drives.

- `ZeroStepEngine` (pp = 1): per micro-batch engine(ids, labels) -> loss = LM + λ/D·ΣMTP + α·balance ->
  engine.backward -> engine.step (the last one steps the optimizer and runs the once-per-step bias update, see
  `dsv3_plugin.deepspeed.engine`); experts over DeepSpeed's MoE groups at ep > 1; routing telemetry.
- `PipelinedStepEngine` (pp > 1): one pipeline step of `PipelinedEngine` over the JSON's gas micro-batches, then
  the bias update over the ranks that saw the tokens.

`train(TrainRequest)` runs in-process on each rank (self-spawned, torchrun, or the deepspeed launcher all call it
the same way after `init_distributed()`); its `RunConfig` is validated once where the process started.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

import torch

from dsv3_plugin.checkpoint.init_from import build_train_model
from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.packed import open_data
from dsv3_plugin.data.synthetic import MarkovData
from dsv3_plugin.data.tokenizer import has_tokenizer
from dsv3_plugin.deepspeed.engine import initialize, mixed_precision_dtype, quiet_deepspeed_logs
from dsv3_plugin.deepspeed.moe_layer import prepare_model  # experts sharded over parallel.ep (DeepSpeed MoE groups)
from dsv3_plugin.deepspeed.monitor import monitor_sink
from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
from dsv3_plugin.deepspeed.run_config import RunConfig, RunOverrides
from dsv3_plugin.model.packing import lm_ce_sum
from dsv3_plugin.parallel.distributed import init_distributed, peer_failures, set_peer_timeout
from dsv3_plugin.training import loop
from dsv3_plugin.training.lora import bias_update_speed
from dsv3_plugin.training.memory_estimate import host_memory_bytes
from dsv3_plugin.training.pipelined import as_batch, concat_batches
from dsv3_plugin.training.run_dir import RunDir
from dsv3_plugin.training.run_report import maxvio_of, rss_bytes
from dsv3_plugin.training.run_rules import data_line
from dsv3_plugin.training.telemetry import RoutingTelemetry

__all__ = ["TrainRequest", "train", "prepare_run", "ZeroStepEngine", "PipelinedStepEngine"]


@dataclass(kw_only=True)
class TrainRequest(RunOverrides):
    """`dsv3 train`'s options, built once by the command line (`cli/train.py`) and handed to `train`.

    The `RunOverrides` fields (data, valid_data, tokenizer, init_from, exit_after_minutes) go into the config;
    `config` is a `RunConfig` (validated where the process started: the launcher hands its own to the ranks it
    spawns) or what `RunConfig.load` reads (a path, a dict, None for the built-in JSON), read once on this rank.
    """

    config: RunConfig | str | os.PathLike | dict | None = None
    steps: int | None = None  # the step index to reach (default dsv3.train.steps), not a count to add
    out: str | None = None  # the run directory (metrics.jsonl, ckpt/, train.png, routing.png); locked for the run
    resume: str | None = None  # a run directory (or its ckpt/) to continue
    progress: bool = True  # tqdm bar on stderr (rank 0)
    echo: bool = False  # the JSON lines and a JSON summary also on stdout
    summary: bool = False  # a short human summary (stdout, or stderr with echo)
    save: bool = True  # write checkpoints
    overwrite: bool = False  # start over in an `out` that holds a previous run (deletes its files)
    allow_non_finite: bool = False  # --init-from: load NaN/Inf weights and scales instead of refusing them


def prepare_run(request: TrainRequest, world_size: int | None, open_files: bool = True):
    """Everything a rank needs before it builds a model, checked for `world_size` ranks: the `RunConfig` (as
    `dsv3 check-config --nproc N` validates it, with this host's memory; taken as it is when `request.config` is
    one already), the step to reach, and, with `dsv3.train.data` an object and `open_files`, the prepared data
    opened and checked for this world's batch layout (`dsv3_plugin.data.packed.open_data`: tokenizer vocabulary,
    files, token ids, rows per rank). Returns (run, total steps, PackedData or None for synthetic data)."""
    run = request.config
    if isinstance(run, RunConfig):
        if world_size is not None and run.world_size != world_size:
            raise ConfigError(f"--nproc: the config was validated for {run.world_size} rank(s), not {world_size}")
    else:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        ranks_on_host = int(local) if local and local.isdigit() and int(local) > 0 else (world_size or 1)
        run = RunConfig.load(
            run,
            overrides=request,
            target="train",
            world_size=world_size,
            ranks_on_host=ranks_on_host,
            host_memory=host_memory_bytes(),
        )
    cfg = run.cfg
    total = request.steps if request.steps is not None else cfg.train.steps
    if total <= 0:
        raise ConfigError(f"dsv3.train.steps: must be > 0 (got {total})")
    data = None
    if open_files and cfg.train.data != "synthetic":
        dp = max(1, (world_size or 1) // cfg.parallel.pp)
        data = open_data(cfg, request.init_from, micro_batch=run.micro_batch, gas=run.gas, dp=dp)
    return run, total, data


def _grad_norm(engine) -> float | None:
    """The global gradient norm of the last optimizer step (what gradient_clipping compared; every parameter
    counted once over all ranks), None when DeepSpeed did not compute one."""
    n = engine.get_global_grad_norm()
    return None if n is None else float(n)


def _f(x) -> float:
    """A loss term as a Python float (absent terms, e.g. MTP depth 0 or α = 0, are 0)."""
    return 0.0 if x is None else float(x.detach())


def train(request: TrainRequest | RunConfig | str | os.PathLike | dict | None = None, **options) -> dict:
    """Train on this rank (call after, or let it call, `init_distributed()`).

    Args:
        request: a `TrainRequest` (what `dsv3 train` builds); or its `config` (a `RunConfig`, a DeepSpeed JSON path
            or dict, None for the built-in JSON) with the other `TrainRequest` fields as keyword `options`, e.g.
            `train("ds.json", steps=10, out="runs/x")`. The config is read and validated once here unless it is
            a `RunConfig` already (then it must have been validated for this world size).

    Returns:
        {"history": per-step metric dicts, "summary", "router_bias": {buffer name: list}, "param_checksum":
        float64 sum of all parameters} — identical on every rank — and "notes" (what rank 0 said on stderr about
        the run directory: a resume that fell back to an older tag, a dropped torn metrics line).

    Raises:
        ConfigError / CheckpointError / DataError: bad input, named by key or file, before any step.
        Preempted: SIGTERM / SIGINT / SIGUSR1 on any rank, or the wall-clock budget: every rank stopped at the
            same step boundary after saving it (`dsv3_plugin.training.preemption`); `exit_code` is the status.
    """
    if not isinstance(request, TrainRequest):
        request = TrainRequest(config=request, **options)
    elif options:
        raise TypeError(f"train: options {sorted(options)} given with a TrainRequest (set them on it)")
    r = request
    rank, world = init_distributed()
    run, total, data = prepare_run(r, world)
    cfg = run.cfg
    first_line, note = data_line(data, r.init_from)
    if rank == 0 and (r.progress or r.echo or r.summary):  # what the run trains on comes first, before any bar or line
        print(first_line, file=sys.stderr, flush=True)
    # Every wait on a peer is bounded by parallel.p2p_timeout_s: the world group (and any group already made) from
    # here, the groups made later by expert parallelism, the pipeline and deepspeed.initialize when they are made.
    set_peer_timeout(cfg.parallel.p2p_timeout_s)
    with peer_failures("dsv3 train (start-up, resume or end of the run)", cfg.parallel.p2p_timeout_s):
        fingerprint = loop.data_fingerprint(data)
        init_from = r.init_from
        tok_dir = (
            data.tokenizer_dir if data is not None else (init_from if init_from and has_tokenizer(init_from) else None)
        )
        rundir = RunDir(r.out, r.resume, cfg, rank, world, r.overwrite, r.save, data=fingerprint, tokenizer=tok_dir)
        sink = None
        try:
            _setup_process(cfg)
            rss0 = rss_bytes()  # the runtime's share of peak_rss_bytes (Python, torch, DeepSpeed, process groups)
            dtype = mixed_precision_dtype(run.ds) or torch.float32
            model = build_train_model(cfg, init_from, r.allow_non_finite, rank, world, dtype)
            engine = PipelinedStepEngine(model, run) if cfg.parallel.pp > 1 else ZeroStepEngine(model, run)
            sink = monitor_sink(engine.deepspeed_engine)  # the JSON's tensorboard / wandb / csv_monitor / comet
            if data is None:
                data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
            elif (data.micro_batch, data.gas, data.dp) != (engine.micro_batch, engine.gas, engine.dp):
                raise ConfigError(  # the shards were cut for the validated layout; the engine must agree
                    f"train_micro_batch_size_per_gpu / gradient_accumulation_steps: the engine runs "
                    f"{(engine.micro_batch, engine.gas, engine.dp)} (micro-batch, accumulation, data-parallel), "
                    f"the data was cut for {(data.micro_batch, data.gas, data.dp)}"
                )
            result = loop.run(
                engine,
                data,
                rundir,
                cfg,
                total,
                world=world,
                progress=r.progress,
                echo=r.echo,
                summary=r.summary,
                checkpoint_bytes_read=getattr(model, "checkpoint_bytes_read", 0),
                rss_before_model=rss0,
                data_note=note,
                metrics_sink=sink,
            )
            if sink is not None and result["history"]:
                sink.summary(result["summary"], result["history"][-1]["step"])
            return result
        finally:
            if sink is not None:
                sink.close()
            rundir.close()


class ZeroStepEngine:
    """`training.loop.TrainEngine` over `dsv3_plugin.deepspeed.initialize`'s ZeRO-1 engine (pp = 1): experts
    sharded over parallel.ep (DeepSpeed MoE groups), the BF16-moment AdamW under memory.bf16_moments, routing
    telemetry."""

    def __init__(self, model, run: RunConfig):
        prepare_model(model, run.cfg)
        self.engine, _, _, _ = initialize(model, run)
        self.deepspeed_engine = self.engine  # its monitor writes the metrics (`deepspeed.monitor`)
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

    def __init__(self, model, run: RunConfig):
        cfg = run.cfg
        self.pe = PipelinedEngine(model, run.ds, cfg)
        self.deepspeed_engine = self.pe.engine  # its monitor writes the metrics (`deepspeed.monitor`)
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
        gamma = bias_update_speed(self.cfg, float(self.tokens_seen))  # 0 under LoRA with the released bias kept
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
