"""DeepSeekMoE FFN (paper eq. 12): h' = u + Σ_shared FFN_s(u) + Σ_routed g_i FFN_i(u).

Experts are SwiGLU, w2(silu(w1 x) ⊙ w3 x), with the released names gate_proj (w1), up_proj (w3),
down_proj (w2). Routed experts are stored stacked (`GroupedExperts`: [E, I, H] / [E, H, I]) so that the
computation is grouped: tokens are sorted by expert and each expert multiplies one contiguous slice, instead
of masking the whole batch per expert. No capacity factor and no token dropping (paper §2.1.2). The expert
math is a kernel (`kernels.ExpertKernel`) the experts call: this module's `GroupedSwiGLUKernel` by default.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import MoEConfig
from dsv3_plugin.model.kernels import (
    ExpertKernel,
    SplitKernel,
    UsesKernel,
    apply_split,
    expert_spans,
    grad_destination,
    stacked_params,
)
from dsv3_plugin.model.moe import padded_experts
from dsv3_plugin.model.moe.balancing import seq_balance_loss
from dsv3_plugin.model.moe.grouped_mm import expert_kernel, grouped_mm_swiglu
from dsv3_plugin.model.moe.router import Router

# NOTE: torch's CPU BF16 GEMMs run on oneDNN, which JIT-compiles and caches one kernel per GEMM shape (1024 by default,
# least recently used out first). The per-expert GEMMs have one shape per (rows of the expert, GEMM of the SwiGLU and
# its backward), so a few MoE layers of 64 experts need more than 1024; an LRU cache over a cyclic sequence longer
# than itself misses on every call, and every expert GEMM then compiles its kernel anew (a much slower step, the
# token ids deciding on which side of the cliff a batch falls). A user's own setting is kept; the variable is read
# when oneDNN first runs a primitive, so this takes effect where the plugin is imported before the first BF16 GEMM.
ONEDNN_CACHE_CAPACITY = 16384
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))

__all__ = [
    "ONEDNN_CACHE_CAPACITY",
    "DenseMLP",
    "GroupedExperts",
    "GroupedSwiGLUKernel",
    "DeepSeekMoE",
    "fuse_gate_up",
    "grouped_swiglu",
    "swiglu_rows",
    "combine_rows",
    "gather_rows",
    "swiglu_act",
]


def swiglu_act(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) ⊙ u: SwiGLU's activation (autograd keeps g, silu(g) and u)."""
    return F.silu(g) * u


class DenseMLP(nn.Module):
    """SwiGLU MLP: the dense FFN of the first layers and the shared experts. `act` is the activation seam:
    `swiglu_act` by default; FP8 (`convert_to_fp8`) installs one that caches its inputs in FP8 and recomputes
    the output in backward (report §3.3.3, as the routed experts do)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = swiglu_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class _CombineRows(torch.autograd.Function):
    """out[t] = Σ_{n: token_of[n] = t} y[n]: `index_add` that keeps only the index for backward (autograd's
    index_add also saves the k·H source rows, which its gradient, dy[token_of], never reads)."""

    @staticmethod
    def forward(ctx, y_NH, token_of_N, T):
        ctx.save_for_backward(token_of_N)
        return y_NH.new_zeros(T, y_NH.shape[1]).index_add_(0, token_of_N, y_NH)

    @staticmethod
    def backward(ctx, dout_TH):
        (token_of_N,) = ctx.saved_tensors
        return dout_TH.index_select(0, token_of_N), None, None


def combine_rows(y_NH: torch.Tensor, token_of_N: torch.Tensor, T: int) -> torch.Tensor:
    """Sum the rows of y_NH into T token rows (row n into token_of_N[n]); saves only the index."""
    return _CombineRows.apply(y_NH, token_of_N, T)


class _GatherRows(torch.autograd.Function):
    """x[token_of]: `index_select` whose backward is `index_add_` (autograd's backward of advanced indexing is an
    accumulating `index_put_`, which sorts the indices first: slower on CPU for the k·T rows of the experts)."""

    @staticmethod
    def forward(ctx, x_TH, token_of_N):
        ctx.save_for_backward(token_of_N)
        ctx.T = x_TH.shape[0]
        return x_TH.index_select(0, token_of_N)

    @staticmethod
    def backward(ctx, dx_NH):
        (token_of_N,) = ctx.saved_tensors
        return dx_NH.new_zeros(ctx.T, dx_NH.shape[1]).index_add_(0, token_of_N, dx_NH), None


def gather_rows(x_TH: torch.Tensor, token_of_N: torch.Tensor) -> torch.Tensor:
    """Rows token_of_N[n] of x_TH [T, H] -> [N, H] (the tokens' copies for their experts); saves only the index."""
    return _GatherRows.apply(x_TH, token_of_N)


def fuse_gate_up(dtype: torch.dtype) -> bool:
    """Whether `GroupedSwiGLUKernel` runs an expert's gate and up projections as one GEMM against [W1; W3]
    (BF16/FP16) or as two (FP32).

    NOTE: a CPU BF16 GEMM (oneDNN) has a per-call cost comparable to a small expert's arithmetic, so halving the
    number of calls pays for copying [W1; W3] next to each other; MKL's FP32 GEMMs cost far less a call, the copies
    outweigh the saving there, so FP32 keeps two GEMMs (and its sums in the order of two)."""
    return dtype in (torch.bfloat16, torch.float16)


def _pair(like: torch.Tensor, N: int, I: int, fused: bool):
    """(g, u, gu): two [N, I] buffers, views of one [N, 2I] buffer `gu` (g | u per row) when `fused`, else
    contiguous ones (gu None: FP32 keeps its element-wise passes on contiguous rows)."""
    if not fused:
        return like.new_empty(N, I), like.new_empty(N, I), None
    gu = like.new_empty(N, 2 * I)
    return gu[:, :I], gu[:, I:], gu


def _rows(pair, s: int, t: int):
    return tuple(None if b is None else b[s:t] for b in pair)


def _gate_up(x_nH, w1_IH, w3_IH, g_nI, u_nI, gu_n2I, w13_2IH):
    """g = x·W1ᵀ, u = x·W3ᵀ: one GEMM against [W1; W3] (copied into `w13_2IH`) into gu_n2I, or two (gu None)."""
    if gu_n2I is None:
        torch.mm(x_nH, w1_IH.t(), out=g_nI)
        torch.mm(x_nH, w3_IH.t(), out=u_nI)
        return
    torch.cat((w1_IH, w3_IH), out=w13_2IH)
    torch.mm(x_nH, w13_2IH.t(), out=gu_n2I)


def _gate_up_dx(dg_nI, du_nI, dgu_n2I, w1_IH, w3_IH, dx_nH, w13_2IH):
    """dx = dg·W1 + du·W3: one GEMM with K = 2I against [W1; W3] (`w13_2IH`), or two added (dgu None)."""
    if dgu_n2I is None:
        torch.mm(dg_nI, w1_IH, out=dx_nH)
        dx_nH.addmm_(du_nI, w3_IH)
        return
    torch.cat((w1_IH, w3_IH), out=w13_2IH)
    torch.mm(dgu_n2I, w13_2IH, out=dx_nH)


def _gate_up_wgrad(dg_nI, du_nI, dgu_n2I, x_nH, dw1_IH, dw3_IH, dw13_2IH):
    """dW1 = dgᵀ·x, dW3 = duᵀ·x (either may be None): one GEMM into `dw13_2IH` whose halves are copied out
    (each gradient keeps its own storage: optimizers flatten or free a .grad), or one GEMM each."""
    if dw13_2IH is None:
        if dw1_IH is not None:
            torch.mm(dg_nI.t(), x_nH, out=dw1_IH)
        if dw3_IH is not None:
            torch.mm(du_nI.t(), x_nH, out=dw3_IH)
        return
    torch.mm(dgu_n2I.t(), x_nH, out=dw13_2IH)
    dw1_IH.copy_(dw13_2IH[: dg_nI.shape[1]])
    dw3_IH.copy_(dw13_2IH[dg_nI.shape[1] :])


class GroupedSwiGLUKernel(SplitKernel):
    """The plain expert kernel (`ExpertKernel`): SwiGLU of every expert over its contiguous slice of
    expert-sorted rows, in the operands' precision (FP32/BF16), with a hand-written backward.

    Why not autograd over a Python loop: indexing `w[e]` in a loop makes autograd materialise a zero
    gradient of the *whole* [E, I, H] weight per expert (E² work: 64 experts -> 64 full-size fills and adds),
    and each slice's outputs get concatenated again. Here every GEMM writes straight into its rows of a
    preallocated output (`torch.mm(..., out=...)`), weight gradients go straight into their expert's slab,
    and the element-wise parts (SiLU, product, their derivatives) run once over all rows.

    In BF16/FP16 gate and up run as one GEMM per expert against [W1; W3] (`fuse_gate_up`; g and u then are the
    halves of one [N, 2I] buffer, their gradients likewise): forward g|u = x·[W1; W3]ᵀ, backward
    dx = [dg | du]·[W1; W3] (one GEMM with K = 2I instead of two with K = I, added) and [dW1; dW3] = [dg | du]ᵀ·x;
    the same products in wider GEMMs, only dx's sum over K is regrouped.

    In BF16/FP16 the GEMMs run batched over all experts instead where `padded_experts.plan` finds it cheaper (in
    practice nearly always): each GEMM's operand is placed in an [E, C, ·] block plus overflow rows, each product is
    one `bmm` (and a GEMM per overflowing expert); what is saved (below) stays in the N expert-sorted rows.

    Saved for backward: x [N, H]; g = x·W1ᵀ, u = x·W3ᵀ, silu(g) and a = silu(g)·u [N, I] (4·N·I floats,
    what autograd over the plain ops would keep too), the routing weights when given; the weights by reference
    (stacks of per-expert parameters: the parameters). W needs dy, dL/dg and dL/du besides (`carry`).
    """

    row_scale = True

    def call(self, via, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N=None):
        if sum(counts) != x_NH.shape[0]:
            raise ValueError(f"grouped_swiglu: counts sum to {sum(counts)} but there are {x_NH.shape[0]} rows")
        dt = torch.promote_types(x_NH.dtype, w1_EIH.dtype)
        if via is self and expert_kernel(x_NH.device, dt, w1_EIH.shape[2], w1_EIH.shape[1])[0] == "grouped_mm":
            # CUDA + BF16: three grouped GEMMs (autograd's backward, so not when a wrapper splits off W)
            return grouped_mm_swiglu(x_NH.to(dt), counts, w1_EIH.to(dt), w3_EIH.to(dt), w2_EHI.to(dt), scale_N=scale_N)
        # the weights are cast inside the Function (their gradients cast back there), so the parameters
        # themselves reach it: a deferred W writes their .grad
        return apply_split(via, list(counts), x_NH.to(dt), w1_EIH, w3_EIH, w2_EHI, scale=scale_N)

    def forward(self, counts, x_NH, weights, need_w):
        s_N = None
        if isinstance(x_NH, tuple):
            x_NH, s_N = x_NH
        dt = x_NH.dtype
        w_dtypes = tuple(w.dtype for w in weights)
        w1_EIH, w3_EIH, w2_EHI = (w.to(dt) for w in weights)
        N, I, H = x_NH.shape[0], w1_EIH.shape[1], w2_EHI.shape[1]
        x_NH = x_NH.contiguous()
        s_N1 = None if s_N is None else s_N.to(dt)[:, None]  # [N, 1] routing weight, in the GEMMs' dtype
        spans = expert_spans(counts)
        # weights stacked from per-expert parameters this call (DeepSpeed's layout) are not kept: backward
        # slices the parameters themselves (a stack per micro-batch in flight would be a copy of the experts)
        srcs = tuple(stacked_params(w) for w in weights)
        kept = tuple(None if sp is not None else w for sp, w in zip(srcs, (w1_EIH, w3_EIH, w2_EHI)))
        w_meta = tuple((w.shape, w.device) for w in (w1_EIH, w3_EIH, w2_EHI))
        # the parameters themselves (leaves only: a stack built this call is not kept): W may write their gradients
        # where a framework wants them (`grad_destination`)
        params = tuple(w if w.is_leaf else None for w in weights)
        plan = padded_experts.plan(dt, counts, x_NH.device)
        if plan is not None:  # BF16/FP16: one batched GEMM over all experts per product (`padded_experts`)
            y_NH, pad = padded_experts.forward(x_NH, s_N1, w1_EIH, w3_EIH, w2_EHI, plan)
            return y_NH, (*pad, s_N, *kept), (spans, w_dtypes, srcs, dt, w_meta, params, plan)
        fused = fuse_gate_up(dt)
        gu = _pair(x_NH, N, I, fused)  # (g, u, g|u or None)
        silu_NI, a_NI = x_NH.new_empty(N, I), x_NH.new_empty(N, I)
        y_NH = x_NH.new_empty(N, H)
        w13_2IH = x_NH.new_empty(2 * I, H) if fused else None  # one expert's [W1; W3] at a time
        # The GEMMs per expert, the element-wise work once over all rows in between: per expert it would be
        # ~4 more small ops an expert (dispatch cost ~ the arithmetic at these sizes).
        for e, s, t in spans:
            _gate_up(x_NH[s:t], w1_EIH[e], w3_EIH[e], *_rows(gu, s, t), w13_2IH)
        torch.mul(torch.ops.aten.silu.out(gu[0], out=silu_NI), gu[1], out=a_NI)
        # the routing weight, before W2 (s·a is not kept: W recomputes it)
        sa_NI = a_NI if s_N1 is None else a_NI * s_N1
        for e, s, t in spans:
            torch.mm(sa_NI[s:t], w2_EHI[e].t(), out=y_NH[s:t])
        return y_NH, (x_NH, *gu, silu_NI, a_NI, s_N, *kept), (spans, w_dtypes, srcs, dt, w_meta, params, None)

    @staticmethod
    def _expert_w(saved_w, src, e, dt):
        return saved_w[e] if saved_w is not None else src[e].to(dt)

    @staticmethod
    def _all_w(saved_w, src, dt):
        return saved_w if saved_w is not None else torch.stack([p.to(dt) for p in src])

    def input_grad(self, saved, meta, dy_NH, need):
        if meta[6] is not None:  # the padded layout (forward)
            *pad, s_N, w1, w3, w2 = saved
            _, _, srcs, wdt, _, _, plan = meta
            need_x, need_s = need[0] if s_N is not None else (need[0], False)
            ws = (self._all_w(w, sp, wdt) for w, sp in zip((w1, w3, w2), srcs))
            dx, ds_N, carry = padded_experts.input_grad(pad, *ws, dy_NH.contiguous(), plan, need_x, need_s)
            ds_N = None if ds_N is None else ds_N.to(s_N.dtype)
            return (dx if s_N is None else (dx, ds_N)), carry
        x_NH, g_NI, u_NI, gu_N2I, silu_NI, a_NI, s_N, w1_EIH, w3_EIH, w2_EHI = saved
        spans, _, srcs, wdt, _, _, _ = meta
        W = self._expert_w
        N, I = silu_NI.shape
        fused = gu_N2I is not None
        need_x, need_s = need[0] if s_N is not None else (need[0], False)
        dy_NH = dy_NH.contiguous()
        s_N1 = None if s_N is None else s_N.to(wdt)[:, None]
        dgu = _pair(x_NH, N, I, fused)  # (dL/dg, dL/du, both or None), laid out as (g, u)
        da_NI = torch.empty_like(a_NI)
        w13_2IH = x_NH.new_empty(2 * I, x_NH.shape[1]) if need_x and fused else None
        dx = torch.empty_like(x_NH) if need_x else None
        for e, s, t in spans:
            torch.mm(dy_NH[s:t], W(w2_EHI, srcs[2], e, wdt), out=da_NI[s:t])  # dL/d(s·a) = dy·W2
        # element-wise over all rows (see forward)
        ds_N = (da_NI * a_NI).sum(-1).to(s_N.dtype) if need_s else None  # dL/ds = <dy·W2, a>
        if s_N1 is not None:
            da_NI.mul_(s_N1)  # dL/da
        dg_NI, du_NI, _ = dgu
        torch.mul(da_NI, silu_NI, out=du_NI)  # dL/du
        # dL/dg = silu'(g) · (dL/da · u), one fused pass
        torch.ops.aten.silu_backward.grad_input(da_NI.mul_(u_NI), g_NI, grad_input=dg_NI)
        if dx is not None:
            for e, s, t in spans:
                w1_e, w3_e = W(w1_EIH, srcs[0], e, wdt), W(w3_EIH, srcs[1], e, wdt)
                _gate_up_dx(*_rows(dgu, s, t), w1_e, w3_e, dx[s:t], w13_2IH)
        return (dx if s_N is None else (dx, ds_N)), (dy_NH, *dgu)

    def weight_grads(self, saved, meta, carry, need_w):
        spans, w_dtypes, _, wdt, w_meta, params, plan = meta
        hit = [e for e, _, _ in spans]

        def zero_missed(gw):  # experts that got no rows have zero gradient
            if gw is not None and len(hit) < gw.shape[0]:
                miss = torch.ones(gw.shape[0], dtype=torch.bool, device=gw.device)
                miss[hit] = False
                gw[miss] = 0
            return gw

        def new_grad(p, shape_dev, need, w_dtype):
            if not need:
                return None
            shape, dev = shape_dev
            # returned as is (no cast after it) into the parameter's .grad
            dest = grad_destination(p, shape, wdt) if p is not None and w_dtype == wdt else None
            out = dest if dest is not None else torch.empty(shape, dtype=wdt, device=dev)
            # the padded layout's batched GEMMs write every expert, zeros where it had no rows
            return out if plan is not None else zero_missed(out)

        dw1, dw3, dw2 = (new_grad(*a) for a in zip(params, w_meta, need_w, w_dtypes))
        if plan is not None:
            padded_experts.weight_grads(saved[:6], carry, plan, dw1, dw3, dw2)
            return tuple(None if g is None else g.to(dt) for g, dt in zip((dw1, dw3, dw2), w_dtypes))
        x_NH, _, _, _, _, a_NI, s_N, _, _, _ = saved
        s_N1 = None if s_N is None else s_N.to(wdt)[:, None]
        dy_NH, *dgu = carry
        I = a_NI.shape[1]
        fused = dgu[2] is not None and dw1 is not None and dw3 is not None
        dw13_2IH = x_NH.new_empty(2 * I, x_NH.shape[1]) if fused else None
        sa_NI = a_NI if dw2 is None or s_N1 is None else a_NI * s_N1  # s·a, as in forward
        for e, s, t in spans:
            if dw2 is not None:
                torch.mm(dy_NH[s:t].t(), sa_NI[s:t], out=dw2[e])  # [H, I]
            if dw1 is not None or dw3 is not None:
                dw1_e, dw3_e = (None if g is None else g[e] for g in (dw1, dw3))
                _gate_up_wgrad(*_rows(dgu, s, t), x_NH[s:t], dw1_e, dw3_e, dw13_2IH)
        return tuple(None if g is None else g.to(dt) for g, dt in zip((dw1, dw3, dw2), w_dtypes))

    def __repr__(self) -> str:
        return "GroupedSwiGLUKernel()"


def grouped_swiglu(
    x_NH: torch.Tensor, counts: list[int], w1_EIH: torch.Tensor, w3_EIH: torch.Tensor, w2_EHI: torch.Tensor
) -> torch.Tensor:
    """SwiGLU per expert over rows already sorted by expert; `counts[e]` rows belong to expert e
    (`GroupedSwiGLUKernel`, the default expert kernel; on CUDA with BF16 experts it runs
    `grouped_mm.grouped_mm_swiglu`)."""
    return _GROUPED(x_NH, counts, w1_EIH, w3_EIH, w2_EHI)


_GROUPED = GroupedSwiGLUKernel()


class GroupedExperts(UsesKernel, nn.Module):
    """The routed experts of one layer, stacked. Released per-expert keys
    `mlp.experts.{e}.{gate,up,down}_proj.weight` map to rows e of these tensors.
    Their math is `self.kernel` (an `ExpertKernel`; default `GroupedSwiGLUKernel`): precision (FP8) and
    weight-gradient deferral are kernels set or wrapped there (`model/kernels.py`)."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int, kernel: ExpertKernel = None):
        super().__init__()
        self.n_experts = n_experts
        self.kernel = kernel if kernel is not None else GroupedSwiGLUKernel()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.006)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
        T, K = topk_idx_TK.shape
        flat_idx = topk_idx_TK.reshape(-1)  # [T*K] expert of each (token, slot)
        order = torch.argsort(flat_idx, stable=True)  # group the (token, slot) pairs by expert
        counts = torch.bincount(flat_idx, minlength=self.n_experts).tolist()
        token_of = order // K  # source token of each sorted row
        gates_N = gates_TK.reshape(-1).index_select(0, order)
        x_NH = gather_rows(x_TH, token_of)
        if getattr(self.kernel, "row_scale", False):
            # the routing weight scales the SwiGLU output before W2: the k·H expert outputs per token are
            # not kept for the gate's gradient (it comes from the SwiGLU output the kernel keeps anyway)
            y_NH = self.kernel(x_NH, counts, self.gate_proj, self.up_proj, self.down_proj, scale_N=gates_N)
        else:
            y_NH = self.kernel(x_NH, counts, self.gate_proj, self.up_proj, self.down_proj)
            y_NH = y_NH * gates_N[:, None].to(y_NH.dtype)
        return combine_rows(y_NH.to(x_TH.dtype), token_of, T)

    def expert_rows(
        self, x_NH: torch.Tensor, expert_N: torch.Tensor, scale_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SwiGLU of expert `expert_N[n]` on row n, in input row order (what expert-parallel dispatch hands to
        the experts a rank owns), times `scale_N[n]` when given (applied before the down projection)."""
        return swiglu_rows(x_NH, expert_N, self.gate_proj, self.up_proj, self.down_proj, self.kernel, scale_N)


def _run_scaled(kernel, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N):
    if scale_N is None:
        return kernel(x_NH, counts, w1_EIH, w3_EIH, w2_EHI)
    if getattr(kernel, "row_scale", False):
        return kernel(x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N=scale_N)
    y_NH = kernel(x_NH, counts, w1_EIH, w3_EIH, w2_EHI)
    return y_NH * scale_N[:, None].to(y_NH.dtype)


def swiglu_rows(
    x_NH: torch.Tensor,
    expert_N: torch.Tensor,
    w1_EIH: torch.Tensor,
    w3_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    kernel: ExpertKernel = grouped_swiglu,
    scale_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """SwiGLU of expert `expert_N[n]` on row n (times `scale_N[n]`, inside the kernel when it has `row_scale`),
    rows in any order: sort by expert, grouped GEMMs (`kernel`), unsort."""
    counts = torch.bincount(expert_N, minlength=w1_EIH.shape[0]).tolist()
    if expert_N.numel() < 2 or bool((expert_N[1:] >= expert_N[:-1]).all()):
        # already grouped (EP = 1, one source rank)
        return _run_scaled(kernel, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N)
    order = torch.argsort(expert_N, stable=True)
    y_sorted = _run_scaled(
        kernel, x_NH[order], counts, w1_EIH, w3_EIH, w2_EHI, None if scale_N is None else scale_N[order]
    )
    return torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)


class DeepSeekMoE(nn.Module):
    """Router + routed experts + shared experts. After a forward in training, `aux_loss` holds the
    sequence-wise balance loss α·L_Bal (a tensor in the graph; 0-dim zero when α = 0)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(hidden_size, cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, hidden_size, cfg.intermediate_size)
        self.shared_experts = (
            DenseMLP(hidden_size, cfg.intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        )
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BTH: torch.Tensor, token_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. `token_mask_BT` [B, T] bool: False at padding, which is computed (static
        shapes) but left out of the router's loads and the balance loss's statistics."""
        B, T, H = x_BTH.shape
        x_TH = x_BTH.reshape(-1, H)
        if token_mask_BT is None:
            r = self.gate(x_TH)
        else:
            r = self.gate(x_TH, token_mask_BT.reshape(-1))
        if self.training and self.cfg.seq_aux_alpha > 0:
            self.aux_loss = seq_balance_loss(
                r.scores_TE.view(B, T, -1), self.cfg.top_k, self.cfg.seq_aux_alpha, token_mask_BT
            )
        else:
            self.aux_loss = None
        shared: list[torch.Tensor] = []
        side = None if self.shared_experts is None else (lambda: shared.append(self.shared_experts(x_TH)))
        y_TH = self.routed(x_TH, r, side)
        if shared:
            y_TH = y_TH + shared[0]
        return y_TH.view(B, T, H)

    def routed(self, x_TH: torch.Tensor, r, side=None) -> torch.Tensor:
        """Σ_k g_{t,k} FFN_{e_{t,k}}(x_t) over the routed experts; calls `side()` (the shared experts) once,
        here after the routed experts. Expert parallelism overrides this and runs `side()` while the routed
        tokens travel (paper §3.2.1)."""
        y_TH = self.experts(x_TH, r.topk_idx_TK, r.gates_TK)
        if side is not None:
            side()
        return y_TH
