"""ZeRO-1 gradients kept in one flat buffer per parameter group (deepspeed 0.19.x, FP32 and BF16 models).

Gradients accumulate in place in a buffer with the layout of DeepSpeed's flat parameter buffer, are reduced over
the data-parallel group with DeepSpeed's arithmetic and handed to `step()` as its partition without a copy: the same
values bit for bit. Applies only where that was checked (stage 1, FP32 or BF16 gradients in the parameters' dtype,
no CPU offload, no `overlap_comm`, no expert groups, no pipeline engine); elsewhere `applies` returns the reason and
DeepSpeed's own path runs. `revert(optimizer)` restores DeepSpeed's methods.

NOTE: `apply(..., norm="fp32")` (`memory.grad_norm: fp32`) also replaces DeepSpeed's FP64 gradient norm by FP32
norms of 256-element pieces summed in FP64: the norm differs from DeepSpeed's in the last bits (a derived bound).

Design notes: docs/design_notes.md#patches-deepspeed-zero1-flat-grads
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["applies", "apply", "chunked_sq_norm", "claim", "revert"]

_ATTR = "_dsv3_flat_grads"


def applies(optimizer, pipeline: bool = False) -> tuple[bool, str]:
    """(True, how) when the patch applies to this optimizer, else (False, why not). `pipeline`: the engine is a
    pipeline engine (its reduction runs outside ZeRO's hooks: not covered)."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not deepspeed.__version__.startswith("0.19."):
        return False, f"deepspeed {deepspeed.__version__} (checked on 0.19.x)"
    if type(optimizer) is not DeepSpeedZeroOptimizer:
        return False, f"the optimizer is a {type(optimizer).__name__}, not DeepSpeed's ZeRO-1/2 optimizer"
    from deepspeed.runtime.torch_autocast import is_autocast_initialized

    dtype = optimizer.dtype
    reasons = {
        "ZeRO stage 2 (gradients partitioned)": optimizer.partition_gradients,
        f"{dtype} parameters (FP32 or BF16 only)": dtype not in (torch.float32, torch.bfloat16),
        "gradients accumulated in another dtype": getattr(optimizer, "gradient_accumulation_dtype", None) != dtype,
        "gradients communicated in another dtype": optimizer.communication_data_type != dtype,
        "torch autocast": is_autocast_initialized(),
        "sequence parallelism": optimizer.sequence_parallel_size != 1,
        "CPU offload": optimizer.cpu_offload,
        "overlap_comm": optimizer.overlap_comm,
        "expert (MoE) parameter groups": optimizer.has_moe_layers,
        "a pipeline engine": pipeline,
        "gradient accumulation in a separate attribute": optimizer.use_grad_accum_attribute,
    }
    for why, hit in reasons.items():
        if hit:
            return False, why
    for i, group in enumerate(optimizer.bit16_groups):
        flat = optimizer.bit16_groups_flat[i]
        for p in group:
            if p.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                return False, f"a parameter of group {i} is not a view of its flat buffer"
        try:  # the partition layout the step relies on (the parameter buffer stands in for the gradient one)
            _partition_group(optimizer, i, flat)
        except RuntimeError as e:
            return False, str(e)
    return True, "gradients accumulate into one flat buffer per group (no bucket, partition or flatten copies)"


def _param_views(optimizer, i: int, flat_grad: torch.Tensor) -> dict[int, torch.Tensor]:
    """id(param) -> the param's view of `flat_grad` (group i's gradient buffer, laid out like its parameters)."""
    flat = optimizer.bit16_groups_flat[i]
    views = {}
    for p in optimizer.bit16_groups[i]:
        off = p.storage_offset() - flat.storage_offset()
        views[id(p)] = flat_grad.narrow(0, off, p.numel()).view_as(p)
    return views


def _partition_group(optimizer, i: int, flat_grad: torch.Tensor):
    """DeepSpeed's pre-flattened gradient group for this rank's partition of group i: the partition (a view of
    `flat_grad`) and, in `params_in_partition` order, each parameter's piece of it (what the norm iterates)."""
    from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

    size = int(optimizer.partition_size[i])
    rank = dist.get_rank(group=optimizer.real_dp_process_group[i])
    part = flat_grad.narrow(0, rank * size, size)
    flat = optimizer.bit16_groups_flat[i]
    pieces = []
    for p in optimizer.params_in_partition[i]:
        pid = optimizer.get_param_id(p)
        src = int(optimizer.grad_start_offset[i][rank][pid])  # first element of p in this partition
        dst = int(optimizer.grad_partition_insertion_offset[i][rank][pid])  # where it sits in the partition
        n = int(min(p.numel() - src, size - dst))
        if p.storage_offset() - flat.storage_offset() + src != rank * size + dst:
            raise RuntimeError(f"group {i}: parameter {pid} is not where its ZeRO partition says")
        piece = part.narrow(0, dst, n)
        pieces.append(piece.view_as(p) if src == 0 and n == p.numel() else piece)
    return GradPartitionBufferGroup(pieces, part)


def apply(optimizer, pipeline: bool = False, norm: str = "fp64") -> tuple[bool, str]:
    """Patch this optimizer instance (idempotent). `norm`: "fp64" (DeepSpeed's gradient norm) or "fp32" (one FP32
    pass over the flat partition, see above). -> (applied, how or why not)."""
    if norm not in ("fp64", "fp32"):
        raise ValueError(f"deepspeed_zero1_flat_grads: norm must be 'fp64' or 'fp32', not {norm!r}")
    if getattr(optimizer, _ATTR, None) is not None:
        if getattr(optimizer, _ATTR)[2] != norm:
            raise ValueError(f"deepspeed_zero1_flat_grads: already applied with norm {getattr(optimizer, _ATTR)[2]}")
        return True, "already applied"
    ok, why = applies(optimizer, pipeline)
    if not ok:
        return False, why
    flat_grads = [torch.zeros_like(f) for f in optimizer.bit16_groups_flat]  # the parameters' dtype
    views = {}
    for i, fg in enumerate(flat_grads):
        views.update(_param_views(optimizer, i, fg))
    state = {"filled": set(), "claimed": set(), "reduced": False, "in_place": 0}

    def process_gradients(param, i):
        view, grad = views[id(param)], param.grad
        if grad is None:
            return
        state["reduced"] = False
        if grad.data_ptr() == view.data_ptr():
            state["in_place"] += 1  # written into the buffer by its producer (`claim`) or accumulated there
        else:
            # autograd's own tensor: the window's first gradient, or (`.grad` reset by the caller mid-window, or
            # accumulated out of place under create_graph) the whole gradient so far, as DeepSpeed's path sees it
            view.copy_(grad)
            param.grad = view  # later micro-batches accumulate in place
        state["filled"].add(id(param))

    def reduce_gradients(pipeline_parallel=False):
        if state["reduced"]:
            return
        for i, group in enumerate(optimizer.bit16_groups):
            for p in group:
                if id(p) not in state["filled"]:
                    views[id(p)].zero_()  # no gradient this window (a stale one is in the buffer)
            fg, pg = flat_grads[i], optimizer.real_dp_process_group[i]
            if dist.get_world_size(group=pg) > 1:
                if optimizer.reduce_scatter:  # DeepSpeed's average_tensor: divide, then sum
                    if optimizer.gradient_average:
                        world = dist.get_world_size(group=optimizer.dp_process_group)
                        fg.div_(world / float(optimizer.sequence_parallel_size))
                    dist.all_reduce(fg, group=pg)
                else:
                    optimizer.gradient_reduction_w_predivide(fg, fg.dtype)
            optimizer.averaged_gradients[i] = _partition_group(optimizer, i, fg)
        state["filled"].clear()
        state["claimed"].clear()
        state["reduced"] = True

    optimizer.process_gradients = process_gradients
    optimizer.reduce_gradients = reduce_gradients
    if norm == "fp32":
        optimizer.get_grad_norm_direct = _fp32_norm(optimizer)
        why += "; gradient norm in FP32 over the flat partition"
    setattr(optimizer, _ATTR, (flat_grads, state, norm, views))
    return True, why


def claim(optimizer, param) -> torch.Tensor | None:
    """The parameter's view of the flat gradient buffer, for whoever computes its gradient to write it there (the
    view then comes back as the gradient: `process_gradients` finds it in place, nothing to copy); None where the
    patch is not applied, the parameter is not in a group, it has a `.grad` this window, or the view was already
    claimed this window (two producers of one gradient in a backward would overwrite each other)."""
    patched = getattr(optimizer, _ATTR, None)
    if patched is None or param.grad is not None:
        return None
    _, state, _, views = patched
    view = views.get(id(param))
    if view is None or id(param) in state["claimed"] or id(param) in state["filled"]:
        return None
    state["claimed"].add(id(param))
    state["reduced"] = False
    return view.detach()  # a new tensor object on the view's memory: autograd may keep it as the .grad


# Elements per FP32 partial sum of `chunked_sq_norm`: its relative error is bounded by the chunk, not the partition.
NORM_CHUNK = 256


def chunked_sq_norm(flat: torch.Tensor, chunk: int = NORM_CHUNK) -> torch.Tensor:
    """Σ g² of a 1-D tensor (FP32, BF16 or FP16) as a 0-dim FP32 tensor: FP32 norms of `chunk`-element pieces,
    their squares summed in FP64, rounded to FP32 once.

    Why chunks: one FP32 `vector_norm` over a whole partition accumulates in a few running sums, whose relative
    error grows with the length (to ~1e-3 relative at tens of millions of elements, against FP64). Here each
    piece's error is at most (chunk + 1)·u (u = 2^-24: chunk − 1 additions and the squares' roundings), its
    square root and re-squaring add 2u, the FP64 sum of the pieces adds nothing visible in FP32 and the final
    rounding u: at most (chunk + 4)·u relative for any length (tests/unit/test_chunked_grad_norm.py).

    Args: flat [n] (contiguous). Returns: [] FP32.
    """
    n = flat.numel()
    whole = n - n % chunk
    sq = torch.zeros((), dtype=torch.float64, device=flat.device)
    if whole:
        pieces = torch.linalg.vector_norm(flat[:whole].view(-1, chunk), 2, dim=1, dtype=torch.float32)
        sq = sq + pieces.double().square().sum()
    if whole < n:
        sq = sq + torch.linalg.vector_norm(flat[whole:], 2, dtype=torch.float32).double().square()
    return sq.float()


def _fp32_norm(optimizer):
    """DeepSpeed's `get_grad_norm_direct` for this optimizer, the L2 norm of a flat partition taken in FP32."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.stage_1_and_2 import GradPartitionBufferGroup

    deepspeeds = optimizer.get_grad_norm_direct

    def get_grad_norm_direct(gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or not isinstance(gradients, GradPartitionBufferGroup):
            return deepspeeds(gradients, params, norm_type)
        # Every element of the partition is counted once, as DeepSpeed's per-parameter sum counts each
        # parameter's piece (alignment padding is zeros): no pipeline-replicated or tensor-parallel parameters
        # here (`applies`: no pipeline engine; the plugin has no tensor parallelism).
        total = chunked_sq_norm(gradients.flat_partition)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.sqrt()
        mask_nan_or_inf_with_val_inplace(total, device=optimizer.device)  # DeepSpeed's -1 sentinel
        return total

    return get_grad_norm_direct


def revert(optimizer) -> None:
    if getattr(optimizer, _ATTR, None) is not None:
        del optimizer.process_gradients
        del optimizer.reduce_gradients
        if getattr(optimizer, _ATTR)[2] == "fp32":
            del optimizer.get_grad_norm_direct
        delattr(optimizer, _ATTR)
