"""Power-of-two (ue8m0) decode scales are the exact ceiling of max(amax, 1e-4)/448, for the quantizers and the
FP8 dispatch payload alike (DeepSeek-V3 report §3.3.4; DeepGEMM's `ceil_to_ue8m0`, TE's power-of-2 scales).

`exp2(ceil(log2(s)))` in float32 rounds down when s is a few ulps above 2^k (log2 returns exactly k), which
clamps the group's largest element: the sweep below puts amax at 448·2^k and ±1, ±2 ulps for every k whose
448·2^k is a normal float (k = -134 … 119; below k = -22 the 1e-4 amax clamp decides the scale).
All comparisons are exact (float64 holds every fp32/bf16 value and every product with a power of two)."""

import math
from fractions import Fraction

import pytest
import torch

from dsv3_plugin.parallel.dispatch import FP8Codec
from dsv3_plugin.precision.fp8.quant import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_tilewise,
    fp8_combine_grad_qdq,
    fp8_dispatch_qdq,
    quantize_blockwise,
    quantize_tensorwise,
    quantize_tilewise,
    scale_from_amax,
)

K_RANGE = range(-134, 120)  # 448·2^k normal in fp32 and bf16 (1.75·2^-126 … 1.75·2^127)
EPS32 = float(torch.tensor(AMAX_EPS, dtype=torch.float32))  # the clamp as the fp32 code sees it


def _sweep(dtype) -> torch.Tensor:
    """amax = 448·2^k and its ±1, ±2-ulp neighbours in `dtype`, for every k in K_RANGE: [5·len(K_RANGE)]."""
    base = torch.tensor([448.0 * 2.0**k for k in K_RANGE], dtype=torch.float64).to(dtype)
    assert torch.equal(base.double(), torch.tensor([448.0 * 2.0**k for k in K_RANGE], dtype=torch.float64))
    itype = torch.int32 if dtype == torch.float32 else torch.int16
    bits = base.view(itype)  # positive: the next float is bits + 1
    out = torch.cat([(bits + n).view(dtype) for n in (-2, -1, 0, 1, 2)])
    assert torch.isfinite(out).all() and (out > 0).all()
    return out


def _ref_scale(amax: float) -> float:
    """Smallest 2^e >= max(amax, 1e-4)/448, in exact rational arithmetic (independent of float rounding)."""
    r = max(Fraction(amax), Fraction(EPS32)) / 448
    e = math.frexp(float(r))[1]
    while Fraction(2) ** e < r:
        e += 1
    while Fraction(2) ** (e - 1) >= r:
        e -= 1
    return 2.0**e


def _te_rule(amax32: torch.Tensor) -> torch.Tensor:
    """TE's power-of-2 rule, written from its description: encode scale 448/amax in fp32 with the mantissa
    bits cleared (rounded down to 2^j), decode scale = its reciprocal (exact for a power of two)."""
    a = amax32.clamp(min=EPS32)
    enc = torch.full_like(a, FP8_MAX) / a  # NOT `448 / a`: torch computes that as reciprocal(a)·448
    enc = (enc.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    return 1.0 / enc


def _check_scales(amax: torch.Tensor, s: torch.Tensor):
    """s >= a/448 > s/2 exactly (a = max(amax, 1e-4)); equal to the exact and the TE-rule references."""
    a64 = amax.double().clamp(min=EPS32)
    s64 = s.double()
    low = ~(s64 * FP8_MAX >= a64)
    assert not low.any(), (
        f"scale below amax/448 (rounded down) for amax = {amax[low][:4].tolist()}: s = {s[low][:4].tolist()}"
    )
    high = ~(s64 * (FP8_MAX / 2) < a64)
    assert not high.any(), f"scale not the smallest power of two for amax = {amax[high][:4].tolist()}"
    ref = torch.tensor([_ref_scale(v) for v in amax.double().tolist()], dtype=torch.float32)
    assert torch.equal(s, ref)
    assert torch.equal(s, _te_rule(amax.float()))


def _tiles(amax: torch.Tensor, width: int = 128) -> torch.Tensor:
    """One row per amax: element 0 is ±amax (sign alternating by row), the rest strictly smaller in magnitude."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(amax.numel(), width, generator=g, dtype=torch.float64) * 1.9 - 0.95  # |u| <= 0.95
    x = (amax.double()[:, None] * u).to(amax.dtype)
    sign = torch.where(torch.arange(amax.numel()) % 2 == 0, 1.0, -1.0).to(amax.dtype)
    x[:, 0] = amax * sign
    return x


def _check_max_not_clamped(x: torch.Tensor, q: torch.Tensor, s_row: torch.Tensor, col: int = 0):
    """The element of max |x| in each row: |x|/s <= 448 before the saturating cast, and its FP8 code is the
    plain (unclamped) rounding of x/s."""
    ratio = x[:, col].double() / s_row.double()  # exact: s is a power of two
    over = ratio.abs() > FP8_MAX
    assert not over.any(), f"max element clamped: |x|/s = {ratio[over][:4].tolist()} > 448"
    want = ratio.float().to(FP8_DTYPE)
    assert torch.equal(q[:, col].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pow2_scale_is_exact_ceiling_over_the_whole_range(dtype):
    amax = _sweep(dtype)
    _check_scales(amax, scale_from_amax(amax, pow2=True))
    # the example: 448·2^-10 + 1 ulp -> 2^-9 (float32 log2 gave exactly -10 and the scale 2^-10)
    assert scale_from_amax(torch.tensor([0.43750003]), pow2=True).item() == 2.0**-9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_max_element_not_clamped(dtype):
    amax = _sweep(dtype)
    x = _tiles(amax)  # [R, 128], one tile per row
    q, s = quantize_tilewise(x, pow2=True)
    _check_scales(amax, s[:, 0])
    _check_max_not_clamped(x, q, s[:, 0])
    # the whole tile: x/s is exact (power-of-two s, no underflow at these magnitudes), then RNE into E4M3
    want = (x.double() / s.double()).float().to(FP8_DTYPE)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def test_block_and_tensor_scales_use_the_same_ceiling():
    amax = _sweep(torch.float32)
    for a in amax[::37].tolist() + [448.0 * 2.0**-10 * (1 + 2.0**-23)]:
        w = torch.full((130, 130), a / 4)
        w[129, 3] = -a  # in the ragged corner block
        _, sb = quantize_blockwise(w, pow2=True)
        _, st = quantize_tensorwise(w, pow2=True)
        assert sb[1, 0].item() == st.item() == _ref_scale(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_payload_scales_are_the_same_exact_ceiling(dtype):
    """The FP8 all-to-all payload (`fp8.dispatch`): its scales come from the same function, bit for bit, and the
    receiver decodes the unclamped values; the single-process numerics (`fp8_dispatch_qdq`, the combine's
    backward) agree with the payload."""
    amax = _sweep(dtype)
    H = 200  # two tiles: 128 + a ragged 72
    x = torch.cat([_tiles(amax / 4, 128), _tiles(amax, 72)], dim=1)  # row max sits at column 128
    codec = FP8Codec()
    (payload,) = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.shape == (x.shape[0], H + 4 * 2)
    q = payload[:, :H].contiguous().view(FP8_DTYPE)
    s = payload[:, H:].contiguous().view(torch.float32)  # [R, 2]
    _check_scales(amax, s[:, 1])
    tile_amax = torch.stack([x[:, :128].abs().amax(1), x[:, 128:].abs().amax(1)], 1)  # [R, 2]
    assert torch.equal(s, scale_from_amax(tile_amax, pow2=True))  # one function for both paths
    _check_max_not_clamped(x, q, s[:, 1], col=128)
    y = codec.decode([payload], H, torch.float32)
    assert torch.equal(y, dequantize_tilewise(q, s))
    assert torch.equal(fp8_dispatch_qdq(x.float()), y)
    g = torch.zeros_like(x, dtype=torch.float32, requires_grad=True)
    fp8_combine_grad_qdq(g * 1.0).backward(x.float())  # the expert-output gradient, sent in FP8
    assert torch.equal(g.grad, y)


# ---------------------------------------------------------------------------------------------- edge values
def test_zero_amax_gives_finite_scale():
    z = torch.zeros(3)
    assert torch.equal(scale_from_amax(z, pow2=True), torch.full((3,), 2.0**-22))  # ceil(1e-4/448)
    assert torch.equal(scale_from_amax(z), torch.full((3,), EPS32) / FP8_MAX)
    q, s = quantize_tilewise(torch.zeros(2, 256), pow2=True)
    assert torch.isfinite(s).all() and torch.equal(dequantize_tilewise(q, s), torch.zeros(2, 256))
    (payload,) = FP8Codec().encode(torch.zeros(2, 256, dtype=torch.bfloat16))
    assert torch.equal(FP8Codec().decode([payload], 256, torch.float32), torch.zeros(2, 256))


def test_largest_finite_amax():
    big = torch.tensor([torch.finfo(torch.float32).max])
    s = scale_from_amax(big, pow2=True)
    assert s.item() == 2.0**120 and s.item() * FP8_MAX >= big.item()
    x = torch.zeros(1, 128)
    x[0, 5] = -big
    q, s = quantize_tilewise(x, pow2=True)
    # FLT_MAX / 2^120 = 255.99998 is not clamped; E4M3 rounds it to 256 (and 256·2^120 is past FLT_MAX, so this
    # one value dequantizes to -inf in fp32 — a property of FP8 rounding, not of the scale)
    assert q.float()[0, 5].item() == -256.0


@pytest.mark.parametrize("pow2", [False, True])
def test_inf_or_nan_amax_gives_nan_scale_and_nan_group(pow2):
    """Decided behaviour: a group holding Inf or NaN gets a NaN scale and dequantizes to all-NaN (the
    non-finite input is never saturated into a finite value); other groups are untouched."""
    amax = torch.tensor([float("inf"), float("nan"), float("-inf")])
    assert torch.isnan(scale_from_amax(amax, pow2=pow2)).all()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    x[0, 7], x[1, 200] = float("inf"), float("nan")
    q, s = quantize_tilewise(x, pow2=pow2)
    y = dequantize_tilewise(q, s)
    assert torch.isnan(s[0, 0]) and torch.isnan(s[1, 1]) and torch.isfinite(s[2]).all()
    assert torch.isnan(y[0, :128]).all() and torch.isnan(y[1, 128:]).all()
    assert torch.isfinite(y[0, 128:]).all() and torch.isfinite(y[1, :128]).all() and torch.isfinite(y[2]).all()
    if pow2:  # the dispatch payload carries it the same way
        (payload,) = FP8Codec().encode(x)
        assert torch.equal(FP8Codec().decode([payload], 256, torch.float32).isnan(), y.isnan())
