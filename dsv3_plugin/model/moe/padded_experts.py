"""Routed experts as batched GEMMs over a padded layout: the first C of each expert's (expert-sorted) rows are
placed in an [E, C, ·] block (zeros below an expert's own rows), the rows of experts with more than C follow it
("overflow", sorted by expert). Every GEMM of the SwiGLU and of its backward is then one `torch.bmm` over all
experts plus one small GEMM per overflowing expert, instead of E small GEMMs. `GroupedSwiGLUKernel`
(`moe/layer.py`) runs its math this way where `plan` returns a plan; the kernel's interface (expert-sorted rows in
and out) is unchanged.

Why: on CPU, torch's BF16 GEMMs run on oneDNN, whose per-call cost dominates an expert's small GEMM, while one
batched call over all experts runs near the machine's BF16 rate. Measured (1 thread, AMX Xeon, 64 experts,
H = 256, N = 256 per GEMM): `bmm` over [64, 160, 256] 1.7 ms against 4.6 ms for the 64 exact-size GEMMs of 128
rows each (2.7x faster despite 25 % padding; 2.2x with 2x padding). In FP32 (MKL: small per-call cost) `bmm` was
no faster, so FP32 keeps the per-expert GEMMs (`plan` returns None).

The padding rows are zeros in x, so g = u = 0 there, silu(0)·0 = 0 and the routing weight is 0: they add exact
zeros to the weight gradients' sums and are never read back (outputs are gathered from the real rows only).
Buffers hold P = E·C + R rows (R overflow rows), so the element-wise work runs once over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Plan", "plan", "forward", "input_grad", "weight_grads", "OVERFLOW_CALL_ROWS", "OVERFLOW_ROW_COST"]

# The cost model that picks C, in units of one padded row of a batched GEMM (~0.17 µs for H = 256, I = 128 BF16,
# measured as above): an extra per-expert GEMM call costs ~25 µs before its rows (~150 padded rows' worth) and
# ~0.35 µs a row (~2 padded rows). NOTE: constants of the machine measured; elsewhere they pick a C that is not
# the fastest, never a wrong result.
OVERFLOW_CALL_ROWS = 150
OVERFLOW_ROW_COST = 2
# C is a multiple of this: oneDNN compiles (and caches) a kernel per GEMM shape, and a block height that followed the
# routing row by row would be a new shape in nearly every step and layer (a compile each); 32 rows bound the extra
# padding to < 32 per expert. (Measured on the bench model with its batch repeated, where shapes recur anyway: 1, 16,
# 32 and 64 within noise of each other.)
BLOCK_GRANULE = 32


@dataclass(frozen=True)
class Plan:
    """Where each expert-sorted row goes: `dst_N` [N] its row in the [E·C + R] buffers; `overflow` the
    (expert, first row, end row) spans of the overflow rows within those buffers (row E·C on)."""

    E: int
    C: int
    dst_N: torch.Tensor
    overflow: tuple[tuple[int, int, int], ...]

    @property
    def rows(self) -> int:
        return self.E * self.C + (self.overflow[-1][2] - self.E * self.C if self.overflow else 0)


def _cost(counts: Sequence[int], C: int) -> int:
    over = [n - C for n in counts if n > C]
    return len(counts) * C + OVERFLOW_CALL_ROWS * len(over) + OVERFLOW_ROW_COST * sum(over)


def plan(dtype: torch.dtype, counts: Sequence[int], device: torch.device, C: int | None = None) -> Plan | None:
    """The padded layout for rows `counts` (per expert), or None where the per-expert GEMMs run instead: FP32 /
    FP64 (see the module docstring), no rows, or no C cheaper than all rows as overflow (C = 0) by the cost model.
    C is the candidate (0 or an expert's row count) of least E·C + Σ over experts above C of (a GEMM call + their
    rows beyond C); `C` given: that block height, in any dtype (tests)."""
    n = sum(counts)
    if C is None:
        if dtype not in (torch.bfloat16, torch.float16) or n == 0:
            return None
        g = BLOCK_GRANULE
        C = min(sorted({0, *(-(-c // g) * g for c in counts)}), key=lambda c: (_cost(counts, c), c))
        if C == 0:
            return None
    E = len(counts)
    c_E = torch.tensor(list(counts), dtype=torch.long, device=device)
    e_N = torch.repeat_interleave(torch.arange(E, device=device), c_E)  # expert of each sorted row
    j_N = torch.arange(n, device=device) - (torch.cumsum(c_E, 0) - c_E)[e_N]  # row within its expert
    over_E = (c_E - C).clamp_min(0)
    first_over_E = torch.cumsum(over_E, 0) - over_E
    dst_N = torch.where(j_N < C, e_N * C + j_N, E * C + first_over_E[e_N] + j_N - C)
    spans, s = [], E * C
    for e, k in enumerate(counts):
        if k > C:
            spans.append((e, s, s + k - C))
            s += k - C
    return Plan(E, C, dst_N, tuple(spans))


def _scatter(rows_NX: torch.Tensor, p: Plan) -> torch.Tensor:
    """[N, X] expert-sorted rows -> [P, X] buffer rows, zeros in the padding."""
    return rows_NX.new_zeros(p.rows, rows_NX.shape[1]).index_copy_(0, p.dst_N, rows_NX)


def _block(buf_PX: torch.Tensor, p: Plan) -> torch.Tensor:
    return buf_PX[: p.E * p.C].view(p.E, p.C, buf_PX.shape[1])


def _times_w(a_PK: torch.Tensor, w_EXY: torch.Tensor, p: Plan, transpose: bool, out_PO=None) -> torch.Tensor:
    """Each row times its expert's matrix: a·w[e]ᵀ (`transpose`) or a·w[e]; into `out_PO` (added to it) if given."""
    wb = w_EXY.transpose(1, 2) if transpose else w_EXY
    blk = _block(a_PK, p)
    if out_PO is None:
        out_PO = a_PK.new_empty(p.rows, wb.shape[2])
        torch.bmm(blk, wb, out=_block(out_PO, p))
        add = False
    else:
        _block(out_PO, p).baddbmm_(blk, wb)
        add = True
    for e, s, t in p.overflow:
        if add:
            out_PO[s:t].addmm_(a_PK[s:t], wb[e])
        else:
            torch.mm(a_PK[s:t], wb[e], out=out_PO[s:t])
    return out_PO


def _wgrad(a_PX: torch.Tensor, b_PY: torch.Tensor, p: Plan, out_EXY: torch.Tensor) -> None:
    """out[e] = Σ over expert e's rows of aᵀ·b (the padding adds exact zeros)."""
    torch.bmm(_block(a_PX, p).transpose(1, 2), _block(b_PY, p), out=out_EXY)
    for e, s, t in p.overflow:
        out_EXY[e].addmm_(a_PX[s:t].t(), b_PY[s:t])


def forward(x_NH, s_N1, w1_EIH, w3_EIH, w2_EHI, p: Plan):
    """y = (s · silu(x·W1ᵀ) ⊙ x·W3ᵀ)·W2ᵀ per expert. s_N1 [N, 1] or None.

    Returns (y_NH, saved): saved = (x, g, u, silu(g), a = silu(g)·u, s) as [P, ·] buffers (s [P, 1] or None).
    """
    x_PH = _scatter(x_NH, p)
    g_PI, u_PI = _times_w(x_PH, w1_EIH, p, True), _times_w(x_PH, w3_EIH, p, True)
    silu_PI = torch.nn.functional.silu(g_PI)
    a_PI = silu_PI * u_PI
    s_P1 = None if s_N1 is None else _scatter(s_N1, p)  # 0 in the padding
    sa_PI = a_PI if s_P1 is None else a_PI * s_P1
    y_NH = _times_w(sa_PI, w2_EHI, p, True).index_select(0, p.dst_N)
    return y_NH, (x_PH, g_PI, u_PI, silu_PI, a_PI, s_P1)


def input_grad(saved, w1_EIH, w3_EIH, w2_EHI, dy_NH, p: Plan, need_x: bool, need_s: bool):
    """dL/dx [N, H] (None unless need_x), dL/ds [N] (None unless need_s), and what W needs: (dy, dL/dg, dL/du)
    as [P, ·] buffers."""
    _, g_PI, u_PI, silu_PI, a_PI, s_P1 = saved
    dy_PH = _scatter(dy_NH, p)
    da_PI = _times_w(dy_PH, w2_EHI, p, False)  # dL/d(s·a)
    ds_N = (da_PI * a_PI).sum(-1).index_select(0, p.dst_N) if need_s else None
    if s_P1 is not None:
        da_PI.mul_(s_P1)  # dL/da
    du_PI = da_PI * silu_PI
    dg_PI = torch.ops.aten.silu_backward(da_PI.mul_(u_PI), g_PI)  # silu'(g) · dL/da · u
    dx_NH = None
    if need_x:
        dx_PH = _times_w(dg_PI, w1_EIH, p, False)
        dx_NH = _times_w(du_PI, w3_EIH, p, False, out_PO=dx_PH).index_select(0, p.dst_N)
    return dx_NH, ds_N, (dy_PH, dg_PI, du_PI)


def weight_grads(saved, carry, p: Plan, dw1_EIH, dw3_EIH, dw2_EHI) -> None:
    """Write dW1 = dgᵀ·x, dW3 = duᵀ·x, dW2 = dyᵀ·(s·a) per expert into the given [E, ·, ·] tensors (None: not
    wanted). Experts without rows get exact zeros (their block rows are all padding)."""
    x_PH, _, _, _, a_PI, s_P1 = saved
    dy_PH, dg_PI, du_PI = carry
    if dw2_EHI is not None:
        _wgrad(dy_PH, a_PI if s_P1 is None else a_PI * s_P1, p, dw2_EHI)  # s·a, as in forward
    if dw1_EIH is not None:
        _wgrad(dg_PI, x_PH, p, dw1_EIH)
    if dw3_EIH is not None:
        _wgrad(du_PI, x_PH, p, dw3_EIH)
