"""A rank's pipeline stages driven by the schedule runtime: what a pipelined engine does that no framework does.

`PipelinedStages` builds this rank's stages of the model (`parallel.pipeline.stages`: DualPipe, DualPipeV, 1F1B,
ZB1P), defers weight gradients to the schedule's W ops (`parallel.split_weight_grads`, paper §3.2.1), runs one
pipeline step over the micro-batches (`run_schedule`), averages the loss terms over the pipeline and the
data-parallel group, sums the expert loads for the aux-loss-free bias update (§2.1.2) over exactly the ranks that
saw the tokens (the data-parallel group and, for DualPipe, the mirror rank), and reports every rank's busy / idle
time. Micro-batches are `data.batch.Batch`es: packed rows' position_ids and padding masks travel with the
activations to every stage (`parallel.pipeline.stages`); `eval_loss` runs the schedule forward-only (no gradients,
no expert loads, no bias update) and sums the LM cross-entropy over the loss tokens. A framework adapter
subclasses it and adds the optimizer: `deepspeed.pipeline.PipelinedEngine` (ZeRO-1 over the data-parallel group).
Every wait on a peer is bounded by `parallel.p2p_timeout_s`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.data.batch import IGNORE_INDEX, Batch
from dsv3_plugin.errors import DataError, PeerError
from dsv3_plugin.model.moe.balancing import routers_of, update_expert_bias
from dsv3_plugin.parallel.distributed import peer_failures
from dsv3_plugin.parallel.groups import PipelineGroups, pipeline_groups
from dsv3_plugin.parallel.pipeline import PipelineRuntime
from dsv3_plugin.parallel.pipeline.p2p import PipelineError, PipelinePeerError
from dsv3_plugin.parallel.pipeline.stages import (
    DSv3PipelineLoss,
    PipelineCESum,
    build_stages,
    n_stages_of,
    stage_ids_for_rank,
    stage_inputs,
    sync_tied_embedding,
)
from dsv3_plugin.parallel.pipeline.weight_grad import split_weight_grads
from dsv3_plugin.schedule_traits import check_chunks

__all__ = ["PipelinedStages", "LocalStages", "idle_figures", "as_batch", "concat_batches"]

LOSS_TERMS = ("loss", "lm_loss", "mtp_loss", "balance_loss")


def as_batch(mb) -> Batch:
    """A `Batch` from a `Batch` or an (input_ids, labels[, position_ids, token_mask]) tuple."""
    return mb if isinstance(mb, Batch) else Batch(*mb)


def concat_batches(batches: list[Batch]) -> Batch:
    """The micro-batches stacked along the batch dimension ([gas x B, T]), as the pipeline runtime takes them (it
    cuts them back into equal parts). A field given by some micro-batches only is filled in for the others with
    its neutral value (positions 0..T-1, no padding).

    Raises:
        DataError: the micro-batches differ in shape (the runtime's equal split would mix them up).
    """
    shapes = {tuple(b.input_ids.shape) for b in batches}
    if len(shapes) != 1:
        raise DataError(f"pipelined engine: the micro-batches of one step must share one shape [B, T] (got {shapes})")
    ids = torch.cat([b.input_ids for b in batches])
    labels = torch.cat([b.labels for b in batches])
    pos = mask = None
    if any(b.position_ids is not None for b in batches):
        T = ids.shape[1]
        plain = torch.arange(T, device=ids.device).expand_as(batches[0].input_ids)
        pos = torch.cat([plain if b.position_ids is None else b.position_ids for b in batches])
    if any(b.token_mask is not None for b in batches):
        real = torch.ones_like(batches[0].input_ids, dtype=torch.bool)
        mask = torch.cat([real if b.token_mask is None else b.token_mask for b in batches])
    return Batch(ids, labels, pos, mask)


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


class LocalStages(nn.Module):
    """The stages of this rank as one module for DeepSpeed (a module shared by two stages counts once)."""

    def __init__(self, stages):
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, *args):  # never called: the pipeline runtime calls the stages
        raise RuntimeError("PipelinedEngine: call train_step(), not the module")


class PipelinedStages:
    """This rank's stages of `model` under `cfg.parallel.schedule`, with `gas` micro-batches per step.

    Args:
        model: the rank's model (rank-local or full); its stages' modules are kept, the rest dropped.
        cfg: the `DSv3Config` (parallel.pp, schedule, ep, split_weight_grads, overlap_ep_comm, p2p_timeout_s).
        gas: micro-batches per optimizer step (the schedule's chunk count).
        groups: the pipeline / data-parallel groups (default: made here, collective).
        timeout_s: the bound on every wait on a peer (default `parallel.p2p_timeout_s`).
        gas_key: the config key that set `gas`, named when the schedule refuses it.

    Subclasses call `_split_weight_grads()` after their last change to the modules, then `_start_runtime()`.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg,
        gas: int,
        groups: PipelineGroups | None = None,
        timeout_s: float | None = None,
        gas_key: str = "gradient_accumulation_steps",
    ):
        self.cfg = cfg
        self.schedule = cfg.parallel.schedule
        self.timeout_s = float(cfg.parallel.p2p_timeout_s if timeout_s is None else timeout_s)
        self.g = groups or pipeline_groups(cfg.parallel.pp, self.timeout_s)
        self.gas = gas
        self.traits = check_chunks(self.schedule, self.g.pp, self.gas, chunks_key=gas_key, pp_key="dsv3.parallel.pp")
        self.stage_ids = stage_ids_for_rank(self.schedule, self.g.pp, self.g.pp_rank)
        self.stages = build_stages(model, n_stages_of(self.schedule, self.g.pp), self.stage_ids)
        self.module = LocalStages(self.stages)
        self.optimizer_steps = 0
        self.step_times: list[dict] = []  # per step: the runtime's busy_s / idle_s / wall_s / w_closures
        self.split_w = cfg.parallel.split_w()
        self.overlap_ep = cfg.parallel.overlap_ep()
        self.runtime = None

    def _split_weight_grads(self) -> None:
        """The B / W split (paper §3.2.1): the last model transform, after FP8, recompute and expert parallelism
        (`training.transforms`), so it wraps whatever kernel each GEMM ended up with. Off: W ops stay empty and
        every backward computes its weight gradients inside B."""
        if self.split_w:
            split_weight_grads(self.module)

    def _start_runtime(self) -> None:
        """The schedule's runtime over the pipeline group. Overlapped FB pairs (paper §3.2.1, Fig. 4;
        `parallel.overlap_ep_comm`): the schedule's FB ops run the stages' overlap hook, each chunk's EP all-to-all
        hidden behind the other chunk's compute. Off: F then B."""
        self.runtime = PipelineRuntime(
            self.stages,
            schedule=self.schedule,
            process_group=self.g.pp_group,
            timeout_s=self.timeout_s,
            timeout_name="parallel.p2p_timeout_s",
            overlap=self.overlap_ep,
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

    def run_schedule(
        self,
        ids_NT: torch.Tensor,
        labels_NT: torch.Tensor,
        tokens_seen: float,
        position_ids_NT: torch.Tensor | None = None,
        token_mask_NT: torch.Tensor | None = None,
    ) -> DSv3PipelineLoss:
        """Forwards and backwards of one pipeline step over gas micro-batches (N = gas x micro-batch rows), the
        criterion scaling each micro-batch loss by 1/gas; the tied embedding's gradients summed. `position_ids_NT`
        / `token_mask_NT` [N, T]: packed rows' positions, padding (`DSv3Model.forward`). Returns the criterion
        (its `records`: this rank's micro-batch losses)."""
        packed = position_ids_NT is not None
        crit = DSv3PipelineLoss(self.cfg, tokens_seen, scale=1.0 / self.gas, with_positions=packed)
        self.runtime.step(
            *stage_inputs(ids_NT, position_ids_NT, token_mask_NT),
            num_chunks=self.gas,
            criterion=crit,
            labels=(labels_NT, position_ids_NT) if packed else (labels_NT,),
        )
        self.step_times.append(
            {
                **self.runtime.last_step,
                **{f"a2a_wait_s_{k}": v for k, v in self.runtime.op_a2a_wait_s.items()},
                **{f"p2p_wait_s_{k}": v for k, v in self.runtime.op_p2p_wait_s.items()},
                **{f"op_s_{k}": v for k, v in self.runtime.op_seconds.items()},
            }
        )
        sync_tied_embedding(self.runtime, self.stages)
        return crit

    def eval_loss(self, micro_batches: list[Batch]) -> tuple[float, int]:
        """The LM cross-entropy summed over the loss tokens (labels != -100) of `micro_batches`, and their count,
        summed over the data-parallel group (collective over the world: every rank of a pipeline passes the same
        micro-batches, as in training; the same result on every rank). Forward-only schedule steps of gas
        micro-batches each, under `torch.no_grad()` in eval mode: no gradient, no expert loads or telemetry
        counted, no bias or optimizer update; the stages' train/eval mode is restored. A last group short of gas
        is completed with copies of its first micro-batch whose labels are all -100 (they add nothing)."""
        batches = [as_batch(b) for b in micro_batches]
        sums_2 = torch.zeros(2, dtype=torch.float64)  # CE sum, loss tokens (on the rank holding the losses)
        was = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                for i in range(0, len(batches), self.gas):
                    group = batches[i : i + self.gas]
                    if len(group) < self.gas:
                        filler = group[0]._replace(labels=torch.full_like(group[0].labels, IGNORE_INDEX))
                        group = group + [filler] * (self.gas - len(group))
                    b = concat_batches(group)
                    out = self.runtime.step(
                        *stage_inputs(b.input_ids, b.position_ids, b.token_mask),
                        num_chunks=self.gas,
                        criterion=PipelineCESum(),
                        labels=(b.labels,),
                    )
                    if out.losses is not None:  # the loss rank: every micro-batch's CE sum
                        sums_2[0] += out.losses.double().sum().cpu()
                        sums_2[1] += float((b.labels != IGNORE_INDEX).sum())
        finally:
            self.module.train(was)
        with self._peers("eval loss all-reduce over the pipeline", self.g.pp_ranks):
            dist.all_reduce(sums_2, group=self.g.pp_group)
        with self._peers("eval loss all-reduce", self.g.dp_ranks):
            dist.all_reduce(sums_2, group=self.g.dp_group)
        return float(sums_2[0]), int(sums_2[1])

    def mean_losses(self, crit: DSv3PipelineLoss) -> dict:
        """The loss terms averaged over micro-batches and data-parallel ranks (identical on every rank)."""
        sums_4 = torch.zeros(4, dtype=torch.float64)
        for rec in crit.records:
            sums_4 += torch.tensor(
                [float(rec[k]) if rec[k] is not None else 0.0 for k in LOSS_TERMS], dtype=torch.float64
            )
        # the ranks where micro-batches end (the loss rank; DualPipe: ranks 0 and P-1, half each) hold the sums
        # of their micro-batches, the others zeros: sum over the pipeline, then average over DP
        with self._peers("loss all-reduce over the pipeline", self.g.pp_ranks):
            dist.all_reduce(sums_4, group=self.g.pp_group)
        with self._peers("loss all-reduce", self.g.dp_ranks):
            dist.all_reduce(sums_4, group=self.g.dp_group)
        means = (sums_4 / (self.gas * self.g.dp)).tolist()
        return dict(zip(LOSS_TERMS, means, strict=True))

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
