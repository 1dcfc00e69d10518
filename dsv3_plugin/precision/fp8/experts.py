"""The routed experts' SwiGLU in FP8 with the report's MoE memory saving (DeepSeek-V3 report §3.3.3,
"Low-Precision Storage"): the SwiGLU *inputs* (the gate and up projections' outputs) are cached in FP8 and
the SwiGLU output is recomputed from them in backward. Per expert e, on its rows X:

    g = X W1ᵀ,  u = X W3ᵀ          (FP8 Fprop, X 1×128 tiles, W 128×128 blocks)
    h = silu(g) ⊙ u                (high precision, from the exact g and u)
    Y = h W2ᵀ                      (FP8 Fprop)

Design notes: docs/design_notes.md#precision-fp8-experts
"""

from __future__ import annotations

import torch

from dsv3_plugin.model.kernels import SplitKernel, apply_split, expert_spans, stacked_params
from dsv3_plugin.precision.fp8.linear import AutoBackend, EmulatedBackend, Fp8Recipe
from dsv3_plugin.precision.fp8.quant import dequantize_tilewise, fp8_combine_grad_qdq, fp8_dispatch_qdq

__all__ = ["Fp8ExpertKernel", "Fp8GroupedSwiGLU", "fp8_expert_swiglu", "Fp8SwiGLUAct"]

_PER_EXPERT = 12  # tensors saved per expert with rows (see `_forward_one`)


def _dequant(q: torch.Tensor, s: torch.Tensor, kind: str) -> torch.Tensor:
    return dequantize_tilewise(q, s) if kind == "tile" else q.float() * s


def _t(s: torch.Tensor, kind: str) -> torch.Tensor:
    return s.t() if kind == "block" else s  # scales of Wᵀ (a tensor-wide scale is its own transpose)


def _forward_one(x, w1, w3, w2, recipe: Fp8Recipe, backend, need_wgrad: bool, keep_wq: bool = True, s=None):
    """One expert: x [n, H]; w1, w3 [I, H], w2 [H, I] -> (y [n, H], 12 saved tensors, meta). `keep_wq` False:
    the FP8 weights are not kept (the caller saves the parameters and backward re-quantizes them)."""
    qx, sx, kx = recipe.act(x)  # [n, H] 1×128 along H
    w1q, w3q, w2q = recipe.weight(w1), recipe.weight(w3), recipe.weight(w2)
    g = backend.gemm(qx, sx, kx, *w1q).to(x.dtype)  # [n, I]
    u = backend.gemm(qx, sx, kx, *w3q).to(x.dtype)
    h = torch.nn.functional.silu(g) * u
    if s is not None:
        h = h * s[:, None].to(h.dtype)  # the routing weight, before W2
    y = backend.gemm(*recipe.act(h), *w2q).to(x.dtype)  # [n, H]
    xt = recipe.act(x.t()) if need_wgrad else (None, None, None)  # Xᵀ 1×128 along tokens, shared
    gq, uq = recipe.act(g), recipe.act(u)  # the FP8 SwiGLU-input cache
    wq = (w1q[0], w1q[1], w3q[0], w3q[1], w2q[0], w2q[1]) if keep_wq else (None,) * 6
    saved = (xt[0], xt[1], gq[0], gq[1], uq[0], uq[1], *wq)
    return y, saved, (xt[2], gq[2], w1q[2])


class Fp8ExpertKernel(SplitKernel):
    """`kernels.ExpertKernel` running every expert's SwiGLU in FP8 on its slice of the stacked [E, I, H] /
    [E, H, I] master weights. With `dispatch` (config `fp8.dispatch`) the expert inputs carry the FP8
    all-to-all's numerics (pow2 1×128 quantize-dequantize) and the gradients of the expert outputs are
    quantized the same way in backward; the forward combine and the backward of the dispatch stay high
    precision (report §3.3.4). A real EP all-to-all (`pack_dispatch`) applied on top changes nothing: pow2
    re-quantization is exact."""

    def __init__(self, recipe: Fp8Recipe = Fp8Recipe(), backend=None, dispatch: bool = False):
        self.recipe, self.backend, self.dispatch = recipe, backend or EmulatedBackend(), dispatch

    row_scale = True

    def call(self, via, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N=None):
        if sum(counts) != x_NH.shape[0]:
            raise ValueError(f"Fp8ExpertKernel: counts sum to {sum(counts)} but there are {x_NH.shape[0]} rows")
        be = self.backend.resolve(x_NH.device) if isinstance(self.backend, AutoBackend) else self.backend
        if self.dispatch:
            x_NH = fp8_dispatch_qdq(x_NH)
        y_NH = apply_split(via, (list(counts), be), x_NH, w1_EIH, w3_EIH, w2_EHI, scale=scale_N)
        return fp8_combine_grad_qdq(y_NH) if self.dispatch else y_NH

    def forward(self, static, x_NH, weights, need_w):
        counts, be = static
        s_N = None
        if isinstance(x_NH, tuple):
            x_NH, s_N = x_NH
        w1_EIH, w3_EIH, w2_EHI = weights
        spans = expert_spans(counts)
        y_NH = x_NH.new_empty(x_NH.shape[0], w2_EHI.shape[1])
        saved, kinds = [], []
        # parameters do not change before backward: keep them by reference and re-quantize there (the same
        # bytes) instead of an FP8 copy of every expert's weights per micro-batch in flight
        leaf = all(w.is_leaf for w in weights)
        srcs = None if leaf else tuple(stacked_params(w) for w in weights)
        if srcs is not None and any(sp is None for sp in srcs):
            srcs = None  # built some other way: keep the FP8 blocks
        for e, s, t in spans:
            y, sv, kind = _forward_one(
                x_NH[s:t],
                w1_EIH[e],
                w3_EIH[e],
                w2_EHI[e],
                self.recipe,
                be,
                any(need_w),
                keep_wq=not (leaf or srcs),
                s=None if s_N is None else s_N[s:t],
            )
            y_NH[s:t] = y
            saved += sv
            kinds.append(kind)
        saved += [s_N] + (list(weights) if leaf else [None, None, None])
        w_meta = tuple((w.shape, w.dtype, w.device) for w in weights)
        return y_NH, tuple(saved), (spans, kinds, be, x_NH.dtype, w_meta, srcs)

    def input_grad(self, saved, meta, dy_NH, need):
        spans, kinds, be, x_dtype, _, srcs = meta
        r = self.recipe
        s_N = saved[-4]
        need_x, need_s = need[0] if s_N is not None else (need[0], False)
        dx_NH = dy_NH.new_empty(dy_NH.shape, dtype=x_dtype) if need_x else None
        ds_N = torch.zeros_like(s_N) if need_s else None
        carry = []
        for i, (e, s, t) in enumerate(spans):
            (qxt, _, qg, sg, qu, su, qw1, sw1, qw3, sw3, qw2, sw2) = saved[i * _PER_EXPERT : (i + 1) * _PER_EXPERT]
            if qw1 is None:
                ws = saved[-3:] if srcs is None else srcs  # the parameters (stacked, or one per expert)
                (qw1, sw1, _), (qw3, sw3, _), (qw2, sw2, _) = (r.weight(w[e]) for w in ws)
            _, ka, kw = kinds[i]
            g = _dequant(qg, sg, ka)  # [n, I] fp32, recomputation inputs
            u = _dequant(qu, su, ka)
            sig = torch.sigmoid(g)
            silu = g * sig
            h = silu * u  # recomputed SwiGLU output
            dy = dy_NH[s:t].float()
            dh = be.gemm(*r.act(dy), qw2.t(), _t(sw2, kw), kw)  # Dgrad W2: [n, I]
            if s_N is not None:
                s_n = s_N[s:t, None].float()
                if ds_N is not None:
                    ds_N[s:t] = (dh * h).sum(-1).to(ds_N.dtype)  # dL/ds = <dy·W2, h>
                dh = dh * s_n
                h = h * s_n  # W2's operand: s·h, as in forward
            dg = dh * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
            du = dh * silu
            if dx_NH is not None:
                dx_NH[s:t] = (
                    be.gemm(*r.act(dg), qw1.t(), _t(sw1, kw), kw) + be.gemm(*r.act(du), qw3.t(), _t(sw3, kw), kw)
                ).to(x_dtype)
            # W's FP8 operands are quantized here: a deferred W holds 1 byte per element, not 4
            have = qxt is not None
            carry.append(
                (
                    r.act(dg.t()) if have and need[1] else None,
                    r.act(du.t()) if have and need[2] else None,
                    (r.act(dy.t()), r.act(h.t())) if have and need[3] else None,
                )
            )
        return (dx_NH if s_N is None else (dx_NH, ds_N)), carry

    def weight_grads(self, saved, meta, carry, need_w):
        spans, kinds, be, _, w_meta, _ = meta
        # experts without rows get zero gradient (as the per-expert slices' autograd gives)
        dws = [torch.zeros(shape, dtype=dt, device=dev) if n else None for (shape, dt, dev), n in zip(w_meta, need_w)]
        for i, (e, s, t) in enumerate(spans):
            qxt, sxt = saved[i * _PER_EXPERT], saved[i * _PER_EXPERT + 1]
            kxt = kinds[i][0]
            dg_t, du_t, dy_h = carry[i]
            if dg_t is not None:
                dws[0][e] = be.gemm(*dg_t, qxt, sxt, kxt).to(dws[0].dtype)  # [I, H]
            if du_t is not None:
                dws[1][e] = be.gemm(*du_t, qxt, sxt, kxt).to(dws[1].dtype)
            if dy_h is not None:
                dws[2][e] = be.gemm(*dy_h[0], *dy_h[1]).to(dws[2].dtype)  # [H, I]
        return tuple(dws)

    def __repr__(self) -> str:
        return (
            f"Fp8ExpertKernel({self.recipe.kind}, pow2={self.recipe.pow2}, backend={self.backend.name}, "
            f"dispatch={self.dispatch})"
        )


Fp8GroupedSwiGLU = Fp8ExpertKernel  # the name before the kernel seam


class _Fp8SwiGLUActFn(torch.autograd.Function):
    """silu(g) ⊙ u exactly in forward; keeps g and u in FP8 (1×128 along I) and recomputes the output's
    derivatives from them in backward."""

    @staticmethod
    def forward(ctx, g, u, recipe):
        I = g.shape[-1]
        qg, sg, kg = recipe.act(g.reshape(-1, I))
        qu, su, _ = recipe.act(u.reshape(-1, I))
        ctx.save_for_backward(qg, sg, qu, su)
        ctx.kind, ctx.shape, ctx.dtypes = kg, g.shape, (g.dtype, u.dtype)
        return torch.nn.functional.silu(g) * u

    @staticmethod
    def backward(ctx, da):
        qg, sg, qu, su = ctx.saved_tensors
        g = _dequant(qg, sg, ctx.kind).view(ctx.shape)
        u = _dequant(qu, su, ctx.kind).view(ctx.shape)
        sig = torch.sigmoid(g)
        da = da.float()
        dg = da * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
        du = da * (g * sig)
        return dg.to(ctx.dtypes[0]), du.to(ctx.dtypes[1]), None


class Fp8SwiGLUAct:
    """The dense / shared-expert MLPs' activation seam (`moe.DenseMLP.act`) on the FP8 path: the SwiGLU inputs
    cached in FP8, its output recomputed in backward (report §3.3.3; forward values unchanged)."""

    def __init__(self, recipe: Fp8Recipe = Fp8Recipe()):
        self.recipe = recipe

    def __call__(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (g.requires_grad or u.requires_grad):
            return torch.nn.functional.silu(g) * u
        return _Fp8SwiGLUActFn.apply(g, u, self.recipe)

    def __repr__(self) -> str:
        return f"Fp8SwiGLUAct({self.recipe.kind}, pow2={self.recipe.pow2})"


def fp8_expert_swiglu(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, recipe: Fp8Recipe = Fp8Recipe(), backend=None
) -> torch.Tensor:
    """w2(silu(w1 x) ⊙ w3 x) for one expert's rows x [n, H]; w1, w3 [I, H], w2 [H, I]."""
    return Fp8ExpertKernel(recipe, backend)(x, [x.shape[0]], w1[None], w3[None], w2[None])
