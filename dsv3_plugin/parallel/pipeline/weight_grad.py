"""Deferred weight gradients: the B / W split of zero-bubble pipelining (Qi et al. 2023, §2; DeepSeek-V3
§3.2.1 "backward for weights", Fig. 4).

A backward is split into I (gradients w.r.t. the stage *input*, needed by the previous stage now) and W
(gradients w.r.t. the *weights*, needed only by the optimizer). The schedule runs I inside
`WeightGradQueue.deferring()`; every GEMM that opts in then computes its input gradient at once and queues a
closure that computes and accumulates its weight gradient; the schedule's W op runs one I's closures later,
in FIFO order. Modules that do not opt in compute their weight gradients inside I (no deferral).

Opting in is a kernel wrapper (`DeferredWeightGrads`, see `model/kernels.py`) around whatever kernel a module's GEMMs
run (FP32/BF16 or FP8, Linear or routed experts), so precision and deferral compose: `split_weight_grads(module)`
wraps every kernel in a module; `DeferrableLinear` and `deferrable_linear` are the plain Linear, deferred.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from dsv3_plugin.model.kernels import (
    KernelLinear,
    KernelWrapper,
    PlainLinearKernel,
    SplitKernel,
    UsesKernel,
    find_wrapper,
)

__all__ = [
    "WeightGradQueue",
    "DeferredWeightGrads",
    "defer_weight_grads",
    "deferrable_linear",
    "DeferrableLinear",
    "split_weight_grads",
    "active_queue",
    "stack_with_grad_sink",
]

_ACTIVE: list[WeightGradQueue] = []


def active_queue() -> WeightGradQueue | None:
    """The queue collecting weight-grad work right now (inside an I op), else None."""
    return _ACTIVE[-1] if _ACTIVE else None


class WeightGradQueue:
    """FIFO of weight-gradient jobs; one job = all closures queued during one I op."""

    def __init__(self):
        self._jobs: deque[tuple[object, list[Callable[[], None]]]] = deque()
        self._collecting: list[Callable[[], None]] | None = None

    def put(self, fn: Callable[[], None]) -> None:
        assert self._collecting is not None, "put() outside deferring()"
        self._collecting.append(fn)

    @contextlib.contextmanager
    def deferring(self, tag: object = None):
        """Run a backward whose opted-in weight grads are queued as one job named `tag`."""
        self._collecting = []
        _ACTIVE.append(self)
        try:
            yield
        finally:
            _ACTIVE.pop()
            self._jobs.append((tag, self._collecting))
            self._collecting = None

    def pop(self, expect_tag: object = None) -> int:
        """Run the oldest job; returns the number of closures run."""
        if not self._jobs:
            raise RuntimeError("weight-grad queue is empty: the schedule has a W without a preceding I")
        tag, fns = self._jobs.popleft()
        if expect_tag is not None and tag != expect_tag:
            raise RuntimeError(f"weight-grad queue out of order: next job is {tag}, schedule expects {expect_tag}")
        for fn in fns:
            fn()
        return len(fns)

    def __len__(self) -> int:
        return len(self._jobs)

    def clear(self) -> None:
        self._jobs.clear()


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _accumulate_slices(params: list[torch.Tensor], grad_E: torch.Tensor) -> None:
    for e, p in enumerate(params):
        # a copy, not a view: each parameter's .grad must own its storage (optimizers flatten / free them)
        _accumulate(p, grad_E[e].clone())


class _StackedView(torch.autograd.Function):
    """torch.stack(params) for parameters that already lie back to back in one storage: the stacked tensor
    shares that storage instead of copying it. Backward is torch.stack's (the stacked gradient unbound into one
    view per parameter), so gradients are the same bit for bit."""

    @staticmethod
    def forward(ctx, *params):
        p0 = params[0]
        return p0.new_empty(0).set_(
            p0.untyped_storage(), p0.storage_offset(), (len(params), *p0.shape), (p0.numel(), *p0.stride())
        )

    @staticmethod
    def backward(ctx, grad_E):
        return grad_E.unbind(0)


def _back_to_back(params: list[torch.Tensor]) -> bool:
    """Whether `params` are contiguous tensors of one shape and dtype, one after the other in one storage (e.g.
    consecutive parameters of a DeepSpeed ZeRO flat buffer)."""
    p0 = params[0]
    if p0.device.type == "meta" or not p0.is_contiguous():
        return False
    step = p0.numel() * p0.element_size()
    base = p0.untyped_storage().data_ptr()
    return all(
        p.shape == p0.shape
        and p.dtype == p0.dtype
        and p.device == p0.device
        and p.is_contiguous()
        and p.untyped_storage().data_ptr() == base
        and p.data_ptr() == p0.data_ptr() + e * step
        for e, p in enumerate(params)
    )


def stack_with_grad_sink(params: list[nn.Parameter]) -> torch.Tensor:
    """torch.stack(params) for a kernel whose weights are stored as separate per-expert parameters (DeepSpeed's
    MoE layout). Autograd sends the stacked gradient back through the stack as usual; a deferred W cannot (it
    runs after the backward), so the result carries `deferred_grad_sink`: W hands it the stacked gradient and
    it adds slice e to `params[e].grad`, the same values the stack's backward would have accumulated.

    Where the parameters lie back to back in one storage (DeepSpeed's flat ZeRO buffer, given them in that
    order: `deepspeed.moe_layer.stacking_order`) the result is a view of it, not a copy: the copy would be saved
    for the backward of every micro-batch in flight (a pipeline holds several), each as large as this rank's
    experts of the layer."""
    w = _StackedView.apply(*params) if _back_to_back(params) else torch.stack(params)
    w.deferred_grad_sink = functools.partial(_accumulate_slices, list(params))
    return w


class DeferredWeightGrads(KernelWrapper):
    """A kernel that wraps another (`kernels.SplitKernel`: plain, FP8, ...) and defers its weight gradients:
    inside an I op (`WeightGradQueue.deferring()`) the backward computes the input gradient at once and
    queues W, which then runs the inner kernel's own weight-gradient GEMMs and adds the results to the
    parameters' `.grad`. Outside an I op it is the inner kernel. Same numbers as the inner kernel, bit for
    bit: only *when* W runs changes. A call whose weights are all frozen (requires_grad False: a LoRA base)
    queues nothing (`kernels.apply_split` asks for no weight gradient), so W holds only trainable GEMMs' work.

    NOTE: deferred gradients are written to `.grad` directly (AccumulateGrad is bypassed, so hooks
    registered on it do not fire for them); the weights must therefore be the leaf parameters themselves, or
    tensors built from them that say where their gradient goes (`stack_with_grad_sink`)."""

    defers_weight_grads = True

    def run_weight_grads(self, job, weights, need_w):
        q = active_queue()
        if q is None:
            return self.inner.run_weight_grads(job, weights, need_w)
        sinks = []
        for w, n in zip(weights, need_w):
            sink = getattr(w, "deferred_grad_sink", None) if w is not None else None
            if n and not w.is_leaf and sink is None:
                raise RuntimeError(
                    f"deferred weight gradient: a {tuple(w.shape)} weight reaching the kernel is not "
                    "a leaf tensor (built from parameters each call) and has no deferred_grad_sink "
                    "(`stack_with_grad_sink`), so W cannot write its .grad"
                )
            sinks.append(sink if sink is not None else functools.partial(_accumulate, w))
        inner = self.inner

        @torch.no_grad()  # as inside a backward: W's GEMMs build no graph (saved inputs may require grad)
        def w_job():
            for sink, g in zip(sinks, inner.run_weight_grads(job, weights, need_w)):
                if g is not None:
                    sink(g)

        q.put(w_job)
        return (None,) * len(weights)


def defer_weight_grads(kernel):
    """`kernel` wrapped in `DeferredWeightGrads` (unchanged if it already defers)."""
    return kernel if find_wrapper(kernel, DeferredWeightGrads) is not None else DeferredWeightGrads(kernel)


_DEFERRED_LINEAR = DeferredWeightGrads(PlainLinearKernel())


def deferrable_linear(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None = None) -> torch.Tensor:
    """F.linear whose weight gradient is deferred to the W op when run inside an I op. `weight` (and `bias`)
    must be leaf parameters: the deferred job writes their `.grad`."""
    return _DEFERRED_LINEAR(x, weight, bias)


class DeferrableLinear(KernelLinear):
    """nn.Linear with the deferred weight gradient (a `KernelLinear` whose kernel is the plain one wrapped in
    `DeferredWeightGrads`); same parameters and state_dict keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(
            in_features, out_features, bias, DeferredWeightGrads(PlainLinearKernel()), device=device, dtype=dtype
        )


def split_weight_grads(module: nn.Module) -> int:
    """Defer the weight gradients of every GEMM-bearing module inside `module`, in place: every module with a
    kernel seam (`kernels.UsesKernel`: routed experts, `KernelLinear`, `Fp8Linear`, ...) gets its kernel wrapped
    in `DeferredWeightGrads`, whatever its precision; a plain `nn.Linear` first gets the seam (its class becomes
    `KernelLinear`: parameters, hooks, state_dict and the object's identity are kept, which matters because
    pipeline stages share modules). An nn.Linear subclass without a seam is an error, not silently skipped.
    Returns how many modules were newly set to defer."""
    for name, m in module.named_modules():  # check everything before changing anything
        where = f"split_weight_grads: {name or type(module).__name__}"
        if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not isinstance(m, UsesKernel):
            raise TypeError(
                f"{where} is a {type(m).__name__}, an nn.Linear subclass without a kernel seam "
                "(kernels.KernelLinear): its weight gradient cannot be deferred"
            )
        if isinstance(m, UsesKernel) and not (m.leaf_kernel_weights or m.grad_sink_weights):
            raise TypeError(
                f"{where} ({type(m).__name__}) passes its kernel tensors built from its parameters "
                "without a deferred_grad_sink, so a deferred W could not write their .grad"
            )
        if isinstance(m, UsesKernel) and not isinstance(m.kernel, SplitKernel):
            raise TypeError(
                f"{where}: its kernel {m.kernel!r} is not a kernels.SplitKernel, so its weight "
                "gradients cannot be split off and deferred"
            )
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = KernelLinear
            m.kernel = PlainLinearKernel()
        if isinstance(m, UsesKernel) and find_wrapper(m.kernel, DeferredWeightGrads) is None:
            m.kernel = DeferredWeightGrads(m.kernel)
            n += 1
    return n
