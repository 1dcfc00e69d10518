"""Deferred weight gradients: the B / W split of zero-bubble pipelining (Qi et al. 2023, §2; DeepSeek-V3
§3.2.1 "backward for weights", Fig. 4).

A backward is split into I (gradients w.r.t. the stage *input*, needed by the previous stage now) and W
(gradients w.r.t. the *weights*, needed only by the optimizer). The schedule runs I inside
`WeightGradQueue.deferring()`; every GEMM that opts in (`deferrable_linear`, `DeferrableLinear`,
`split_weight_grads(module)`) then computes its input gradient at once and queues a closure that computes
and accumulates its weight gradient; the schedule's W op runs one I's closures later, in FIFO order.
Modules that do not opt in compute their weight gradients inside I: still correct, just no deferral.
"""
from __future__ import annotations

import contextlib
from collections import deque
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..moe import GroupedExperts

__all__ = ["WeightGradQueue", "deferrable_linear", "DeferrableLinear", "split_weight_grads", "active_queue",
           "deferrable_expert_linear", "DeferrableGroupedExperts"]

_ACTIVE: list["WeightGradQueue"] = []


def active_queue() -> "WeightGradQueue | None":
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


class _DeferrableLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None   # [..., in]

        def weight_grads():
            g_NO = grad_out.reshape(-1, grad_out.shape[-1])               # [N, out]
            x_NI = x.reshape(-1, x.shape[-1])                             # [N, in]
            gw = g_NO.t() @ x_NI                                          # [out, in]
            gb = g_NO.sum(0) if ctx.has_bias else None
            return gw, gb

        q = active_queue()
        if q is None:
            gw, gb = weight_grads()
            return grad_x, (gw if ctx.needs_input_grad[1] else None), (gb if ctx.needs_input_grad[2] else None)
        # Deferred: the closure holds the activations until W runs; parameters get .grad directly there
        # (AccumulateGrad is bypassed, so hooks registered on it do not fire for these grads).
        w_param, b_param = ctx.weight_param, ctx.bias_param

        def job():
            gw, gb = weight_grads()
            if w_param is not None and w_param.requires_grad:
                _accumulate(w_param, gw)
            if gb is not None and b_param is not None and b_param.requires_grad:
                _accumulate(b_param, gb)

        q.put(job)
        return grad_x, None, None


def deferrable_linear(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None = None) -> torch.Tensor:
    """F.linear whose weight gradient is deferred to the W op when run inside an I op. `weight` (and `bias`)
    must be leaf parameters: the deferred job writes their `.grad`."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    fn = _DeferrableLinearFn
    out = fn.apply(x, weight, bias)
    node = out.grad_fn
    node.weight_param = weight     # the ctx of a custom Function is its grad_fn node
    node.bias_param = bias
    return out


class DeferrableLinear(nn.Linear):
    """nn.Linear with the deferred weight gradient; same parameters and state_dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(x, self.weight, self.bias)


class _ExpertLinearFn(torch.autograd.Function):
    """y = x @ w_EOK[e].t() for one expert's rows; the weight gradient lands in rows e of w_EOK.grad."""

    @staticmethod
    def forward(ctx, x_NK, w_EOK, e):
        ctx.save_for_backward(x_NK, w_EOK)
        ctx.e = e
        return x_NK @ w_EOK[e].t()                                        # [N, O]

    @staticmethod
    def backward(ctx, g_NO):
        x_NK, w_EOK = ctx.saved_tensors
        e = ctx.e
        grad_x = g_NO @ w_EOK[e] if ctx.needs_input_grad[0] else None    # [N, K]
        w_param = ctx.w_param
        if w_param is not None and w_param.requires_grad:
            def job():
                gw_OK = g_NO.t() @ x_NK
                if w_param.grad is None:
                    w_param.grad = torch.zeros_like(w_param)
                w_param.grad[e] += gw_OK
            q = active_queue()
            # NOTE: the stacked expert weight gets its rows written directly (deferred or not): returning a
            # full [E, O, K] gradient per expert would cost E times the memory traffic.
            q.put(job) if q is not None else job()
        return grad_x, None, None


def deferrable_expert_linear(x_NK: torch.Tensor, w_EOK: nn.Parameter, e: int) -> torch.Tensor:
    """x @ w_EOK[e].t() with expert e's weight gradient deferrable to the W op (inside an I op)."""
    if not torch.is_grad_enabled() or not w_EOK.requires_grad:
        return x_NK @ w_EOK[e].t()
    out = _ExpertLinearFn.apply(x_NK, w_EOK, e)
    out.grad_fn.w_param = w_EOK
    return out


def _grouped_swiglu(x_NH, counts, w1_EIH, w3_EIH, w2_EHI):
    outs = []
    for e, x_e in enumerate(torch.split(x_NH, counts)):
        if counts[e] == 0:
            continue
        h = F.silu(deferrable_expert_linear(x_e, w1_EIH, e)) * deferrable_expert_linear(x_e, w3_EIH, e)
        outs.append(deferrable_expert_linear(h, w2_EHI, e))
    if not outs:
        return x_NH.new_zeros(0, w2_EHI.shape[1])
    return torch.cat(outs)


class DeferrableGroupedExperts(GroupedExperts):
    """GroupedExperts whose per-expert GEMMs defer their weight gradients (same forward math and parameters;
    the routing/sorting steps mirror `GroupedExperts.forward`)."""

    def forward(self, x_TH, topk_idx_TK, gates_TK):
        T, K = topk_idx_TK.shape
        flat_idx = topk_idx_TK.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.n_experts).tolist()
        token_of = order // K
        y_NH = _grouped_swiglu(x_TH[token_of], counts, self.gate_proj, self.up_proj, self.down_proj)
        y_NH = y_NH * gates_TK.reshape(-1)[order, None].to(y_NH.dtype)
        out_TH = torch.zeros_like(x_TH)
        return out_TH.index_add_(0, token_of, y_NH.to(x_TH.dtype))


def split_weight_grads(module: nn.Module) -> int:
    """Opt every nn.Linear and every routed-expert block (`GroupedExperts`) inside `module` into the deferred
    weight gradient (in place, by class swap: parameters, hooks and state_dict are untouched). Returns how
    many modules were converted."""
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = DeferrableLinear
            n += 1
        elif type(m) is GroupedExperts:
            m.__class__ = DeferrableGroupedExperts
            n += 1
    return n
