"""DualPipeV as a Megatron-Core forward-backward function.

`forward_backward_dualpipev` has the keyword signature of the functions that
`megatron.core.pipeline_parallel.get_forward_backward_func()` returns, so Megatron's `train_step` can call it
unchanged (`patches/megatron_dualpipe.py` makes `get_forward_backward_func` return it). It follows Megatron's
conventions:
- `model` is a list of two model chunks per pipeline rank, like interleaved (virtual) pipelining with VPP=2:
  chunk 0 is stage r and chunk 1 is stage 2P-1-r of the 2P stages (the V layout). Each chunk has
  `set_input_tensor(list)` and a `config`, and its forward uses the tensor set there on non-first stages.
- `forward_step_func(data_iterator, model_chunk)` returns `(output_tensor, loss_func)`; `loss_func(output)`
  returns `(loss, {name: tensor})` (loss divided by num_microbatches for the backward, as Megatron does) or
  `(loss, num_tokens, {...})` (divided by num_tokens unless `config.calculate_per_token_loss`).
- `data_iterator`: one iterator per chunk, or a single iterator that is duplicated (itertools.tee) so both
  chunks of the rank read the same micro-batch sequence (stage 0 reads tokens, stage 2P-1 labels).
- Returns `forward_data_store`, the list of loss dicts, on the rank holding the last stage (pipeline rank 0
  for DualPipeV), an empty list elsewhere; `config.finalize_model_grads_func` runs after the backward.
The schedule itself is `dsv3_plugin.parallel.pipeline.DualPipeV` over the pipeline group's P2P (gloo or NCCL).
"""
from __future__ import annotations

import inspect
import itertools
from typing import Iterator

import torch
from torch import nn

from dsv3_plugin.parallel.pipeline.runtime import DualPipeV

__all__ = ["forward_backward_dualpipev", "MegatronChunkStage"]


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
            target = target.module          # Megatron DDP / Float16Module wrappers
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


def forward_backward_dualpipev(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                               micro_batch_size: int, decoder_seq_length=None, forward_only: bool = False,
                               collect_non_loss_data: bool = False, first_val_step=None,
                               adjust_tensor_shapes_fn=None, p2p_communicator=None, pg_collection=None,
                               force_all_reduce: bool = False):
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != 2:
        raise ValueError(f"dualpipev: each pipeline rank needs 2 model chunks (stages r and 2P-1-r), got {len(chunks)}")
    if collect_non_loss_data:
        raise ValueError("dualpipev: collect_non_loss_data=True is not supported by this schedule")
    if isinstance(data_iterator, (list, tuple)):
        if len(data_iterator) != 2:
            raise ValueError(f"dualpipev: need one data iterator per model chunk (2), got {len(data_iterator)}")
        iters: list[Iterator | None] = list(data_iterator)
    elif data_iterator is None:
        iters = [None, None]
    else:
        iters = list(itertools.tee(data_iterator, 2))
    config = _config_of(chunks[0])
    group = _pp_group(pg_collection)
    key = (id(chunks[0]), id(chunks[1]), id(group))
    rt = _RUNTIMES.get(key)
    if rt is None:
        import torch.distributed as dist
        first = dist.get_rank(group) == 0
        stages = [MegatronChunkStage(chunks[0], is_first=first), MegatronChunkStage(chunks[1], is_first=False)]
        rt = DualPipeV(stages, process_group=group, timeout_s=float(getattr(config, "dsv3_pipeline_timeout_s", 600.0)))
        _RUNTIMES[key] = rt
    for st, it in zip(rt.modules, iters):
        st.forward_step_func, st.data_iterator, st.loss_funcs = forward_step_func, it, []

    forward_data_store: list = []
    total_tokens = torch.zeros([], dtype=torch.int)
    last = rt.modules[1]                  # chunk 1 of pipeline rank 0 is stage 2P-1

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
        return loss

    _set_aux_loss_scales(config, num_microbatches)
    if forward_only:
        with torch.no_grad():
            rt.step(num_chunks=num_microbatches, criterion=criterion)
    else:
        rt.step(num_chunks=num_microbatches, criterion=criterion)
        if config.finalize_model_grads_func is not None:
            kw = {}
            params = inspect.signature(config.finalize_model_grads_func).parameters
            if "pg_collection" in params:
                kw["pg_collection"] = pg_collection
            if "force_all_reduce" in params:
                kw["force_all_reduce"] = force_all_reduce
            config.finalize_model_grads_func(chunks, total_tokens if config.calculate_per_token_loss else None, **kw)
    return forward_data_store


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
