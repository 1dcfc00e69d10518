"""One routed expert's SwiGLU in FP8 with the report's MoE memory saving (DeepSeek-V3 report §3.3.3,
"Low-Precision Storage"): the SwiGLU *inputs* (the gate and up projections' outputs) are cached in FP8 and
the SwiGLU output is recomputed from them in backward.

    g = X W1ᵀ,  u = X W3ᵀ          (FP8 Fprop, X 1×128 tiles, W 128×128 blocks)
    h = silu(g) ⊙ u                (high precision, from the exact g and u)
    Y = h W2ᵀ                      (FP8 Fprop)

Saved for backward (per token): Xᵀ in FP8 once for both Wgrads (1×128 along tokens), g and u in FP8
(1×128 along I), and the FP8 weights — instead of X twice, g, u, silu(g) and h in high precision.
Backward dequantizes g and u, recomputes silu(g) and h, and runs the five remaining GEMMs in FP8:
Dgrad/Wgrad of W2, Dgrad of W1 and W3 (summed into dX), Wgrad of W1 and W3.

The forward is bit-identical to three separate `fp8_linear` calls with the SwiGLU in between; gradients
differ from that by the FP8 rounding of the cached g and u.
"""
from __future__ import annotations

import torch

from .fp8 import dequantize_tilewise
from .fp8_linear import EmulatedBackend, Fp8Recipe, _wgrad_needed

__all__ = ["fp8_expert_swiglu"]


def _dequant(q: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize_tilewise(q, s) if kind == "tile" else q.float() * s


def _t(s: torch.Tensor, kind: str) -> torch.Tensor:
    return s.t() if kind == "block" else s   # scales of Wᵀ (a tensor-wide scale is its own transpose)


class _Fp8SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w3, w2, recipe: Fp8Recipe, backend, need_wgrad: bool):
        qx, sx, kx = recipe.act(x)                                   # [n, H] 1×128 along H
        w1q, w3q, w2q = recipe.weight(w1), recipe.weight(w3), recipe.weight(w2)
        g = backend.gemm(qx, sx, kx, *w1q).to(x.dtype)               # [n, I]
        u = backend.gemm(qx, sx, kx, *w3q).to(x.dtype)
        h = torch.nn.functional.silu(g) * u
        y = backend.gemm(*recipe.act(h), *w2q).to(x.dtype)           # [n, H]
        xt = recipe.act(x.t()) if need_wgrad else (None, None, None)  # Xᵀ 1×128 along tokens, shared
        gq, uq = recipe.act(g), recipe.act(u)                        # the FP8 SwiGLU-input cache
        ctx.save_for_backward(xt[0], xt[1], gq[0], gq[1], uq[0], uq[1], w1q[0], w1q[1], w3q[0], w3q[1],
                              w2q[0], w2q[1])
        ctx.meta = (recipe, backend, xt[2], gq[2], w1q[2], x.dtype, w1.dtype, g.shape[1])
        return y

    @staticmethod
    def backward(ctx, dy):
        (qxt, sxt, qg, sg, qu, su, qw1, sw1, qw3, sw3, qw2, sw2) = ctx.saved_tensors
        recipe, be, kxt, ka, kw, x_dtype, w_dtype, inter = ctx.meta
        g = _dequant(qg, sg, ka)                                     # [n, I] fp32, recomputation inputs
        u = _dequant(qu, su, ka)
        sig = torch.sigmoid(g)
        silu = g * sig
        h = silu * u                                                 # recomputed SwiGLU output
        dy = dy.float()
        dh = be.gemm(*recipe.act(dy), qw2.t(), _t(sw2, kw), kw)       # Dgrad W2: [n, I]
        dg = dh * u * (sig * (1 + g * (1 - sig)))                    # silu'(g) = σ(g)(1 + g(1 − σ(g)))
        du = dh * silu
        dx = dw1 = dw3 = dw2 = None
        if ctx.needs_input_grad[0]:
            dx = (be.gemm(*recipe.act(dg), qw1.t(), _t(sw1, kw), kw)
                  + be.gemm(*recipe.act(du), qw3.t(), _t(sw3, kw), kw)).to(x_dtype)
        if qxt is not None:
            need = ctx.needs_input_grad
            if need[1]:
                dw1 = be.gemm(*recipe.act(dg.t()), qxt, sxt, kxt).to(w_dtype)   # [I, H]
            if need[2]:
                dw3 = be.gemm(*recipe.act(du.t()), qxt, sxt, kxt).to(w_dtype)
            if need[3]:
                dw2 = be.gemm(*recipe.act(dy.t()), *recipe.act(h.t())).to(w_dtype)   # [H, I]
        return dx, dw1, dw3, dw2, None, None, None


def fp8_expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                      recipe: Fp8Recipe = Fp8Recipe(), backend=None) -> torch.Tensor:
    """w2(silu(w1 x) ⊙ w3 x) for one expert's rows x [n, H]; w1, w3 [I, H], w2 [H, I]."""
    need = _wgrad_needed(w1) or _wgrad_needed(w3) or _wgrad_needed(w2)
    return _Fp8SwiGLUFn.apply(x, w1, w3, w2, recipe, backend or EmulatedBackend(), need)
