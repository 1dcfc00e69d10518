"""Tiny pipeline stages and a single-process reference shared by the pipeline tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.parallel.pipeline.weight_grad import DeferrableLinear

H = 8


class MLPStage(nn.Module):
    """x + W2 tanh(W1 x); the first Linear defers its weight grad, the second does not (both paths)."""

    def __init__(self, h: int = H):
        super().__init__()
        self.fc1 = DeferrableLinear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class OverlapStage(MLPStage):
    """Same math; records that the runtime used the overlap hook (F of one chunk + B of another)."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(cls, f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads):
        cls.calls += 1
        out = f_module(*f_inputs)
        loss = f_loss_fn(out) if f_loss_fn is not None else None
        if b_loss is not None:
            b_loss.backward()
        else:
            torch.autograd.backward(b_outputs, b_grads)
        return out, loss


def criterion(out, y):
    return F.mse_loss(out, y)


def make_stages(n: int, seed: int = 0, cls=MLPStage) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [cls() for _ in range(n)]


def make_batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, H, generator=g), torch.randn(n, 3, H, generator=g)


def reference(stages, x, y, C, order=None):
    """Single process: each micro-batch through all stages (in `order`), loss.backward() per micro-batch."""
    stages = [copy.deepcopy(s) for s in stages]
    order = order or list(range(len(stages)))
    losses, outs = [], []
    for xm, ym in zip(torch.tensor_split(x, C), torch.tensor_split(y, C)):
        h = xm
        for s in order:
            h = stages[s](h)
        loss = criterion(h, ym)
        if torch.is_grad_enabled():
            loss.backward()
        losses.append(loss.detach())
        outs.append(h.detach())
    return torch.stack(losses), torch.cat(outs), stages


def grad_bound(ref_grad, n_stages: int, C: int):
    """What float32 allows between a pipeline's gradient and `reference`'s for these stages. Per micro-batch
    the ops are the same (losses are compared bit for bit); the schedule changes the order in which the C
    micro-batches' contributions (and DualPipe's two mirror copies) are summed, and that difference flows back
    through the stages. Per stage 2 forward reductions (fc1, K = H; fc2, K = 2H) and 3 backward (two dX, the
    dW sum over a micro-batch's 6 tokens), plus the MSE mean (K = 6·H) and the sum over micro-batches;
    magnitude max|ref| of the gradient."""
    from tolerance import reorder_bound

    return reorder_bound(max(6 * H, C), ref_grad.abs().max(), stages=5 * n_stages + 2)
