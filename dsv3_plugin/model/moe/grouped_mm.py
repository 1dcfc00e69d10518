"""Routed-expert SwiGLU on GPU as three grouped GEMMs (`torch.nn.functional.grouped_mm`), one kernel launch per
projection for all experts instead of one `torch.mm` per expert (DeepSeekMoE, report §2.1.2).

    g = grouped_mm(x, W1ᵀ), u = grouped_mm(x, W3ᵀ)        x [Np, H] rows grouped by expert, W [E, I, H]
    y = grouped_mm(silu(g) ⊙ u, W2ᵀ)                       W2 [E, H, I]

Design notes: docs/design_notes.md#model-moe-grouped-mm
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ALIGN_ROWS", "expert_kernel", "padded_offsets", "grouped_mm_swiglu", "swiglu_magnitudes"]

ALIGN_ROWS = 16


def expert_kernel(device: torch.device, dtype: torch.dtype, hidden: int, inter: int) -> tuple[str, str]:
    """("grouped_mm" | "loop", why) for routed experts of widths H = `hidden`, I = `inter` on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return "loop", f"{device.type}: grouped_mm is a CUDA kernel"
    if not hasattr(F, "grouped_mm"):
        return "loop", f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if dtype != torch.bfloat16:
        return "loop", f"grouped_mm is documented for bfloat16 only (experts are {dtype})"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 0):
        return "loop", f"grouped_mm needs SM >= 80 (got sm{cap[0]}{cap[1]})"
    if hidden % 8 or inter % 8:
        return "loop", f"grouped_mm needs 16-byte aligned rows: H = {hidden}, I = {inter} must be multiples of 8"
    return "grouped_mm", f"torch.nn.functional.grouped_mm on sm{cap[0]}{cap[1]}"


def padded_offsets(counts: list[int], align: int = ALIGN_ROWS, device=None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Group layout with every expert's rows padded to a multiple of `align`.

    -> (offs int32 [E]: end row of each group in the padded layout, pos int64 [N]: padded row of each of the N
    input rows (grouped by expert, `counts[e]` rows for expert e), Np: padded row count)."""
    c = torch.tensor(counts, dtype=torch.int64)
    padded = (c + align - 1) // align * align  # [E]
    ends = torch.cumsum(padded, 0)
    start_pad = ends - padded  # first padded row of each group
    start_in = torch.cumsum(c, 0) - c  # first input row of each group
    n = int(c.sum())
    shift = torch.repeat_interleave(start_pad - start_in, c)  # [N]
    pos = torch.arange(n, dtype=torch.int64) + shift
    Np = int(ends[-1]) if len(counts) else 0
    return ends.to(torch.int32).to(device), pos.to(device), Np


def grouped_mm_swiglu(
    x_NH: torch.Tensor,
    counts: list[int],
    w1_EIH: torch.Tensor,
    w3_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    align: int = ALIGN_ROWS,
    scale_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `layer.grouped_swiglu` (rows sorted by expert, `counts[e]` rows for expert e; `scale_N`
    multiplies each row's SwiGLU output before W2), computed with three `grouped_mm` calls; differentiable
    through grouped_mm's autograd."""
    if sum(counts) != x_NH.shape[0]:
        raise ValueError(f"grouped_mm_swiglu: counts sum to {sum(counts)} but there are {x_NH.shape[0]} rows")
    H = x_NH.shape[1]
    if x_NH.shape[0] == 0:
        return x_NH.new_zeros(0, w2_EHI.shape[1])
    offs, pos, Np = padded_offsets(counts, align, x_NH.device)
    x_pad = x_NH.new_zeros(Np, H).index_copy(0, pos, x_NH)  # [Np, H], zero rows between groups
    g = F.grouped_mm(x_pad, w1_EIH.transpose(-2, -1), offs=offs)  # [Np, I]  (W1ᵀ: column-major view)
    u = F.grouped_mm(x_pad, w3_EIH.transpose(-2, -1), offs=offs)
    a = F.silu(g) * u
    if scale_N is not None:
        a = a * x_NH.new_zeros(Np).index_copy(0, pos, scale_N.to(x_NH.dtype))[:, None]
    y_pad = F.grouped_mm(a, w2_EHI.transpose(-2, -1), offs=offs)  # [Np, H]
    return y_pad.index_select(0, pos)


def swiglu_magnitudes(
    x_NH: torch.Tensor,
    counts: list[int],
    w1_EIH: torch.Tensor,
    w3_EIH: torch.Tensor,
    w2_EHI: torch.Tensor,
    dy_NH: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Float64 majorants of y and of the gradients (dx, dw1, dw3, dw2), for rounding-error tolerances.

    The SwiGLU with every operand replaced by its absolute value and silu(g) ⊙ u by 1.1·|g|·|u| (|silu(g)| ≤ |g|,
    |silu'(g)| ≤ 1.1): every term of every sum in y and in its gradients is at most the matching term here, so a
    kernel's rounding error is ≤ (its operations' unit roundoff × reduction length) × these, to first order."""
    xs, a1, a3, a2 = (t.detach().double().abs().requires_grad_() for t in (x_NH, w1_EIH, w3_EIH, w2_EHI))
    outs, s = [], 0
    for e, n in enumerate(counts):
        xe = xs[s : s + n]
        outs.append((1.1 * (xe @ a1[e].t()) * (xe @ a3[e].t())) @ a2[e].t())
        s += n
    y = torch.cat(outs) if outs else xs.new_zeros(0, w2_EHI.shape[1])
    (y * dy_NH.detach().double().abs()).sum().backward()
    return y.detach(), xs.grad, a1.grad, a3.grad, a2.grad
