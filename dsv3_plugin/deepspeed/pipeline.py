"""Pipeline x data parallelism with DeepSpeed ZeRO-1: our schedules over the pipeline group (the stages, the
schedule runtime and the bias update live in `training.pipelined`), ZeRO-1 over the data-parallel group.

`PipelinedEngine(model, ds_config, cfg)` hands this rank's stages to `deepspeed.initialize` with an `mpu`
(`PipelineMPU`) naming the data-parallel group (ZeRO-1 partitions the optimizer state and averages gradients
there) and the pipeline group as the "model-parallel" group (the gradient norm for clipping sums over all stages).
One optimizer step = one pipeline step over the JSON's gradient_accumulation_steps micro-batches; DeepSpeed itself
runs with gas = 1 and micro-batch = gas x micro-batch. Design notes: docs/deepspeed.md ("Pipelined engine").
"""

from __future__ import annotations

import copy

import torch.distributed as dist

from dsv3_plugin.config import ConfigError
from dsv3_plugin.deepspeed.backend import import_deepspeed
from dsv3_plugin.deepspeed.engine import (
    check_fp32_router_state,
    chunked_step,
    client_optimizer,
    flat_grads,
    prepare_mixed_precision,
)
from dsv3_plugin.deepspeed.moe_layer import prepare_model, stacking_order
from dsv3_plugin.deepspeed.save_errors import deferred_write_errors
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.moe.balancing import reset_counts
from dsv3_plugin.parallel.distributed import new_groups_bounded
from dsv3_plugin.parallel.groups import PipelineGroups
from dsv3_plugin.training.lora import check_lora_checkpoint, lora_checkpoint_state
from dsv3_plugin.training.pipelined import PipelinedStages
from dsv3_plugin.training.rng_state import gather_rng_states, restore_rng_state

__all__ = ["PipelineMPU", "PipelinedEngine"]


class PipelineMPU:
    """The model-parallel-unit interface DeepSpeed reads: data parallel = dp group; model parallel = the
    pipeline group (DeepSpeed sums gradient norms over it)."""

    def __init__(self, g: PipelineGroups):
        self.g = g

    def get_data_parallel_group(self):
        return self.g.dp_group

    def get_data_parallel_rank(self):
        return self.g.dp_rank

    def get_data_parallel_world_size(self):
        return self.g.dp

    def get_data_parallel_group_ranks(self):
        return list(self.g.dp_ranks)

    def get_model_parallel_group(self):
        return self.g.pp_group

    def get_model_parallel_rank(self):
        return self.g.pp_rank

    def get_model_parallel_world_size(self):
        return self.g.pp

    def get_pipeline_model_parallel_world_size(self):
        return self.g.pp

    def get_pipeline_model_parallel_rank(self):
        return self.g.pp_rank

    def get_pipeline_model_parallel_group(self):
        return self.g.pp_group

    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_rank(self):
        return 0


def _mark_replicated(stages, traits, g: PipelineGroups) -> None:
    """Parameters this rank holds that another rank of its pipeline holds too get `ds_pipe_replicated`
    (DeepSpeed's flag: left out of the gradient norm on this rank), so the norm counts each once: DualPipe's
    mirror ranks P/2..P-1 (stages r and P-1-r are both on rank r < P/2), and with 1F1B/ZB1P the last rank's
    copy of the embedding MTP reuses (its gradient equals the first rank's after `sync_tied_embedding`)."""
    if g.pp == 1:
        return
    if traits.mirror_sync and g.pp_rank >= g.pp // 2:
        for st in stages:
            for p in st.parameters():
                p.ds_pipe_replicated = True
    elif traits.first_and_last_apart(g.pp) and g.pp_rank == g.pp - 1:
        for st in stages:
            if st.last and not st.first and hasattr(st, "embed_tokens"):
                st.embed_tokens.weight.ds_pipe_replicated = True


class PipelinedEngine(PipelinedStages):
    """`dsv3 train` with "parallel": {"pp": P, "schedule": ...}: build with the model and the DeepSpeed JSON (its
    "dsv3" block gives the schedule), then call `train_step(ids, labels, tokens_seen)` with this data-parallel
    rank's gas x micro-batch sequences (the same on every rank of a pipeline), and `eval_loss(batches)`
    (forward-only, `training.pipelined.PipelinedStages.eval_loss`).

    Every wait on a peer is bounded by `timeout_s` (default: the config's `parallel.p2p_timeout_s`): the
    pipeline's sends/receives, and the collectives over the pipeline and data-parallel groups, which are
    created with that timeout, and any group DeepSpeed creates in `deepspeed.initialize`. A dead or stuck peer
    raises `PipelinePeerError` (a `PeerError`) naming the operation, the ranks and the timeout, instead of
    hanging."""

    def __init__(
        self, model, ds_config: dict, cfg, groups: PipelineGroups | None = None, timeout_s: float | None = None
    ):
        try:  # the adapter's import applies its CPU patch (no JIT build of an inference-only comm op)
            deepspeed = import_deepspeed()
        except ImportError:
            import deepspeed
        ds = copy.deepcopy(ds_config)
        super().__init__(model, cfg, int(ds.get("gradient_accumulation_steps", 1)), groups, timeout_s)
        mbs = int(ds.get("train_micro_batch_size_per_gpu", 1))
        self.micro_batch = mbs
        ds["gradient_accumulation_steps"] = 1
        ds["train_micro_batch_size_per_gpu"] = mbs * self.gas
        ds.pop("train_batch_size", None)
        ds.pop("dsv3", None)
        if (cfg.lora is None) != (getattr(model, "lora_report", None) is None):  # (as `engine.initialize` refuses)
            raise ConfigError(
                "dsv3.lora: the config and the model disagree on LoRA adapters (build the model with the same block: "
                "checkpoint.frozen_base.load_frozen_base)"
            )
        if cfg.lora is not None:  # what a LoRA checkpoint records (`lora_checkpoint_state`), on this rank's stages
            self.module.lora_report = getattr(model, "lora_report", None)
            self.module.base_fingerprint = getattr(model, "base_fingerprint", None)
        if cfg.parallel.ep > 1:  # this rank's stages' experts over the stage's EP group (collective: every rank)
            prepare_model(self.module, cfg, dp_group=self.g.dp_group)
        _mark_replicated(self.stages, self.traits, self.g)
        self._split_weight_grads()
        params = stacking_order(self.module, [p for p in self.module.parameters() if p.requires_grad])
        opt, ds = client_optimizer(params, ds, cfg)  # memory.bf16_moments: the BF16-moment AdamW
        prepare_mixed_precision(self.module, ds)  # bf16: BF16 router weights, FP32 bias (engine.py)
        with (
            self._peers("deepspeed.initialize (parameter broadcast)", self.g.dp_ranks),
            new_groups_bounded(self.timeout_s),
        ):
            self.engine, self.optimizer, _, self.lr_scheduler = deepspeed.initialize(
                model=self.module, model_parameters=params, optimizer=opt, config=ds, mpu=PipelineMPU(self.g)
            )
        check_fp32_router_state(self.module)
        self.engine.dsv3_flat_grads = flat_grads(self.engine, cfg, pipeline=True)  # not here: said on stderr
        self._one_norm_all_reduce()
        self.engine.dsv3_chunked_step = chunked_step(self.engine, cfg)  # after the norm patches (it keeps theirs)
        # Gradients are produced outside engine.backward (by the schedule): reduce them like DeepSpeed's own
        # pipeline engine does.
        self.engine.pipeline_parallelism = True
        self._start_runtime()

    def _one_norm_all_reduce(self) -> None:
        """DeepSpeed's ZeRO optimizer all-reduces one gradient norm per parameter group over the pipeline group, and
        the stages can hold different numbers of groups (a stage without MoE layers has no expert group; DeepSpeed
        splits a stage's experts into groups of <= 179 M elements): sum each stage's norm over the pipeline once
        instead (`patches/deepspeed_zero_pipeline_norm.py`). Where the patch does not apply (another DeepSpeed),
        stages with different group counts are refused here, before the first step would pair the all-reduces
        wrongly."""
        from dsv3_plugin_patches import deepspeed_zero_pipeline_norm

        if self.g.pp == 1 or deepspeed_zero_pipeline_norm.apply(self.engine.optimizer):
            return
        counts = [None] * self.g.pp
        with self._peers("all_gather_object of the optimizer's parameter-group counts", self.g.pp_ranks):
            dist.all_gather_object(counts, len(self.engine.optimizer.param_groups), group=self.g.pp_group)
        if len(set(counts)) > 1:
            raise ConfigError(
                f"dsv3.parallel.pp: the pipeline ranks hold {counts} optimizer parameter groups "
                "(expert groups differ per stage), and this DeepSpeed's ZeRO optimizer all-reduces "
                "one gradient norm per group over the pipeline; use deepspeed 0.19.x"
            )

    def train_step(self, ids_NT, labels_NT, tokens_seen: float = 0.0, position_ids_NT=None, token_mask_NT=None) -> dict:
        """One optimizer step over gas micro-batches (N = gas x micro-batch rows; `position_ids_NT` /
        `token_mask_NT`: packed rows' positions and padding, see `DSv3Model.forward`). Returns the loss terms
        averaged over micro-batches and data-parallel ranks (identical on every rank)."""
        self.engine.train()
        crit = self.run_schedule(ids_NT, labels_NT, tokens_seen, position_ids_NT, token_mask_NT)
        with self._peers("gradient all-reduce (ZeRO-1)", self.g.dp_ranks):
            self.engine.allreduce_gradients()
        with self._peers(
            "optimizer step (gradient norm over the pipeline, ZeRO-1 all-gather)",
            sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks)),
        ):
            self.engine.step()
        self.optimizer_steps += 1
        return self.mean_losses(crit)

    # --- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict | None = None, save_latest: bool = True
    ) -> None:
        """DeepSpeed's checkpoint (one model file per pipeline rank with its stages' weights and router biases,
        ZeRO-1 optimizer partitions, expert files, LR schedule) plus `client_state["dsv3"]`: every rank's RNG
        state (all-gathered: DeepSpeed writes client_state from each stage's data-parallel rank 0 only), the
        optimizer-step count and the config. Call between steps (router counts are zero there). `save_latest`:
        DeepSpeed writes `latest` (`dsv3 train` passes False: its run directory writes it after the completion
        marker). A failed file write on this rank (a full disk) is raised after DeepSpeed's collectives ran on
        every rank (`save_errors.deferred_write_errors`)."""
        cs = dict(client_state or {})
        cs["dsv3"] = {**gather_rng_states(), "optimizer_steps": self.optimizer_steps, "config": self.cfg.to_dict()}
        kw = {}
        if self.cfg.lora is not None:  # adapters + their optimizer state; the base only by its fingerprint
            cs["dsv3"]["lora"] = lora_checkpoint_state(self.module)
            kw["exclude_frozen_parameters"] = True
        with (
            self._peers("save_checkpoint", sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks))),
            deferred_write_errors(self.engine),
        ):
            self.engine.save_checkpoint(save_dir, tag=tag, client_state=cs, save_latest=save_latest, **kw)

    def load_checkpoint(self, load_dir: str, tag: str) -> dict:
        """Load what `save_checkpoint` wrote (same pp, dp, ep); restores this rank's RNG state. Returns the
        caller's client_state keys (CheckpointError when it is not a dsv3 pipelined checkpoint or the layout
        differs)."""
        with self._peers("load_checkpoint", sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks))):
            # the frozen base is not in a LoRA checkpoint: its parameters stay as loaded from the release
            path, client = self.engine.load_checkpoint(load_dir, tag=tag, load_module_strict=self.cfg.lora is None)
        if path is None:
            raise CheckpointError(f"{load_dir}: DeepSpeed could not load checkpoint tag {tag!r}")
        client = dict(client or {})
        st = client.pop("dsv3", None)
        if st is None:
            raise CheckpointError(f"{path}: client_state has no 'dsv3' entry (not saved by dsv3 train)")
        if self.cfg.lora is not None:
            check_lora_checkpoint(self.module, st.get("lora"), str(path))
        restore_rng_state(st, str(path))
        self.optimizer_steps = int(st.get("optimizer_steps", 0))
        reset_counts(self.module)  # counts of an interrupted step must not leak into the next update
        return client
