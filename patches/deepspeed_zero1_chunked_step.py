"""ZeRO-1's optimizer step without full-size temporaries (deepspeed 0.19.x, torch Adam / AdamW), the same values.

Why: DeepSpeed's ZeRO-1 (`DeepSpeedZeroOptimizer`) hands the optimizer the rank's whole FP32 partition as one
flat parameter, and takes the gradient norm by casting every parameter's gradient to a new FP64 tensor. Two kinds
of fresh full-size temporaries follow each step: torch's single-tensor Adam makes two of the partition's size
(`exp_avg_sq.sqrt()` and its division by the bias correction), and the norm one FP64 copy per gradient. Tensors
that large are new memory mappings each time (glibc serves allocations above its mmap threshold, at most 32 MB,
from fresh pages), so every element costs a page fault's share besides its arithmetic. A cProfile on one CPU rank
of the 21 M-parameter bench model: DeepSpeed's `step()` 0.29 s, of which 0.17 s Adam and 0.09 s the norm; the bare
model's AdamW over its per-parameter tensors (at most 8 MB each) 0.10 s (`python -m benchmarks model --train
[--no-chunked-step]` measures the tax with and without the patch).

How (one optimizer instance):
- Adam / AdamW: once a parameter has its state, `step` runs torch's own `step` over views of at most `CHUNK`
  elements of each parameter, its gradient and its moments (one piece at a time as the only parameter of a copy
  of its group, the step count cloned from before the step for every piece, then written back once). Adam is
  element-wise: every element gets the same operations with the same scalars as in one call over the whole
  tensor, so the same bits (tests/dist/test_zero1_chunked_step.py: `torch.equal` of losses, norms, parameters,
  masters and moments, pieces of 3,000 elements that start off the SIMD width). Temporaries are then at most
  `CHUNK` elements (4 MB in FP32), which the allocator reuses. The first step of a parameter (its state is
  created there) runs whole, as do optimizers with step hooks (they would run once per piece).
- gradient norm: DeepSpeed's `get_grad_norm_direct` (L2) with each gradient's FP64 cast written into one reused
  FP64 buffer of `SCRATCH` elements instead of a new tensor: the same values (the cast is exact), then the same
  `vector_norm` on a contiguous tensor of the same shape, so the same norm; larger gradients take DeepSpeed's own
  cast. The rest (padding and pipeline-replicated parameters skipped, model-parallel rank, the sum, the
  all-reduces, the square root, the inf/NaN -> -1 sentinel) is DeepSpeed 0.19's code, unchanged. Not applied when
  the norm was already replaced (`memory.grad_norm: fp32`, `deepspeed_zero1_flat_grads`).

Applies to DeepSpeed's ZeRO-1/2 optimizer (not its BF16_Optimizer, not CPU offload, whose Adam is DeepSpeed's C++
one) whose optimizer is a torch `Adam` or `AdamW` without `fused`, `capturable` or `differentiable` (a fused Adam
makes no temporaries); elsewhere `applies` returns the reason and DeepSpeed's own step runs. `revert(optimizer)`
restores both methods.
"""

from __future__ import annotations

import torch

__all__ = ["CHUNK", "SCRATCH", "applies", "apply", "revert"]

_ATTR = "_dsv3_chunked_step"
CHUNK = 1 << 20  # elements of a piece of the Adam update (4 MB of FP32 per temporary)
SCRATCH = 1 << 22  # elements of the reused FP64 cast buffer of the norm (32 MB); larger gradients: DeepSpeed's cast
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # torch Adam's per-element state (the last with amsgrad)


def applies(optimizer) -> tuple[bool, str]:
    """(True, how) when the patch applies to this DeepSpeed optimizer, else (False, why not)."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not deepspeed.__version__.startswith("0.19."):
        return False, f"deepspeed {deepspeed.__version__} (checked on 0.19.x)"
    if type(optimizer) is not DeepSpeedZeroOptimizer:
        return False, f"the optimizer is a {type(optimizer).__name__}, not DeepSpeed's ZeRO-1/2 optimizer"
    if optimizer.cpu_offload:
        return False, "CPU offload (DeepSpeed's own CPU Adam)"
    inner = optimizer.optimizer
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW):
        return False, f"the optimizer is a {type(inner).__name__}, not torch's Adam or AdamW"
    if _hooked(inner) is None:  # this torch's step hooks cannot be seen: pieces might run them once each
        return False, f"torch {torch.__version__}: its optimizer step hooks are not where 2.x keeps them"
    for key in ("fused", "capturable", "differentiable"):
        if any(g.get(key) for g in inner.param_groups):
            return False, f"torch Adam with {key}=True"
    return True, f"torch {type(inner).__name__} in pieces of {CHUNK} elements, the FP64 norm through one buffer"


def apply(optimizer) -> tuple[bool, str]:
    """Patch this optimizer instance (idempotent). -> (applied, how or why not)."""
    if getattr(optimizer, _ATTR, None) is not None:
        return True, "already applied"
    ok, why = applies(optimizer)
    if not ok:
        return False, why
    inner = optimizer.optimizer
    inner.step = _chunked_adam_step(inner)
    own_norm = "get_grad_norm_direct" in vars(optimizer)  # replaced already (grad_norm fp32): kept
    if not own_norm:
        optimizer.get_grad_norm_direct = _scratch_norm(optimizer)
    setattr(optimizer, _ATTR, not own_norm)
    return True, why


def revert(optimizer) -> None:
    patched = getattr(optimizer, _ATTR, None)
    if patched is None:
        return
    del optimizer.optimizer.step
    if patched:
        del optimizer.get_grad_norm_direct
    delattr(optimizer, _ATTR)


def _hooked(opt: torch.optim.Optimizer) -> bool | None:
    """Whether step hooks (the optimizer's own or torch's global ones) are registered; None where this torch keeps
    them elsewhere than torch 2.x does."""
    import torch.optim.optimizer as torch_opt

    hooks = [getattr(opt, k, None) for k in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    hooks += [getattr(torch_opt, k, None) for k in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")]
    if any(h is None for h in hooks):
        return None
    return any(bool(h) for h in hooks)


def _chunked_adam_step(opt: torch.optim.Optimizer):
    """`opt.step` over pieces of at most CHUNK elements of every parameter that has its state already."""
    whole = opt.step  # torch's bound step (with the LR scheduler's counter wrapper, if any)

    def step(closure=None):
        groups = opt.param_groups
        if (
            closure is not None
            or _hooked(opt)
            or any(p.grad is not None and not opt.state[p] for g in groups for p in g["params"])
            or all(p.numel() <= CHUNK for g in groups for p in g["params"])
        ):
            return whole(closure)
        try:
            for g in groups:
                for p in g["params"]:
                    if p.grad is None:
                        continue
                    st = opt.state[p]
                    moments = [k for k in _MOMENTS if k in st]
                    before, after = st["step"].clone(), None
                    flat = {k: st[k].view(-1) for k in moments}
                    for a in range(0, p.numel(), CHUNK):
                        piece = p.detach().view(-1)[a : a + CHUNK]  # a new leaf on p's memory
                        piece.grad = p.grad.view(-1)[a : a + CHUNK]
                        after = before.clone()  # every piece steps from the same count
                        opt.state[piece] = {"step": after, **{k: v[a : a + CHUNK] for k, v in flat.items()}}
                        opt.param_groups = [{**g, "params": [piece]}]
                        try:
                            whole()
                        finally:
                            del opt.state[piece]
                    st["step"].copy_(after)
        finally:
            opt.param_groups = groups
        return None

    return step


def _scratch_norm(optimizer):
    """DeepSpeed 0.19's `get_grad_norm_direct` (stage_1_and_2.py) for this optimizer with the FP64 casts of its
    L2 branch written into one reused buffer."""
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    deepspeeds = optimizer.get_grad_norm_direct
    buffers: dict[torch.device, torch.Tensor] = {}

    def cast(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if g.numel() > SCRATCH or not g.is_contiguous():
            return g.to(dtype)  # DeepSpeed's own
        buf = buffers.get(g.device)
        if buf is None or buf.dtype != dtype:
            buf = buffers[g.device] = torch.empty(SCRATCH, dtype=dtype, device=g.device)
        return buf[: g.numel()].view(g.shape).copy_(g)

    def get_grad_norm_direct(gradients, params, norm_type=2):
        norm_type = float(norm_type)
        if norm_type != 2.0:
            return deepspeeds(gradients, params, norm_type)
        all_norms = []
        param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
        for g, p in zip(param_gradients, params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or (optimizer.model_parallel_rank == 0):
                n = torch.linalg.vector_norm(cast(g.data, get_norm_dtype()).detach(), ord=norm_type)
                all_norms.append(n.to(get_accelerator().current_device_name()))
        if all_norms:
            total_norm = torch.stack(all_norms).pow(norm_type).sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(optimizer.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=optimizer.dp_process_group)
        optimizer._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1.0 / norm_type)
        mask_nan_or_inf_with_val_inplace(total_norm, device=optimizer.device)
        return total_norm

    return get_grad_norm_direct
