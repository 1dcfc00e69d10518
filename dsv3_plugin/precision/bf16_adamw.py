"""AdamW with BF16 first and second moments (DeepSeek-V3 report §3.3.3: "we adopt the BF16 data format
instead of FP32 to track the first and second moments in the AdamW optimizer, without incurring observable
performance degradation"; master weights and gradients stay FP32).

Per step, for each parameter (decoupled weight decay, Loshchilov & Hutter):

    m32 = β1·float(m) + (1−β1)·g            v32 = β2·float(v) + (1−β2)·g²
    m, v ← bf16(m32), bf16(v32)               (round-to-nearest-even storage)
    θ ← θ·(1 − lr·wd) − lr · (m32 / (1−β1^t)) / (sqrt(v32 / (1−β2^t)) + eps)

Design notes: docs/design_notes.md#precision-bf16-adamw
"""

from __future__ import annotations

import torch

__all__ = ["AdamWBF16Moments", "make_optimizer"]

# Elements per slice of one update. Under ZeRO-1 the optimizer sees one flat FP32 partition holding this rank's
# whole share of the model, so the FP32 copies of the moments (8 B per element) would otherwise be materialized
# for all of it at once: at 1.2e9 parameters 9.6 GB of temporaries on top of the state. Every operation is
# elementwise and the slice length is a multiple of any SIMD width, so at one thread each element takes the same
# vector or scalar path as in one whole-tensor op (bit-identical, tested); with more threads torch's own split
# of an op's range decides that path anyway, sliced or not.
SLICE = 1 << 22


def _slices(p, *state):
    """Matching 1-D slices of `p` and its state tensors (the whole tensors when one of them is not contiguous)."""
    ts = (p, *state)
    if not all(x.is_contiguous() for x in ts) or p.numel() <= SLICE:
        return [ts]
    flat = [x.view(-1) for x in ts]
    return [tuple(x[i : i + SLICE] for x in flat) for i in range(0, p.numel(), SLICE)]


def _update(p, grad, exp_avg, exp_avg_sq, t: int, b1: float, b2: float, lr: float, eps: float, wd: float):
    """The module docstring's step on one slice (FP32 arithmetic, BF16 storage of the moments)."""
    g = grad.float()
    m32 = exp_avg.float().mul_(b1).add_(g, alpha=1 - b1)
    v32 = exp_avg_sq.float().mul_(b2).addcmul_(g, g, value=1 - b2)
    exp_avg.copy_(m32)
    exp_avg_sq.copy_(v32)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    denom = v32.div_(bc2).sqrt_().add_(eps)
    upd = m32.div_(bc1).div_(denom)
    if p.dtype == torch.float32:
        p.mul_(1 - lr * wd).add_(upd, alpha=-lr)
    else:  # low-precision parameter: do the arithmetic in FP32, round once
        p.copy_(p.float().mul_(1 - lr * wd).add_(upd, alpha=-lr))


class AdamWBF16Moments(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        moment_dtype: torch.dtype = torch.bfloat16,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(
                f"AdamWBF16Moments: invalid hyper-parameters lr={lr} betas={betas} eps={eps} "
                f"weight_decay={weight_decay}"
            )
        super().__init__(
            params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, moment_dtype=moment_dtype)
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamWBF16Moments does not support sparse gradients")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, dtype=group["moment_dtype"])
                    st["exp_avg_sq"] = torch.zeros_like(p, dtype=group["moment_dtype"])
                st["step"] += 1
                t = st["step"]
                for sl in _slices(p, p.grad, st["exp_avg"], st["exp_avg_sq"]):
                    _update(*sl, t, b1, b2, lr, eps, wd)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts loaded floating state to the parameter's dtype (FP32); BF16 -> FP32 -> BF16 is exact
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p, {})
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        st[k] = st[k].to(group["moment_dtype"])

    def state_bytes(self) -> int:
        """Bytes held by the moment tensors (the figure BF16 moments halve)."""
        return sum(
            t.numel() * t.element_size()
            for s in self.state.values()
            for k, t in s.items()
            if isinstance(t, torch.Tensor)
        )


def make_optimizer(
    params, bf16_moments: bool, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1
) -> torch.optim.Optimizer:
    """AdamW as in the paper (β = 0.9/0.95, wd 0.1); BF16 moments when `memory.bf16_moments` is on."""
    if bf16_moments:
        return AdamWBF16Moments(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
