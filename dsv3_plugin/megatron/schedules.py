"""Our pipeline schedules (DualPipeV, 1F1B) as Megatron-Core forward-backward functions.

`forward_backward_dualpipev` and `forward_backward_1f1b` have the keyword signature of the functions that
`megatron.core.pipeline_parallel.get_forward_backward_func()` returns, so Megatron's `train_step` / `evaluate` call
them unchanged (`patches/megatron_dualpipe.py` makes `get_forward_backward_func` return them), with Megatron's
conventions for `model`, `forward_step_func`, `data_iterator`, loss scaling and the returned loss dicts (on the
last pipeline rank). DualPipeV: two chunks per rank, stages r and 2P-1-r of the V (`dualpipev.py`).
Not supported (refused by the entry point): `--overlap-grad-reduce` / `--overlap-param-gather` (their no_sync /
param-sync hooks are not driven), `collect_non_loss_data`.

Design notes (each convention in detail): docs/design_notes.md#megatron-schedules
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.megatron.dualpipev import sum_embedding_copy_grads
from dsv3_plugin.parallel.pipeline.runtime import DualPipeV, OneFOneB

__all__ = ["forward_backward_dualpipev", "forward_backward_1f1b", "MegatronChunkStage", "SCHEDULE_FUNCS"]


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

    def forward(self, *inputs: torch.Tensor):
        target = self.chunk
        while not hasattr(target, "set_input_tensor") and hasattr(target, "module"):
            target = target.module  # Megatron DDP / Float16Module wrappers
        target.set_input_tensor([None] if self.is_first or not inputs else list(inputs))
        output_tensor, loss_func = self.forward_step_func(self.data_iterator, self.chunk)
        self.loss_funcs.append(loss_func)
        return output_tensor


def _pp_group(pg_collection):
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def _config_of(chunk):
    from megatron.core.utils import get_model_config

    return get_model_config(chunk)


_RUNTIMES: dict = {}


def _runtime(cls, chunks, group, config):
    key = (cls.schedule_name, tuple(id(c) for c in chunks), id(group))
    rt = _RUNTIMES.get(key)
    if rt is None:
        first = dist.get_rank(group) == 0
        # chunk 0 of pipeline rank 0 is the first stage (both schedules); DualPipeV's chunk 1 never is
        stages = [MegatronChunkStage(c, is_first=first and i == 0) for i, c in enumerate(chunks)]
        cfg = getattr(config, "dsv3_config", None)  # a config built from a dsv3 block carries its P2P limit
        timeout = float(cfg.parallel.p2p_timeout_s) if cfg is not None else 600.0
        rt = cls(stages, process_group=group, timeout_s=timeout, timeout_name="dsv3.parallel.p2p_timeout_s")
        _RUNTIMES[key] = rt
    return rt


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
    for st, it in zip(rt.modules, _iterators(data_iterator, n_chunks)):
        st.forward_step_func, st.data_iterator, st.loss_funcs = forward_step_func, it, []

    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int)
    last = rt.modules[-1]  # the chunk holding the last stage (on rt.loss_rank)

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
    finally:
        # The cached runtime outlives the step; holding Megatron's data iterator in it would keep the DataLoader's
        # workers alive to interpreter exit, where multiprocessing stops them with SIGTERM -- which
        # --exit-signal-handler makes them ignore (Megatron installs its handler in every worker), so the rank
        # hung after its last iteration.
        for st in rt.modules:
            st.forward_step_func, st.data_iterator, st.loss_funcs = None, None, []
    forward_data_store, total_tokens = _to_last_rank(
        rt, group, forward_data_store, total_tokens, mtp_metrics=not forward_only
    )
    if not forward_only:
        if config.finalize_model_grads_func is not None:
            kw = {}
            params = inspect.signature(config.finalize_model_grads_func).parameters
            if "pg_collection" in params:
                kw["pg_collection"] = pg_collection
            if "force_all_reduce" in params:
                kw["force_all_reduce"] = force_all_reduce
            config.finalize_model_grads_func(chunks, total_tokens if config.calculate_per_token_loss else None, **kw)
        sum_embedding_copy_grads(chunks)
    return forward_data_store


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


SCHEDULE_FUNCS = {"dualpipev": forward_backward_dualpipev, "1f1b": forward_backward_1f1b}


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
