"""Routed experts as batched GEMMs over a padded layout: the first C of each expert's (expert-sorted) rows are
placed in an [E, C, ·] block (zeros below an expert's own rows), the rows of experts with more than C follow it
("overflow", sorted by expert). Every GEMM of the SwiGLU and of its backward is then one `torch.bmm` over all
experts plus one small GEMM per overflowing expert, instead of E small GEMMs. `GroupedSwiGLUKernel`
(`moe/layer.py`) runs its math this way where `plan` returns a plan; the kernel's interface (expert-sorted rows in
and out) is unchanged.

Design notes: docs/design_notes.md#model-moe-padded-experts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Plan", "plan", "forward", "input_grad", "weight_grads", "OVERFLOW_CALL_ROWS", "OVERFLOW_ROW_COST"]

# The cost model that picks C, in units of one padded row of a batched GEMM: an extra per-expert GEMM call costs
# about 150 padded rows' worth before its rows and about 2 padded rows a row (ratios of a CPU's BF16 GEMM costs at
# H = 256, I = 128). NOTE: machine constants; elsewhere they pick a C that is not the fastest, never a wrong result.
OVERFLOW_CALL_ROWS = 150
OVERFLOW_ROW_COST = 2
# C is a multiple of this: oneDNN compiles (and caches) a kernel per GEMM shape, and a block height that followed the
# routing row by row would be a new shape in nearly every step and layer (a compile each); 32 rows bound the extra
# padding to < 32 per expert (where shapes recur anyway, granules of 1 to 64 run alike).
BLOCK_GRANULE = 32


@dataclass(frozen=True)
class Plan:
    """Where each expert-sorted row goes: `dst_N` [N] its row in the [E·C + R] buffers; `pad_rows` the block rows
    no row goes to (the padding); `overflow` the (expert, first row, end row) spans of the overflow rows within
    those buffers (row E·C on)."""

    E: int
    C: int
    dst_N: torch.Tensor
    pad_rows: torch.Tensor
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
    free = torch.ones(s, dtype=torch.bool, device=device)
    free[dst_N] = False
    return Plan(E, C, dst_N, free.nonzero().squeeze(1), tuple(spans))


def _scatter(rows_NX: torch.Tensor, p: Plan) -> torch.Tensor:
    """[N, X] expert-sorted rows -> [P, X] buffer rows, zeros in the padding (only the padding is zero-filled)."""
    out = rows_NX.new_empty(p.rows, rows_NX.shape[1]).index_copy_(0, p.dst_N, rows_NX)
    return out.index_fill_(0, p.pad_rows, 0)


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

    Returns (y_NH, saved): saved = (x, g, u, silu(g), a = silu(g)·u, s) in expert-sorted rows ([N, ·], s [N, 1] or
    None): what the per-expert GEMMs keep, so the layout changes no activation memory; the element-wise work runs
    on the N real rows, the GEMMs on the padded buffers.
    """
    x_PH = _scatter(x_NH, p)
    g_NI = _times_w(x_PH, w1_EIH, p, True).index_select(0, p.dst_N)
    u_NI = _times_w(x_PH, w3_EIH, p, True).index_select(0, p.dst_N)
    silu_NI = torch.nn.functional.silu(g_NI)
    a_NI = silu_NI * u_NI
    sa_NI = a_NI if s_N1 is None else a_NI * s_N1
    y_NH = _times_w(_scatter(sa_NI, p), w2_EHI, p, True).index_select(0, p.dst_N)
    return y_NH, (x_NH, g_NI, u_NI, silu_NI, a_NI, s_N1)


def input_grad(saved, w1_EIH, w3_EIH, w2_EHI, dy_NH, p: Plan, need_x: bool, need_s: bool):
    """dL/dx [N, H] (None unless need_x), dL/ds [N] (None unless need_s), and what W needs: (dy, dL/dg, dL/du)
    as [P, ·] buffers."""
    _, g_NI, u_NI, silu_NI, a_NI, s_N1 = saved
    dy_PH = _scatter(dy_NH, p)
    da_NI = _times_w(dy_PH, w2_EHI, p, False).index_select(0, p.dst_N)  # dL/d(s·a)
    ds_N = (da_NI * a_NI).sum(-1) if need_s else None
    if s_N1 is not None:
        da_NI.mul_(s_N1)  # dL/da
    du_PI = _scatter(da_NI * silu_NI, p)
    dg_PI = _scatter(torch.ops.aten.silu_backward(da_NI.mul_(u_NI), g_NI), p)  # silu'(g) · dL/da · u
    dx_NH = None
    if need_x:
        dx_PH = _times_w(dg_PI, w1_EIH, p, False)
        dx_NH = _times_w(du_PI, w3_EIH, p, False, out_PO=dx_PH).index_select(0, p.dst_N)
    return dx_NH, ds_N, (dy_PH, dg_PI, du_PI)


def weight_grads(saved, carry, p: Plan, dw1_EIH, dw3_EIH, dw2_EHI) -> None:
    """Write dW1 = dgᵀ·x, dW3 = duᵀ·x, dW2 = dyᵀ·(s·a) per expert into the given [E, ·, ·] tensors (None: not
    wanted). Experts without rows get exact zeros (their block rows are all padding)."""
    x_NH, _, _, _, a_NI, s_N1 = saved
    dy_PH, dg_PI, du_PI = carry
    if dw2_EHI is not None:
        _wgrad(dy_PH, _scatter(a_NI if s_N1 is None else a_NI * s_N1, p), p, dw2_EHI)  # s·a, as in forward
    if dw1_EIH is not None or dw3_EIH is not None:
        x_PH = _scatter(x_NH, p)
        if dw1_EIH is not None:
            _wgrad(dg_PI, x_PH, p, dw1_EIH)
        if dw3_EIH is not None:
            _wgrad(du_PI, x_PH, p, dw3_EIH)
