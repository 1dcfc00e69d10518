"""Pipeline x data parallelism with DeepSpeed ZeRO-1: our schedules over the pipeline group, ZeRO-1 over
the data-parallel group.

Layout: a pipeline is `pp` consecutive ranks (global rank = dp_rank * pp + pp_rank); ranks with the same
pp_rank form a data-parallel group. Each rank builds the model, keeps only its stages
(`dsv3_plugin.parallel.pipeline.stages`) and hands their parameters to `deepspeed.initialize` with an `mpu` that
names the data-parallel group (ZeRO-1 partitions the optimizer state and averages gradients there) and the
pipeline group as the "model-parallel" group (so the gradient norm for clipping sums over all stages).

Schedules with W ops (DualPipe, DualPipeV) defer weight gradients to them (`parallel.split_weight_grads`, on by
default there); their FB ops overlap one chunk's EP all-to-all with the other's compute (`parallel.overlap_ep_comm`,
on by default with ep > 1); `idle_report` gives every rank's busy / idle time of the pipeline steps.

One optimizer step = one pipeline step over all `gradient_accumulation_steps` micro-batches of the JSON:
the criterion scales each micro-batch loss by 1/gas (what `engine.backward` does), the schedule runs the
forwards and backwards, then ZeRO-1 reduces the gradients (`engine.allreduce_gradients`, the path DeepSpeed's
own pipeline engine uses) and `engine.step()` applies the optimizer. DeepSpeed itself therefore runs with
gradient_accumulation_steps = 1 and micro-batch = gas x micro-batch.

Expert parallelism (paper §3.1): EP groups are carved from each stage's data-parallel group
(`dsv3_plugin.parallel.groups`, registered as DeepSpeed's EP/EDP groups by `moe_layer`): expert gradients are
reduced over the expert-data-parallel group, dense ones over the data-parallel group, and the gradient norm for
clipping sums squares over the data-parallel group (EP ranks hold different experts) and the pipeline group.
A parameter held twice in one pipeline (DualPipe's mirror stages; 1F1B's embedding copy on the last rank for
MTP) is marked `ds_pipe_replicated` on one of its holders, so DeepSpeed counts it once in that norm. Stages may hold
different numbers of optimizer parameter groups (a stage without MoE layers; DeepSpeed's size split of expert
groups), so each stage's norm is summed over the pipeline once, not once per group
(`patches/deepspeed_zero_pipeline_norm.py`).

Router counts for the bias update (§2.1.2) are summed over exactly the ranks that saw the tokens: the stage's
data-parallel group and, for DualPipe, the mirror rank (which ran the other half of the micro-batches through
its copy of the same stages). Checkpoints: DeepSpeed's (one model file per pipeline rank, ZeRO-1 partitions,
expert files) plus the dsv3 state in `client_state["dsv3"]` (every rank's RNG, the optimizer-step count).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.config import ConfigError
from dsv3_plugin.deepspeed.backend import import_deepspeed
from dsv3_plugin.deepspeed.engine import (
    check_fp32_router_state,
    client_optimizer,
    gather_rng_states,
    prepare_mixed_precision,
    restore_rng_state,
)
from dsv3_plugin.deepspeed.moe_layer import prepare_model, stacking_order
from dsv3_plugin.errors import CheckpointError, PeerError
from dsv3_plugin.model.moe.balancing import reset_counts, routers_of, update_expert_bias
from dsv3_plugin.parallel.distributed import new_groups_bounded, peer_failures
from dsv3_plugin.parallel.pipeline import PipelineRuntime
from dsv3_plugin.parallel.pipeline.p2p import PipelineError, PipelinePeerError
from dsv3_plugin.parallel.pipeline.stages import (
    DSv3PipelineLoss,
    build_stages,
    n_stages_of,
    stage_ids_for_rank,
    sync_tied_embedding,
)
from dsv3_plugin.parallel.pipeline.weight_grad import split_weight_grads
from dsv3_plugin.schedule_traits import check_chunks

__all__ = ["PipelineGroups", "pipeline_groups", "idle_figures", "PipelineMPU", "PipelinedEngine"]


@dataclass
class PipelineGroups:
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: object
    dp_group: object
    pp_ranks: list[int]
    dp_ranks: list[int]


def idle_figures(steps: list[dict]) -> dict:
    """Busy / idle / mirror-exchange seconds summed over `PipelineRuntime.last_step` records, and the idle
    fraction idle / (busy + idle): the share of the schedule's time spent waiting on a peer."""
    busy, idle = sum(t["busy_s"] for t in steps), sum(t["idle_s"] for t in steps)
    return {
        "busy_s": busy,
        "idle_s": idle,
        "idle_fraction": idle / (busy + idle) if busy + idle > 0 else 0.0,
        "grad_sync_s": sum(t["grad_sync_s"] for t in steps),
        "wall_s": sum(t["wall_s"] for t in steps),
        "w_closures": sum(int(t["w_closures"]) for t in steps),
    }


def pipeline_groups(pp: int, timeout_s: float | None = None) -> PipelineGroups:
    """Create every pipeline and data-parallel group (all ranks must call this, in the same order).

    `timeout_s` bounds every collective on these groups (torch's default for a new group is 30 minutes,
    not the world group's timeout)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if pp < 1 or world % pp:
        raise ConfigError(f"dsv3.parallel.pp: must divide the world size (got pp={pp}, world={world})")
    dp = world // pp
    mine = {}
    kw = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    for d in range(dp):
        ranks = [d * pp + p for p in range(pp)]
        g = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["pp"] = (g, ranks)
    for p in range(pp):
        ranks = [d * pp + p for d in range(dp)]
        g = dist.new_group(ranks, **kw)
        if rank in ranks:
            mine["dp"] = (g, ranks)
    return PipelineGroups(pp, dp, rank % pp, rank // pp, mine["pp"][0], mine["dp"][0], mine["pp"][1], mine["dp"][1])


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


class _LocalStages(nn.Module):
    """The stages of this rank as one module for DeepSpeed (a module shared by two stages counts once)."""

    def __init__(self, stages):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args):  # never called: the pipeline runtime calls the stages
        raise RuntimeError("PipelinedEngine: call train_step(), not the module")


class PipelinedEngine:
    """`dsv3 train` with "parallel": {"pp": P, "schedule": ...}: build with the full model and the DeepSpeed
    JSON (its "dsv3" block gives the schedule), then call `train_step(ids, labels, tokens_seen)` with this
    data-parallel rank's gas x micro-batch sequences (the same on every rank of a pipeline).

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
        self.cfg = cfg
        self.schedule = cfg.parallel.schedule
        self.timeout_s = float(cfg.parallel.p2p_timeout_s if timeout_s is None else timeout_s)
        self.g = groups or pipeline_groups(cfg.parallel.pp, self.timeout_s)
        ds = copy.deepcopy(ds_config)
        self.gas = int(ds.get("gradient_accumulation_steps", 1))
        self.traits = check_chunks(
            self.schedule, self.g.pp, self.gas, chunks_key="gradient_accumulation_steps", pp_key="dsv3.parallel.pp"
        )
        mbs = int(ds.get("train_micro_batch_size_per_gpu", 1))
        self.micro_batch = mbs
        ds["gradient_accumulation_steps"] = 1
        ds["train_micro_batch_size_per_gpu"] = mbs * self.gas
        ds.pop("train_batch_size", None)
        ds.pop("dsv3", None)
        ids = stage_ids_for_rank(self.schedule, self.g.pp, self.g.pp_rank)
        self.stage_ids = ids
        self.stages = build_stages(model, n_stages_of(self.schedule, self.g.pp), ids)
        self.module = _LocalStages(self.stages)
        if cfg.parallel.ep > 1:  # this rank's stages' experts over the stage's EP group (collective: every rank)
            prepare_model(self.module, cfg, dp_group=self.g.dp_group)
        _mark_replicated(self.stages, self.traits, self.g)
        self.optimizer_steps = 0
        # The B / W split (paper §3.2.1): the last model transform, after FP8, recompute and expert parallelism
        # (`training.transforms`), so it wraps whatever kernel each GEMM ended up with. Off: W ops stay empty and
        # every backward computes its weight gradients inside B.
        self.split_w = cfg.parallel.split_w()
        if self.split_w:
            split_weight_grads(self.module)
        self.step_times: list[dict] = []  # per train_step: the runtime's busy_s / idle_s / wall_s / w_closures
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
        self._one_norm_all_reduce()
        # Gradients are produced outside engine.backward (by the schedule): reduce them like DeepSpeed's own
        # pipeline engine does.
        self.engine.pipeline_parallelism = True
        # Overlapped FB pairs (paper §3.2.1, Fig. 4; `parallel.overlap_ep_comm`): the schedule's FB ops run the
        # stages' overlap hook, each chunk's EP all-to-all hidden behind the other chunk's compute. Off: F then B.
        self.overlap_ep = cfg.parallel.overlap_ep()
        self.runtime = PipelineRuntime(
            self.stages,
            schedule=self.schedule,
            process_group=self.g.pp_group,
            timeout_s=self.timeout_s,
            timeout_name="parallel.p2p_timeout_s",
            overlap=self.overlap_ep,
        )

    def _one_norm_all_reduce(self) -> None:
        """DeepSpeed's ZeRO optimizer all-reduces one gradient norm per parameter group over the pipeline group, and
        the stages can hold different numbers of groups (a stage without MoE layers has no expert group; DeepSpeed
        splits a stage's experts into groups of <= 179 M elements): sum each stage's norm over the pipeline once
        instead (`patches/deepspeed_zero_pipeline_norm.py`). Where the patch does not apply (another DeepSpeed),
        stages with different group counts are refused here, before the first step would pair the all-reduces
        wrongly."""
        from patches import deepspeed_zero_pipeline_norm

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

    @contextlib.contextmanager
    def _peers(self, op: str, ranks: list[int]):
        """Turn a collective's failure (gloo: "Timed out waiting ...ms", "Connection closed by peer"; NCCL: the
        watchdog's error) into a `PipelinePeerError` that says which operation over which ranks, and the limit."""
        try:
            with peer_failures(op, self.timeout_s, ranks):
                yield
        except PipelineError:
            raise
        except PeerError as e:
            raise PipelinePeerError(str(e)) from e.__cause__

    def train_step(self, ids_NT: torch.Tensor, labels_NT: torch.Tensor, tokens_seen: float = 0.0) -> dict:
        """One optimizer step over gas micro-batches (N = gas x micro-batch rows). Returns the loss terms
        averaged over micro-batches and data-parallel ranks (identical on every rank)."""
        crit = DSv3PipelineLoss(self.cfg, tokens_seen, scale=1.0 / self.gas)
        self.engine.train()
        self.runtime.step(ids_NT, num_chunks=self.gas, criterion=crit, labels=(labels_NT,))
        self.step_times.append(
            {
                **self.runtime.last_step,
                **{f"a2a_wait_s_{k}": v for k, v in self.runtime.op_a2a_wait_s.items()},
                **{f"p2p_wait_s_{k}": v for k, v in self.runtime.op_p2p_wait_s.items()},
                **{f"op_s_{k}": v for k, v in self.runtime.op_seconds.items()},
            }
        )
        sync_tied_embedding(self.runtime, self.stages)
        with self._peers("gradient all-reduce (ZeRO-1)", self.g.dp_ranks):
            self.engine.allreduce_gradients()
        with self._peers(
            "optimizer step (gradient norm over the pipeline, ZeRO-1 all-gather)",
            sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks)),
        ):
            self.engine.step()
        self.optimizer_steps += 1
        sums_4 = torch.zeros(4, dtype=torch.float64)
        for rec in crit.records:
            sums_4 += torch.tensor(
                [float(rec[k]) if rec[k] is not None else 0.0 for k in ("loss", "lm_loss", "mtp_loss", "balance_loss")],
                dtype=torch.float64,
            )
        # the ranks where micro-batches end (the loss rank; DualPipe: ranks 0 and P-1, half each) hold the sums
        # of their micro-batches, the others zeros: sum over the pipeline, then average over DP
        with self._peers("loss all-reduce over the pipeline", self.g.pp_ranks):
            dist.all_reduce(sums_4, group=self.g.pp_group)
        with self._peers("loss all-reduce", self.g.dp_ranks):
            dist.all_reduce(sums_4, group=self.g.dp_group)
        means = (sums_4 / (self.gas * self.g.dp)).tolist()
        return dict(zip(("loss", "lm_loss", "mtp_loss", "balance_loss"), means))

    def idle_report(self, skip_first: bool = True) -> dict:
        """Every rank's busy / idle time in the pipeline steps run so far (a collective over the world: call on
        every rank). Busy: inside F/B/W/FB stage compute; idle: waiting on a peer during the schedule;
        grad_sync: DualPipe's mirror gradient exchange (0 for the other schedules; see `PipelineRuntime.step`).
        The first step is left out when there are more (`skip_first`): it pays one-time set-up costs.
        Returns {"schedule", "split_weight_grads", "steps_measured", "ranks": [per global rank: {"rank",
        "pp_rank", "dp_rank", "busy_s", "idle_s", "idle_fraction", "grad_sync_s", "wall_s", "w_closures"}]}."""
        steps = self.step_times[1:] if skip_first and len(self.step_times) > 1 else self.step_times
        mine = {"rank": dist.get_rank(), "pp_rank": self.g.pp_rank, "dp_rank": self.g.dp_rank, **idle_figures(steps)}
        ranks = [None] * dist.get_world_size()
        with self._peers("all_gather_object of the pipeline busy/idle times", list(range(len(ranks)))):
            dist.all_gather_object(ranks, mine)
        return {
            "schedule": self.schedule,
            "split_weight_grads": self.split_w,
            "steps_measured": len(steps),
            "ranks": ranks,
        }

    def gather_pipeline(self, obj) -> list:
        """`obj` of every rank of this pipeline, in pipeline-rank order (time-limited like every other wait)."""
        out = [None] * self.g.pp
        with self._peers("all_gather_object over the pipeline", self.g.pp_ranks):
            dist.all_gather_object(out, obj, group=self.g.pp_group)
        return out

    def _routers_by_stage(self) -> tuple[list, list[int]]:
        """This rank's routers and their MoE-layer indices, ordered by model stage (each stage's layers, then
        its MTP blocks): the data-parallel peers and the DualPipe mirror list the same layers in this order."""
        order = sorted(range(len(self.stages)), key=lambda c: self.stage_ids[c])
        routers, slots = [], []
        for c in order:
            st = self.stages[c]
            for slot, layer in zip(st.moe_slot, st.layers):
                if slot >= 0:
                    routers += routers_of(layer.mlp)
                    slots.append(slot)
            for slot, m in zip(getattr(st, "mtp_slot", []), getattr(st, "mtp", [])):
                if slot >= 0:
                    routers += routers_of(m.layer.mlp)
                    slots.append(slot)
        return routers, slots

    def _sum_counts(self, counts_LE: torch.Tensor) -> torch.Tensor:
        """Expert loads summed over the ranks that saw this step's tokens for these layers: the data-parallel
        group; for DualPipe also the mirror rank (P-1-r holds the same stages and ran the other half of the
        micro-batches). Counts are integers in float32: every order of summation gives the same value."""
        with self._peers("expert-load all-reduce (bias update)", self.g.dp_ranks):
            dist.all_reduce(counts_LE, op=dist.ReduceOp.SUM, group=self.g.dp_group)
        if not (self.traits.mirror_sync and self.g.pp > 1):
            return counts_LE
        mirror = self.g.pp - 1 - self.g.pp_rank
        if mirror == self.g.pp_rank:
            return counts_LE
        peer = self.g.pp_ranks[mirror]
        other = torch.empty_like(counts_LE)
        with self._peers("expert-load exchange with the DualPipe mirror rank", [self.g.pp_ranks[self.g.pp_rank], peer]):
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, counts_LE, peer, group=self.g.pp_group),
                    dist.P2POp(dist.irecv, other, peer, group=self.g.pp_group),
                ]
            )
            for w in works:
                self.runtime.p2p._wait(w, f"expert-load exchange with mirror pipeline rank {mirror}")
        return counts_LE + other

    def update_expert_bias(self, gamma: float):
        """Aux-loss-free bias update for this rank's routers: counts summed over the data-parallel group
        (for DualPipe also over the mirror rank, which saw the other half of the micro-batches), so every copy
        of a router (data-parallel replicas, DualPipe mirrors) applies the same update."""
        routers, slots = self._routers_by_stage()
        with torch.no_grad():
            stats = update_expert_bias(routers, gamma, reduce=self._sum_counts)
        # which of the model's MoE layers each entry is, so that callers can put the pipeline's layers back in
        # model order (DualPipe: both mirrors report the same layers)
        for st, slot in zip(stats, slots):
            st["moe_index"] = slot
        return stats

    # --- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict | None = None) -> None:
        """DeepSpeed's checkpoint (one model file per pipeline rank with its stages' weights and router biases,
        ZeRO-1 optimizer partitions, expert files, LR schedule) plus `client_state["dsv3"]`: every rank's RNG
        state (all-gathered: DeepSpeed writes client_state from each stage's data-parallel rank 0 only), the
        optimizer-step count and the config. Call between steps (router counts are zero there)."""
        cs = dict(client_state or {})
        cs["dsv3"] = {**gather_rng_states(), "optimizer_steps": self.optimizer_steps, "config": self.cfg.to_dict()}
        with self._peers("save_checkpoint", sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks))):
            self.engine.save_checkpoint(save_dir, tag=tag, client_state=cs)

    def load_checkpoint(self, load_dir: str, tag: str) -> dict:
        """Load what `save_checkpoint` wrote (same pp, dp, ep); restores this rank's RNG state. Returns the
        caller's client_state keys (CheckpointError when it is not a dsv3 pipelined checkpoint or the layout
        differs)."""
        with self._peers("load_checkpoint", sorted(set(self.g.pp_ranks) | set(self.g.dp_ranks))):
            path, client = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise CheckpointError(f"{load_dir}: DeepSpeed could not load checkpoint tag {tag!r}")
        client = dict(client or {})
        st = client.pop("dsv3", None)
        if st is None:
            raise CheckpointError(f"{path}: client_state has no 'dsv3' entry (not saved by dsv3 train)")
        restore_rng_state(st, str(path))
        self.optimizer_steps = int(st.get("optimizer_steps", 0))
        reset_counts(self.module)  # counts of an interrupted step must not leak into the next update
        return client
