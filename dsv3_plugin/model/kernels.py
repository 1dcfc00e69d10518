"""The kernel seams: GEMM-bearing modules (routed experts, Linear layers) call a *kernel* object for their
math, so precision (FP32/BF16 or FP8) and weight-gradient deferral (the pipeline's B/W split, DeepSeek-V3
§3.2.1) compose by wrapping kernels, not by subclassing or patching the modules.

    ExpertKernel:  kernel(x_NH, counts, w1_EIH, w3_EIH, w2_EHI[, scale_N]) -> y_NH = w2(silu(w1 x) ⊙ w3 x)
    LinearKernel:  kernel(x, weight_OK, bias_O=None) -> y = x · weightᵀ + bias      (x [..., K], y [..., O])

Every kernel is a `SplitKernel` (forward, input_grad I, weight_grads W: one autograd Function); a
`KernelWrapper` changes one part of the kernel it wraps (e.g. queues W). Modules hold theirs as `self.kernel`
(`UsesKernel`); `rebase` swaps the innermost, precision kernel and keeps the wrappers.

Design notes (row_scale, the I/W split, wrappers): docs/design_notes.md#model-kernels
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ExpertKernel",
    "LinearKernel",
    "SplitKernel",
    "KernelWrapper",
    "apply_split",
    "expert_spans",
    "stacked_params",
    "GRAD_DESTINATION",
    "grad_destination",
    "UsesKernel",
    "KernelLinear",
    "PlainLinearKernel",
    "base_kernel",
    "rebase",
    "find_wrapper",
]


class ExpertKernel(Protocol):
    def __call__(
        self,
        x_NH: torch.Tensor,
        counts: Sequence[int],
        w1_EIH: torch.Tensor,
        w3_EIH: torch.Tensor,
        w2_EHI: torch.Tensor,
        scale_N: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class LinearKernel(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def expert_spans(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows, for rows sorted by expert."""
    out, s = [], 0
    for e, n in enumerate(counts):
        if n:
            out.append((e, s, s + n))
        s += n
    return out


class SplitKernel:
    """A kernel whose backward is split into an input part (I) and a weight part (W).

    Subclasses implement `call` (the public signature: argument checks, casts, autograd ops around the core,
    then `apply_split(via, static, x, *weights)`) and the three parts the Function runs:
      forward(static, x, weights, need_w) -> (y, saved, meta)  saved: tensors (or None) kept for backward
                                                                (through save_for_backward, so saved-tensor
                                                                hooks and checkpointing see them); need_w:
                                                                per weight, whether its gradient is wanted
      input_grad(saved, meta, dy, need) -> (dx, carry)          need = (x, *weights) gradient flags; carry:
                                                                what W needs besides `saved`
      weight_grads(saved, meta, carry, need_w) -> grads          one per weight (None where not needed)
    """

    defers_weight_grads = False  # True when W does not run inside the backward (a deferral wrapper)
    row_scale = False  # an expert kernel that takes `scale_N` (the routing weights, see below)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.call(self, *args, **kwargs)

    def call(self, via: SplitKernel, *args, **kwargs) -> torch.Tensor:
        """Run this kernel's math through `via` (this kernel, or a wrapper whose parts override ours)."""
        raise NotImplementedError

    def forward(self, static: Any, x: torch.Tensor, weights: tuple, need_w: tuple[bool, ...]):
        raise NotImplementedError

    def input_grad(self, saved: tuple, meta: Any, dy: torch.Tensor, need: tuple[bool, ...]):
        raise NotImplementedError

    def weight_grads(self, saved: tuple, meta: Any, carry: Any, need_w: tuple[bool, ...]) -> tuple:
        raise NotImplementedError

    def run_weight_grads(self, job: Callable[[], tuple], weights: tuple, need_w: tuple[bool, ...]) -> tuple:
        """Called in backward with W packaged as `job`; returns the weight gradients autograd should get."""
        return job()


class KernelWrapper(SplitKernel):
    """A kernel that delegates every part to `inner`; subclasses override the part they change."""

    def __init__(self, inner: SplitKernel):
        if not isinstance(inner, SplitKernel):
            raise TypeError(
                f"{type(self).__name__}: can only wrap a SplitKernel, got {type(inner).__name__} "
                "(a kernel must expose its forward / input_grad / weight_grads parts to be wrapped)"
            )
        self.inner = inner

    @property
    def defers_weight_grads(self) -> bool:
        return self.inner.defers_weight_grads

    @property
    def row_scale(self) -> bool:
        return self.inner.row_scale

    def call(self, via, *args, **kwargs):
        return self.inner.call(via, *args, **kwargs)

    def forward(self, static, x, weights, need_w):
        return self.inner.forward(static, x, weights, need_w)

    def input_grad(self, saved, meta, dy, need):
        return self.inner.input_grad(saved, meta, dy, need)

    def weight_grads(self, saved, meta, carry, need_w):
        return self.inner.weight_grads(saved, meta, carry, need_w)

    def run_weight_grads(self, job, weights, need_w):
        return self.inner.run_weight_grads(job, weights, need_w)

    def rewrap(self, inner: SplitKernel) -> KernelWrapper:
        new = copy.copy(self)
        new.inner = inner
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


class _SplitKernelFn(torch.autograd.Function):
    """Drives a SplitKernel: forward, then in backward I at once and W through `run_weight_grads`."""

    @staticmethod
    def forward(ctx, kernel, static, need_w, x, scale, *weights):
        y, saved, meta = kernel.forward(static, x if scale is None else (x, scale), weights, need_w)
        ctx.save_for_backward(*saved)
        ctx.kernel, ctx.meta, ctx.scaled = kernel, meta, scale is not None
        ctx.weights = weights  # the tensors themselves: a deferred W writes their .grad
        return y

    @staticmethod
    def backward(ctx, dy):
        k, meta, saved = ctx.kernel, ctx.meta, ctx.saved_tensors
        need_x, need_s, *need_w = ctx.needs_input_grad[3:]
        need_w = tuple(need_w)
        dx, carry = k.input_grad(saved, meta, dy, ((need_x, need_s) if ctx.scaled else need_x, *need_w))
        dx, ds = dx if ctx.scaled else (dx, None)
        if any(need_w):
            dws = k.run_weight_grads(lambda: k.weight_grads(saved, meta, carry, need_w), ctx.weights, need_w)
        else:
            dws = (None,) * len(need_w)
        return (None, None, None, dx, ds, *dws)


# grad_fn names of a stack of parameters: torch.stack's, and pipeline.weight_grad's zero-copy stack (a view of
# parameters that lie back to back in DeepSpeed's flat ZeRO buffer)
_STACK_NODES = ("StackBackward0", "_StackedViewBackward")


# A parameter attribute a training framework may set: a callable that hands out the memory the parameter's next
# gradient should be written to (its view of a flat gradient buffer), or None when it has none to give now.
GRAD_DESTINATION = "_dsv3_grad_destination"


def grad_destination(w: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """Where a kernel may write parameter `w`'s whole gradient ([shape], `dtype`) instead of a new tensor, or None.

    Set by DeepSpeed's flat-gradient buffer (`memory.flat_grads`): when `w` has no `.grad` yet in the accumulation
    window, its view of the buffer, claimed once (a second claim in the window gets None). A kernel that returns
    the gradient in that memory lets autograd keep it as `.grad` (it takes a fresh, contiguous gradient as it is),
    so the buffer needs no copy of it. The values are the ones the kernel would have returned anyway."""
    claim = getattr(w, GRAD_DESTINATION, None)
    if claim is None or w.grad is not None:
        return None
    dest = claim()
    return dest if dest is not None and dest.shape == shape and dest.dtype == dtype else None


def stacked_params(w: torch.Tensor) -> list | None:
    """The parameters `w` was stacked from this call (`torch.stack(params)` or `weight_grad.stack_with_grad_sink`,
    DeepSpeed's per-expert layout), or None: a kernel can keep those references and slice them in backward instead
    of keeping the stack (or an FP8 copy of it)."""
    fn = None if w is None or w.is_leaf else w.grad_fn
    if fn is None or fn.name() not in _STACK_NODES:
        return None
    out = [getattr(n, "variable", None) for n, _ in fn.next_functions]
    if len(out) != w.shape[0] or any(v is None or v.shape != w.shape[1:] for v in out):
        return None
    return out


def apply_split(
    via: SplitKernel, static: Any, x: torch.Tensor, *weights: torch.Tensor | None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Run `via`'s parts as one autograd node over `x` and `weights` (None allowed, e.g. no bias).

    `scale` (expert kernels with `row_scale`): per-row factors applied inside the kernel; its forward then gets
    `(x, scale)` for x, `input_grad` gets `need[0] = (need_x, need_scale)` and returns `((dx, dscale), carry)`
    (an input gradient: computed in I, never deferred with W)."""
    grad = torch.is_grad_enabled()  # decided here: grad mode is off inside the Function's forward
    need_w = tuple(grad and w is not None and w.requires_grad for w in weights)
    return _SplitKernelFn.apply(via, static, need_w, x, scale, *weights)


def base_kernel(kernel):
    """The innermost (precision) kernel under any wrappers."""
    while isinstance(kernel, KernelWrapper):
        kernel = kernel.inner
    return kernel


def find_wrapper(kernel, cls: type) -> KernelWrapper | None:
    """The first wrapper of type `cls` around `kernel`'s base, or None."""
    while isinstance(kernel, KernelWrapper):
        if isinstance(kernel, cls):
            return kernel
        kernel = kernel.inner
    return None


def rebase(kernel, base: SplitKernel):
    """`kernel` with its innermost kernel replaced by `base` (wrappers, e.g. W deferral, kept in order)."""
    if isinstance(kernel, KernelWrapper):
        return kernel.rewrap(rebase(kernel.inner, base))
    return base


class UsesKernel:
    """Mixin: a module whose GEMMs run through `self.kernel`. `leaf_kernel_weights` says whether the weights
    it passes the kernel are its parameters themselves (a deferred W writes their `.grad`) rather than
    tensors built from them each call; `grad_sink_weights`, whether such built tensors carry a
    `deferred_grad_sink` (a callable a deferred W hands their gradient to, which adds it to the parameters they
    were built from: `pipeline.weight_grad.stack_with_grad_sink`)."""

    kernel: Any
    leaf_kernel_weights = True
    grad_sink_weights = False


# --------------------------------------------------------------------------------------------------
# Linear layers


class PlainLinearKernel(SplitKernel):
    """y = x · weightᵀ + bias in the operands' precision (FP32/BF16)."""

    def call(self, via, x, weight, bias=None):
        if not torch.is_grad_enabled() or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
            return F.linear(x, weight, bias)
        return apply_split(via, None, x, weight, bias)

    def forward(self, static, x, weights, need_w):
        weight, bias = weights
        return F.linear(x, weight, bias), (x, weight), None

    def input_grad(self, saved, meta, dy, need):
        x, weight = saved
        return (dy @ weight if need[0] else None), dy  # dx [..., K]

    def weight_grads(self, saved, meta, dy, need_w):
        x, _ = saved
        g_NO = dy.reshape(-1, dy.shape[-1])  # [N, out]
        x_NI = x.reshape(-1, x.shape[-1])  # [N, in]
        gw = g_NO.t() @ x_NI if need_w[0] else None  # [out, in]
        gb = g_NO.sum(0) if need_w[1] else None
        return gw, gb

    def __repr__(self) -> str:
        return "PlainLinearKernel()"


class KernelLinear(UsesKernel, nn.Linear):
    """nn.Linear whose GEMMs run through `self.kernel` (a LinearKernel; default `PlainLinearKernel`). Same
    parameters and state_dict keys as nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, kernel=None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.kernel = kernel if kernel is not None else PlainLinearKernel()

    @classmethod
    def from_linear(cls, lin: nn.Linear, kernel=None) -> KernelLinear:
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, kernel, device="meta")
        new.weight = lin.weight  # the same Parameter objects: optimizer state and checkpoints keep working
        new.bias = lin.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel={self.kernel!r}"
