"""Fine-grained FP8 quantization (DeepSeek-V3 report §3.3, App. B; reference kernels `act_quant`,
`weight_quant`/`weight_dequant`, `fp8_gemm` of the released inference code).

`dsv3_plugin.precision.fp8.linear` builds the FP8 Linear (Fprop/Dgrad/Wgrad) and the model conversion on top of this.

Design notes: docs/design_notes.md#precision-fp8-quant
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "AMAX_EPS",
    "TILE",
    "ceil_pow2",
    "scale_from_amax",
    "quantize_tilewise",
    "dequantize_tilewise",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_tensorwise",
    "truncate_mantissa",
    "fp8_gemm_emulated",
    "widen_fp8",
    "fp8_grouped_gemm_emulated",
    "lowprec_gemm",
    "quantize_dispatch",
    "dequantize_dispatch",
    "pack_dispatch",
    "unpack_dispatch",
    "fp8_dispatch_qdq",
    "fp8_combine_grad_qdq",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 (fn) value
AMAX_EPS = 1e-4  # amax clamp of the reference `act_quant`: an all-zero tile gets s = 1e-4/448, not 0
TILE = 128  # N_C: group size along K and the promotion interval


def ceil_pow2(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= s`` for positive fp32 ``s`` in [2^-126, 2^127], computed exactly from the
    bits (ue8m0 rounding up: biased exponent, plus one if any mantissa bit is set).

    NOTE: not ``exp2(ceil(log2(s)))``: float32 ``log2`` of a value a few ulps above 2^k rounds to exactly k,
    which would round the scale *down* and clamp the group's largest element. Same rule as DeepGEMM's
    ``ceil_to_ue8m0`` and TE's power-of-2 scales (TE masks the mantissa of 448/amax, i.e. rounds the encode
    scale down). +Inf stays +Inf; callers handle NaN (its bits would not give a power of two).
    """
    bits = s.float().contiguous().view(torch.int32)  # sign bit 0 for s > 0
    exp = (bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # biased exponent of the ceiling
    return (exp << 23).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """Decode scale of a group from its max-abs: ``max(amax, 1e-4) / 448`` in fp32, or its power-of-2
    ceiling (ue8m0, `ceil_pow2`) so that re-tiling and dequantization are exact multiplications by 2^k.

    Every quantizer here, the FP8 dispatch payload included, takes its scales from this one function.
    With ``pow2`` the scale ``s`` satisfies ``s >= max(amax, 1e-4)/448 > s/2`` exactly, so ``amax / s <= 448``
    and the group's largest element is never clamped.

    * amax = 0 (an all-zero group): clamped to 1e-4, a finite scale (1e-4/448, or 2^-22 with ``pow2``).
    * amax = Inf or NaN (the group holds an Inf or a NaN): the scale is NaN, so the whole group dequantizes
      to NaN and the non-finite input reaches the GEMM output, the loss and the gradients, where a training
      loop's overflow check sees it. NOTE: TE's kernels use scale 1 for such a group instead; we do not
      saturate an Inf to ±448·s, which would train on a silently clipped value.
    """
    a = amax.float()
    s = a.clamp(min=AMAX_EPS) / FP8_MAX  # in [2.2e-7, 7.6e35]: a normal fp32, so ceil_pow2 is exact
    if pow2:
        s = ceil_pow2(s)
    return torch.where(torch.isfinite(a), s, torch.full_like(s, float("nan")))


def _to_fp8(y32: torch.Tensor) -> torch.Tensor:
    """`y32` is a fresh temporary (x / s), clamped in place. |x/s| <= 448 up to one fp32 rounding; saturate
    like the GPU's satfinite conversion, then round-to-nearest-even into E4M3."""
    return y32.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _amax(x: torch.Tensor, dims) -> torch.Tensor:
    # max|x| without materialising |x| (one less full-size temporary)
    return torch.maximum(x.amax(dim=dims), x.amin(dim=dims).neg())


def quantize_tilewise(x: torch.Tensor, tile: int = TILE, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """1×`tile` groups along the last dim. x [..., K] -> (fp8 [..., K], fp32 scales [..., ceil(K/tile)])."""
    if x.dim() == 0:
        raise ValueError("quantize_tilewise: needs at least one dimension")
    K = x.shape[-1]
    Kc = math.ceil(K / tile)
    x32 = x.float()
    if Kc * tile != K:
        x32 = F.pad(x32, (0, Kc * tile - K))  # zeros never raise a tile's amax
    xt = x32.reshape(*x.shape[:-1], Kc, tile)
    s = scale_from_amax(_amax(xt, -1), pow2)  # [..., Kc]
    q = _to_fp8(xt / s.unsqueeze(-1)).reshape(*x.shape[:-1], Kc * tile)
    if Kc * tile != K:
        q = q[..., :K].contiguous()
    return q, s


def dequantize_tilewise(
    q: torch.Tensor, s: torch.Tensor, tile: int = TILE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_tilewise`: q [..., K] · s[..., k // tile]."""
    K = q.shape[-1]
    s_full = s.float().repeat_interleave(tile, dim=-1)[..., :K]
    return (q.float() * s_full).to(dtype)


def quantize_blockwise(w: torch.Tensor, block: int = TILE, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`block`×`block` groups of a 2-D weight [N, K] (out, in) -> (fp8 [N, K], scale_inv [ceil(N/b), ceil(K/b)]),
    the released checkpoints' `weight` / `weight_scale_inv` pair (ragged edge blocks, e.g. 576 rows)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise: expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    N, K = w.shape
    Nc, Kc = math.ceil(N / block), math.ceil(K / block)
    w32 = w.float()
    if (Nc * block, Kc * block) != (N, K):
        w32 = F.pad(w32, (0, Kc * block - K, 0, Nc * block - N))
    wb = w32.reshape(Nc, block, Kc, block)
    s = scale_from_amax(_amax(wb, (1, 3)), pow2)  # [Nc, Kc]
    q = _to_fp8(wb / s[:, None, :, None]).reshape(Nc * block, Kc * block)
    if (Nc * block, Kc * block) != (N, K):
        q = q[:N, :K].contiguous()
    return q, s


def dequantize_blockwise(
    q: torch.Tensor, s: torch.Tensor, block: int = TILE, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`weight_dequant`: y[i, j] = float(q[i, j]) · s[i // block, j // block]."""
    N, K = q.shape
    s_full = s.float().repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return (q.float() * s_full).to(dtype)


def quantize_tensorwise(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor (online "current" scaling) — the baseline the fine-grained recipe beats."""
    s = scale_from_amax(x.detach().abs().amax(), pow2)  # 0-dim
    return _to_fp8(x.float() / s), s


# --------------------------------------------------------------------------------------------------
# GEMM emulation


def truncate_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Round fp32 `x` toward zero to `bits` explicit mantissa bits (a limited-width accumulator)."""
    if not 0 <= bits <= 23:
        raise ValueError(f"truncate_mantissa: bits must be in [0, 23], got {bits}")
    mask = -(1 << (23 - bits))  # ones in sign, exponent and the top `bits` mantissa bits (two's complement)
    return (x.float().contiguous().view(torch.int32) & mask).view(torch.float32)


def lowprec_gemm(
    a: torch.Tensor, b: torch.Tensor, mantissa_bits: int, promote_every: int | None = None
) -> torch.Tensor:
    """a [M, K] @ b [N, K]ᵀ with a `mantissa_bits`-wide running sum, promoted into an FP32 accumulator every
    `promote_every` elements of K (None: never, i.e. one low-precision accumulation over the whole K)."""
    a32, b32 = a.float(), b.float()
    M, K = a32.shape
    out = torch.zeros(M, b32.shape[0], dtype=torch.float32, device=a.device)
    acc = torch.zeros_like(out)
    for k in range(K):
        acc = truncate_mantissa(acc + a32[:, k, None] * b32[None, :, k], mantissa_bits)
        if promote_every and (k + 1) % promote_every == 0:
            out += acc
            acc.zero_()
    return out + acc


def _rows_chunks(s: torch.Tensor, rows: int, Kc: int, kind: str, block: int) -> torch.Tensor:
    """Any operand scale -> one scale per (row, K-chunk): [rows, Kc]."""
    if kind == "tile":  # [rows, Kc]
        return s.float()
    if kind == "block":  # [ceil(rows/block), Kc]
        return s.float().repeat_interleave(block, 0)[:rows]
    if kind == "tensor":  # scalar
        return s.float().reshape(1, 1).expand(rows, Kc)
    raise ValueError(f"unknown scale kind {kind!r}")


_WIDE: dict = {}  # device -> the 256 E4M3 codes' FP32 values


def widen_fp8(q: torch.Tensor) -> torch.Tensor:
    """The FP32 values of E4M3 `q` (any layout; NaN codes give NaN), bit for bit `q.float()`: a lookup in the 256
    codes' values, several times cheaper on CPU than torch's elementwise conversion. Contiguous `q` (or its
    transpose) keeps its layout; other strides go through `q.float()`."""
    if q.dtype != FP8_DTYPE:
        return q.float()
    if q.dim() == 2 and not q.is_contiguous() and q.t().is_contiguous():
        return widen_fp8(q.t()).t()
    if not q.is_contiguous():
        return q.float()
    table = _WIDE.get(q.device)
    if table is None:
        table = _WIDE[q.device] = torch.arange(256, dtype=torch.uint8, device=q.device).view(FP8_DTYPE).float()
    return table.index_select(0, q.view(torch.uint8).reshape(-1).int()).view(q.shape)


def fp8_gemm_emulated(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    a_kind: str = "tile",
    b_kind: str = "block",
    tile: int = TILE,
    acc_mantissa_bits: int | None = None,
) -> torch.Tensor:
    """out[M, N] = Σ_chunks (a_q[:, c] · b_q[:, c]ᵀ) · a_s[:, c] · b_s[:, c] in FP32 (K contracted, b is [N, K]).

    Each 128-chunk's partial sum is computed from the exact FP8 values (products of two E4M3 numbers are
    exact in FP32) and promoted into the FP32 accumulator with its two scales, in chunk order, as the
    reference `fp8_gemm` does. `acc_mantissa_bits` (e.g. 13 for H800's ~14-bit accumulation) truncates
    the running sum inside each chunk to model the tensor cores; None keeps FP32 inside the chunk.
    Kinds: "tile" (scale per row per chunk), "block" (128×128), "tensor" (one scale). `a_q` / `b_q` may also be
    FP32 tensors holding E4M3 values (`widen_fp8` of the codes, done once by a caller that slices them): same result.
    """
    M, K = a_q.shape
    N = b_q.shape[0]
    if b_q.shape[1] != K:
        raise ValueError(f"fp8_gemm_emulated: K mismatch {tuple(a_q.shape)} vs {tuple(b_q.shape)}")
    Kc = math.ceil(K / tile)
    sa = _rows_chunks(a_s, M, Kc, a_kind, tile)  # [M, Kc]
    sb = _rows_chunks(b_s, N, Kc, b_kind, tile)  # [N, Kc]
    a32, b32 = widen_fp8(a_q), widen_fp8(b_q)
    out = None
    for c in range(Kc):
        lo, hi = c * tile, min(K, (c + 1) * tile)
        if acc_mantissa_bits is None:
            part = a32[:, lo:hi] @ b32[:, lo:hi].t()  # [M, N] FP32 partial of one chunk
        else:
            part = lowprec_gemm(a32[:, lo:hi], b32[:, lo:hi], acc_mantissa_bits)
        part = part.mul_(sa[:, c, None]).mul_(sb[None, :, c])  # in place: the same two roundings, no temporaries
        out = part if out is None else out.add_(part)  # FP32 accumulator, chunk order
    return out if out is not None else a_q.new_zeros(M, N, dtype=torch.float32)


def fp8_grouped_gemm_emulated(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    spans,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    transpose: bool = False,
    tile: int = TILE,
) -> torch.Tensor:
    """`fp8_gemm_emulated` of every expert's rows at once, bit for bit: for (e, lo, hi) in `spans` (consecutive,
    covering all N rows), out[lo:hi] = fp8_gemm_emulated(a_q[lo:hi], a_s[lo:hi], B_e, S_e, "tile", "block") with
    B_e = w_q[e] ([O, K]; its transpose with `transpose`, the Dgrad's) and S_e its 128×128 scales. Each chunk's
    GEMM runs per expert into one [N, O] buffer; the scaling (× a_s, then × S_e) and the chunk sum run once over
    all rows, the same element-wise operations in the same order. a_q [N, K]: E4M3, or widened (`widen_fp8`).
    Each expert's weight is widened to FP32 for its GEMMs only."""
    N, K = a_q.shape
    O = w_q.shape[2] if transpose else w_q.shape[1]
    Kc = math.ceil(K / tile)
    a32, sa = widen_fp8(a_q), a_s.float()  # [N, K], [N, Kc]
    parts = a32.new_empty(Kc, N, O)
    counts, end = [], 0
    for e, lo, hi in spans:
        if lo != end:
            raise ValueError(f"fp8_grouped_gemm_emulated: spans must be consecutive from row 0 (got {lo} after {end})")
        counts.append((e, hi - lo))
        w32 = widen_fp8(w_q[e])
        b32 = w32.t() if transpose else w32  # [O, K]
        for c in range(Kc):
            c0, c1 = c * tile, min(K, (c + 1) * tile)
            torch.mm(a32[lo:hi, c0:c1], b32[:, c0:c1].t(), out=parts[c, lo:hi])
        end = hi
    if end != N:
        raise ValueError(f"fp8_grouped_gemm_emulated: spans cover {end} of {N} rows")
    if not spans:
        return a32.new_zeros(N, O)
    ids = torch.tensor([e for e, _ in counts], device=a_q.device)
    e_N = torch.repeat_interleave(ids, torch.tensor([n for _, n in counts], device=a_q.device))
    s_E = w_s.float().transpose(1, 2) if transpose else w_s.float()  # [E, ceil(O/tile), Kc]
    out = None
    for c in range(Kc):
        sb_NB = s_E[:, :, c].index_select(0, e_N)  # [N, ceil(O/tile)]: S_e of each row's expert
        part = parts[c].mul_(sa[:, c, None])
        if O % tile == 0:  # each scale over its 128 output columns, as a broadcast (no [N, O] copy of the scales)
            part.view(N, O // tile, tile).mul_(sb_NB[:, :, None])
        else:
            part.mul_(sb_NB.repeat_interleave(tile, 1)[:, :O])
        out = part if out is None else out.add_(part)
    return out


# --------------------------------------------------------------------------------------------------
# FP8 all-to-all payload (report §3.3.4: activations quantized before dispatch, power-of-2 scales)


def quantize_dispatch(x_TH: torch.Tensor, tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1×128 quantization with power-of-2 scales (so the receiver's re-tiling is exact)."""
    return quantize_tilewise(x_TH, tile, pow2=True)


def dequantize_dispatch(
    q_TH: torch.Tensor, s_TC: torch.Tensor, dtype: torch.dtype = torch.bfloat16, tile: int = TILE
) -> torch.Tensor:
    return dequantize_tilewise(q_TH, s_TC, tile, dtype)


class _DispatchQDQ(torch.autograd.Function):
    """Forward: what the receiver of an FP8 dispatch sees (pow2 1×128 quantize-dequantize); backward: the
    gradient goes back through a BF16 all-to-all, unquantized."""

    @staticmethod
    def forward(ctx, x):
        q, s = quantize_dispatch(x)
        return dequantize_dispatch(q, s, x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g


class _CombineGradQDQ(torch.autograd.Function):
    """Forward: BF16 combine (identity); backward: the activation gradient before the down-projection is
    sent in FP8 with pow2 1×128 scales (report §3.3.4)."""

    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        q, s = quantize_dispatch(g)
        return dequantize_dispatch(q, s, g.dtype)


def fp8_dispatch_qdq(x_NH: torch.Tensor) -> torch.Tensor:
    """Numerics of `fp8.dispatch` on the expert inputs (idempotent: pow2 re-quantization is exact)."""
    return _DispatchQDQ.apply(x_NH)


def fp8_combine_grad_qdq(y_NH: torch.Tensor) -> torch.Tensor:
    """Numerics of `fp8.dispatch` on the expert outputs' gradients (backward-only quantization)."""
    return _CombineGradQDQ.apply(y_NH)


def pack_dispatch(x_TH: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """One uint8 row per token: H fp8 bytes then ceil(H/128) fp32 scales (4 bytes each), so an all-to-all
    can split the payload by rows with any backend (gloo has no float8 dtype). [T, H + 4·ceil(H/128)]."""
    q, s = quantize_dispatch(x_TH, tile)
    T = x_TH.shape[0]
    return torch.cat([q.view(torch.uint8), s.contiguous().view(torch.uint8).reshape(T, -1)], dim=1)


def unpack_dispatch(
    payload: torch.Tensor, hidden: int, dtype: torch.dtype = torch.bfloat16, tile: int = TILE
) -> torch.Tensor:
    """Inverse of `pack_dispatch` (dequantized to `dtype`; the paper's combine stays BF16)."""
    Hc = math.ceil(hidden / tile)
    if payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != hidden + 4 * Hc:
        raise ValueError(
            f"unpack_dispatch: expected uint8 [T, {hidden + 4 * Hc}], got {payload.dtype} {tuple(payload.shape)}"
        )
    q = payload[:, :hidden].contiguous().view(FP8_DTYPE)
    s = payload[:, hidden:].contiguous().view(torch.float32)
    return dequantize_dispatch(q, s, dtype, tile)
