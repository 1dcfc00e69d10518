"""Our pipeline schedules (DualPipeV, DualPipe, 1F1B) as Megatron-Core forward-backward functions.

Design notes (each convention in detail): docs/design_notes.md#megatron-schedules
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.megatron.dualpipev import mirror_stage, sum_embedding_copy_grads, sum_mirror_grads, v_stage
from dsv3_plugin.megatron.fp8 import seam_parallel_linears
from dsv3_plugin.parallel.pipeline.runtime import DualPipe, DualPipeV, OneFOneB
from dsv3_plugin.parallel.pipeline.stages import ep_layers, overlapped_pair
from dsv3_plugin.parallel.pipeline.weight_grad import split_weight_grads

__all__ = [
    "forward_backward_dualpipev",
    "forward_backward_dualpipe",
    "forward_backward_1f1b",
    "MegatronChunkStage",
    "overlap_enabled",
    "SCHEDULE_FUNCS",
    "take_step_figures",
]

# The runtime's busy / idle figures of the last training step this process ran (`take_step_figures`).
_LAST_TRAIN_STEP: dict | None = None


def take_step_figures() -> dict | None:
    """This pipeline rank's figures of the last training (not evaluation) step run by one of our schedules since the
    previous call, then forgets them (a later iteration run by another schedule reports None, not stale figures).

    Returns:
        None if none ran, else {"schedule", "busy_s", "idle_s", "idle_fraction", "a2a_wait_s", "grad_sync_s",
        "wall_s", "w_closures", "fb_hook"}: `PipelineRuntime.last_step` (busy = stage compute, its P2P waits
        excluded; idle = waiting on a peer during the schedule; a2a_wait_s = blocked in EP all-to-all waits, part of
        busy) and idle_fraction = idle / (busy + idle).
    """
    global _LAST_TRAIN_STEP
    out, _LAST_TRAIN_STEP = _LAST_TRAIN_STEP, None
    return out


class MegatronChunkStage(nn.Module):
    """One Megatron model chunk as a pipeline stage: feeds the received tensors through `set_input_tensor`,
    calls `forward_step_func` with the chunk's data iterator, and queues `loss_func` for the criterion."""

    def __init__(self, chunk: nn.Module, is_first: bool):
        super().__init__()
        self.chunk = chunk
        self.is_first = is_first
        self.forward_step_func = None
        self.data_iterator = None
        self.loss_funcs: list = []
        # a list: record each forward's own MTP tracker values (DualPipe's last stages; see `_mtp_of_forward`)
        self.mtp_per_forward: list | None = None

    def forward(self, *inputs: torch.Tensor):
        target = self.chunk
        while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
            target = target.module  # Megatron DDP / Float16Module wrappers
        target.set_input_tensor([None] if self.is_first or not inputs else list(inputs))
        if self.mtp_per_forward is None:
            output_tensor, loss_func = self.forward_step_func(self.data_iterator, self.chunk)
        else:
            with _mtp_of_forward(self.mtp_per_forward):
                output_tensor, loss_func = self.forward_step_func(self.data_iterator, self.chunk)
        self.loss_funcs.append(loss_func)
        return output_tensor

    @classmethod
    def overlapped_forward_backward(cls, f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads):
        """The runtime's overlap hook for FB ops (`stages.overlapped_pair`, paper Fig. 4): this chunk's forward
        (Megatron's forward step) and the other chunk's backward as two lanes, each one's EP all-to-all in flight
        while the other computes; the same ops as forward then backward."""
        return overlapped_pair(f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads)


def overlap_enabled(cfg, schedule: str, chunks) -> bool:
    """Whether `schedule`'s FB pairs overlap one chunk's EP all-to-all with the other's compute: the dsv3 block's
    `parallel.overlap_ep_comm` when set, else (as in `dsv3 train`) on for DualPipe / DualPipeV where a chunk has
    the plugin's MoE layers with expert-parallel communication."""
    if schedule not in ("dualpipev", "dualpipe"):
        return False
    explicit = None if cfg is None else cfg.parallel.overlap_ep_comm
    if explicit is not None:
        return bool(explicit)
    return any(ep_layers(c) for c in chunks)


class _mtp_of_forward:
    """Around one forward: the MTP tracker's values are set aside and zeroed, what the forward adds (0 + v: v
    exactly) is appended to `out`, and the set-aside values are put back. The last rank later adds every micro-
    batch's v in micro-batch order, the sums Megatron's own schedules form on one rank."""

    def __init__(self, out: list):
        self.out = out

    def __enter__(self):
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        self.tracker = MTPLossLoggingHelper.tracker
        self.saved = {k: self.tracker[k].clone() for k in _MTP_KEYS if self.tracker.get(k) is not None}
        for k in self.saved:
            self.tracker[k].zero_()

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        t = self.tracker
        self.out.append({k: t[k].detach().clone() for k in _MTP_KEYS if t.get(k) is not None})
        for k in _MTP_KEYS:
            if t.get(k) is not None:
                if k in self.saved:
                    t[k].copy_(self.saved[k])
                else:
                    t[k].zero_()
        return False


def _pp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def _config_of(chunk):
    from megatron.core.utils import get_model_config

    return get_model_config(chunk)


_RUNTIMES: dict = {}


def _stage_of(name: str, rank: int, chunk: int, P: int) -> tuple[int, int]:
    """(model stage of local chunk `chunk` on pipeline rank `rank`, number of stages) for schedule `name`."""
    if name == "dualpipev":
        return v_stage(rank, chunk, P), 2 * P
    if name == "dualpipe":
        return mirror_stage(rank, chunk, P), P
    return rank, P


def _runtime(cls, chunks, group, config):
    key = (cls.schedule_name, tuple(id(c) for c in chunks), id(group))
    rt = _RUNTIMES.get(key)
    if rt is None:
        rank, P = dist.get_rank(group), dist.get_world_size(group)
        stages = [
            MegatronChunkStage(c, is_first=_stage_of(cls.schedule_name, rank, i, P)[0] == 0)
            for i, c in enumerate(chunks)
        ]
        cfg = getattr(config, "dsv3_config", None)  # a config built from a dsv3 block carries its P2P limit
        timeout = float(cfg.parallel.p2p_timeout_s) if cfg is not None else 600.0
        if cfg is not None and cfg.parallel.split_weight_grads and cls.schedule_name in ("dualpipev", "dualpipe"):
            # the W split (paper §3.2.1): the plugin's GEMMs (dense MLP, routed and shared experts) and Megatron's
            # linears (MLA projections, output head, MTP eh_proj: through the kernel seam) defer their weight
            # gradients to the schedule's W ops
            for c in chunks:
                seam_parallel_linears(c)
            if sum(split_weight_grads(c) for c in chunks) == 0:
                raise ValueError(
                    f"dsv3.parallel.split_weight_grads = true: no layer of the plugin in the {cls.schedule_name} "
                    "chunks defers its weight gradients (a --spec without the plugin's FFN?)"
                )
        # DualPipe's mirror exchange runs here on Megatron's gradients (`main_grad`), not in the runtime (`.grad`)
        rt = cls(
            stages,
            process_group=group,
            overlap=overlap_enabled(cfg, cls.schedule_name, chunks),
            timeout_s=timeout,
            timeout_name="dsv3.parallel.p2p_timeout_s",
            mirror_grad_sync=False,
        )
        _RUNTIMES[key] = rt
    return rt


def _halves(its: list, rank: int, P: int, num_microbatches: int) -> list:
    """DualPipe: each chunk that reads data (stage 0 or P-1 of its copy) reads the step's micro-batches from its own
    Megatron iterator (all of them, so that every iterator stays at the same place) and is fed its copy's half:
    copy A (chunk 0) micro-batches 0..C/2-1, copy B (chunk 1) C/2..C-1."""
    half = num_microbatches // 2
    out = []
    for c, it in enumerate(its):
        stage = mirror_stage(rank, c, P)
        if it is None or stage not in (0, P - 1):
            out.append(it)
            continue
        items = [next(it) for _ in range(num_microbatches)]
        out.append(iter(items[:half] if c == 0 else items[half:]))
    return out


def _iterators(data_iterator, n: int) -> list[Iterator | None]:
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != n:
            raise ValueError(
                f"pipeline schedule: need one data iterator per model chunk ({n}), got {len(data_iterator)}"
            )
        return list(data_iterator)
    if data_iterator is None:
        return [None] * n
    return list(itertools.tee(data_iterator, n)) if n > 1 else [data_iterator]


def _forward_backward(
    cls,
    n_chunks: int,
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    forward_only: bool,
    collect_non_loss_data: bool,
    pg_collection,
    force_all_reduce: bool,
):
    name = cls.schedule_name
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != n_chunks:
        raise ValueError(f"{name}: each pipeline rank needs {n_chunks} model chunk(s), got {len(chunks)}")
    if collect_non_loss_data:
        raise ValueError(f"{name}: collect_non_loss_data=True is not supported by this schedule")
    config = _config_of(chunks[0])
    group = _pp_group(pg_collection)
    rt = _runtime(cls, chunks, group, config)
    its = _iterators(data_iterator, n_chunks)
    stages = [_stage_of(name, rt.rank, c, rt.P) for c in range(n_chunks)]
    # the chunk holding a last stage on this rank (V: rank 0's chunk 1; 1F1B: the last rank's; DualPipe: both
    # ends, one per copy), and the first micro-batch its copy computes
    ends = [c for c, (s, n) in enumerate(stages) if s == n - 1]
    last = rt.modules[ends[0] if ends else -1]
    mb0 = 0
    mtp_split = False
    if name == "dualpipe":
        its = _halves(its, rt.rank, rt.P, num_microbatches)
        mb0 = num_microbatches // 2 if ends and ends[0] == 1 else 0
        mtp_split = not forward_only and getattr(config, "mtp_num_layers", None) is not None
    for c, (st, it) in enumerate(zip(rt.modules, its)):
        st.forward_step_func, st.data_iterator, st.loss_funcs = forward_step_func, it, []
        st.mtp_per_forward = [] if mtp_split and c in ends else None

    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int)

    def criterion(*outputs):
        nonlocal total_tokens
        output_tensor = outputs[0] if len(outputs) == 1 else list(outputs)
        result = last.loss_funcs.pop(0)(output_tensor)
        if len(result) == 3:
            loss, num_tokens, reduced = result
            total_tokens = total_tokens + num_tokens.detach().to(total_tokens.device, torch.int)
            if not config.calculate_per_token_loss:
                loss = loss / torch.clamp(num_tokens, min=1) / num_microbatches
        else:
            loss, reduced = result
            loss = loss / num_microbatches
        forward_data_store.append(reduced)
        if not forward_only and config.grad_scale_func is not None:
            loss = config.grad_scale_func(loss)  # what backward sees (Megatron's backward_step does this)
        return loss

    _set_aux_loss_scales(config, num_microbatches)
    try:
        if forward_only:
            with torch.no_grad():
                rt.step(num_chunks=num_microbatches, criterion=criterion)
        else:
            rt.step(num_chunks=num_microbatches, criterion=criterion)
            _record_step(rt)
            if rt.last_step.get("w_closures"):
                _deferred_grads_to_main_grad(chunks)
        mtp_values = last.mtp_per_forward
    finally:
        # The cached runtime outlives the step; holding Megatron's data iterator in it would keep the DataLoader's
        # workers alive to interpreter exit, where multiprocessing stops them with SIGTERM -- which
        # --exit-signal-handler makes them ignore (Megatron installs its handler in every worker), so the rank
        # hung after its last iteration.
        for st in rt.modules:
            st.forward_step_func, st.data_iterator, st.loss_funcs, st.mtp_per_forward = None, None, [], None
    if name == "dualpipe":
        forward_data_store, total_tokens = _both_ends_to_last_rank(
            rt, group, list(enumerate(forward_data_store, start=mb0)), total_tokens, mtp_values, mb0
        )
    else:
        forward_data_store, total_tokens = _to_last_rank(
            rt, group, forward_data_store, total_tokens, mtp_metrics=not forward_only
        )
    if not forward_only and name == "dualpipe":
        # the two copies of every stage: gradients (and the routers' token counts) summed before Megatron reduces
        # them over data parallel and steps the expert biases; the embedding copies on one rank summed first
        sum_embedding_copy_grads(chunks)
        sync_s = sum_mirror_grads(chunks, rt.rank, rt.P, group, lambda c: stages[c][0])
        if _LAST_TRAIN_STEP is not None:  # as the runtime counts its own mirror exchange: in the step, not idle
            _LAST_TRAIN_STEP["grad_sync_s"] += sync_s
            _LAST_TRAIN_STEP["wall_s"] += sync_s
    if not forward_only:
        if config.finalize_model_grads_func is not None:
            kw = {}
            params = inspect.signature(config.finalize_model_grads_func).parameters
            if "pg_collection" in params:
                kw["pg_collection"] = pg_collection
            if "force_all_reduce" in params:
                kw["force_all_reduce"] = force_all_reduce
            config.finalize_model_grads_func(chunks, total_tokens if config.calculate_per_token_loss else None, **kw)
        if name != "dualpipe":
            sum_embedding_copy_grads(chunks)
    return forward_data_store


def _deferred_grads_to_main_grad(chunks) -> None:
    """W ops add deferred weight gradients to `.grad` directly (no AccumulateGrad, so Megatron DDP's hook, which
    moves `.grad` into `main_grad`, does not run for them): move them as that hook does."""
    for c in chunks:
        for p in torch.nn.Module.parameters(c):
            if p.grad is not None and getattr(p, "main_grad", None) is not None:
                p.main_grad.add_(p.grad.to(p.main_grad.dtype))
                p.grad = None


def _record_step(rt) -> None:
    global _LAST_TRAIN_STEP
    f = rt.last_step
    busy, idle = float(f["busy_s"]), float(f["idle_s"])
    _LAST_TRAIN_STEP = {
        "schedule": rt.schedule_name,
        "busy_s": busy,
        "idle_s": idle,
        "idle_fraction": idle / (busy + idle) if busy + idle > 0 else 0.0,
        **{k: float(f[k]) for k in ("a2a_wait_s", "grad_sync_s", "wall_s")},
        **{k: int(f[k]) for k in ("w_closures", "fb_hook")},
    }


_MTP_KEYS = ("loss_values", "correct_values", "total_values")


def _to_last_rank(rt, group, store: list, total_tokens: torch.Tensor, mtp_metrics: bool):
    """Megatron reads the loss dicts (and, for per-token loss, the token count) on the last pipeline rank, and logs
    from there; our runtime has them on `rt.loss_rank` (rank 0 for DualPipeV, which also runs the MTP block there).
    Move the loss dicts and the step's MTP loss metrics (Megatron's `MTPLossLoggingHelper` tracker) to the last
    rank; other ranks return []."""
    last = rt.P - 1
    if rt.loss_rank == last or rt.P == 1:
        return (store if rt.rank == last else []), total_tokens
    tracker = None
    if mtp_metrics:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
    mtp = None
    if rt.rank == rt.loss_rank and tracker is not None and "loss_values" in tracker:
        mtp = {k: tracker[k].detach().clone() for k in _MTP_KEYS if k in tracker}
        for k in mtp:
            tracker[k].zero_()  # moved, not copied: the sum over stages is unchanged
    box = [store, total_tokens, mtp] if rt.rank == rt.loss_rank else [None, None, None]
    dist.broadcast_object_list(box, src=rt.pipe_to_global[rt.loss_rank], group=group)
    if rt.rank == last and box[2] is not None:
        from megatron.core import parallel_state

        for k, v in box[2].items():
            v = v.to(rt.device)
            tracker[k] = tracker[k] + v if k in tracker else v
        if tracker.get("avg_group") is None:  # what the MTP block sets where it runs
            tracker["avg_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return (box[0] if rt.rank == last else []), box[1]


def _both_ends_to_last_rank(rt, group, store: list, total_tokens: torch.Tensor, mtp_values, mb0: int):
    """DualPipe: the loss dicts (`store`: (micro-batch, dict) pairs), token counts and per-micro-batch MTP tracker
    values of copy B's end (rank 0) join copy A's on the last rank, which reduces them in micro-batch order (the
    order Megatron's own schedules add them in); other ranks return []."""
    last = rt.P - 1
    mtp = None if mtp_values is None else list(enumerate(mtp_values, start=mb0))
    box = [store, total_tokens, mtp] if rt.rank == 0 else [None, None, None]
    dist.broadcast_object_list(box, src=rt.pipe_to_global[0], group=group)
    if rt.rank != last:
        return [], total_tokens
    store = sorted(store + box[0], key=lambda e: e[0])
    total_tokens = total_tokens + box[1].to(total_tokens.device)
    if mtp is not None or box[2] is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        for _, vals in sorted((mtp or []) + (box[2] or []), key=lambda e: e[0]):
            for k, v in vals.items():
                v = v.to(rt.device)
                tracker[k] = tracker[k] + v if tracker.get(k) is not None else v
    return [d for _, d in store], total_tokens


def forward_backward_dualpipev(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool = False,
):
    """DualPipeV over the pipeline group: two chunks per rank (stages r and 2P-1-r), >= 2P micro-batches."""
    return _forward_backward(
        DualPipeV,
        2,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


def forward_backward_1f1b(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool = False,
):
    """Our 1F1B (the baseline DualPipeV is compared with) over the pipeline group: one chunk per rank."""
    return _forward_backward(
        OneFOneB,
        1,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


def forward_backward_dualpipe(
    *,
    forward_step_func,
    data_iterator,
    model,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    decoder_seq_length=None,
    forward_only: bool = False,
    collect_non_loss_data: bool = False,
    first_val_step=None,
    adjust_tensor_shapes_fn=None,
    p2p_communicator=None,
    pg_collection=None,
    force_all_reduce: bool = False,
):
    """DualPipe (bidirectional) over the pipeline group: two chunks per rank, stage r of copy A and stage P-1-r of
    copy B (`dualpipev.py`); an even number >= 2P of micro-batches, half entering at each end."""
    return _forward_backward(
        DualPipe,
        2,
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
        pg_collection=pg_collection,
        force_all_reduce=force_all_reduce,
    )


SCHEDULE_FUNCS = {
    "dualpipev": forward_backward_dualpipev,
    "dualpipe": forward_backward_dualpipe,
    "1f1b": forward_backward_1f1b,
}


def _set_aux_loss_scales(config, num_microbatches: int) -> None:
    """Megatron's MoE aux-loss and MTP losses are back-propagated through auto-scalers whose scale the native
    schedules set per step (1/num_microbatches unless per-token loss); do the same."""
    if getattr(config, "num_moe_experts", None) is None and getattr(config, "mtp_num_layers", None) is None:
        return
    scale = torch.ones(1)
    if config.grad_scale_func is not None:
        scale = config.grad_scale_func(scale)
    if not config.calculate_per_token_loss:
        scale = scale / num_microbatches
    if getattr(config, "num_moe_experts", None) is not None:
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(scale)
    if getattr(config, "mtp_num_layers", None) is not None:
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        MTPLossAutoScaler.set_loss_scale(scale)
