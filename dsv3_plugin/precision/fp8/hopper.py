"""FP8 GEMM as Hopper tensor cores compute it: limited-precision accumulation inside the tensor core, FP32
promotion on the CUDA cores every N_C elements of K (DeepSeek-V3 report §3.3.2, "Increasing Accumulation
Precision"; DeepGEMM's 1×128 × 128×128 kernel), for every window w of N_C elements of K:

    out += tensor_core_chain(window w's FP8 products) · a_s[:, group] · b_s[:, group]    # FP32, window order

`hopper_gemm`, `HopperEmulatedBackend` (`fp8.backend = "hopper-emulated"`) and error bounds (`hopper_error_bound`,
...). The chain is `mmaemu`'s (pinned 0.1.0), imported only when a GEMM runs: the package works without it.

Design notes (the report's numbers, promote_every, mmaemu's model): docs/design_notes.md#precision-fp8-hopper
"""

from __future__ import annotations

import math

import torch

from dsv3_plugin.precision.fp8.quant import TILE, _rows_chunks

__all__ = [
    "MMAEMU_VERSION",
    "HOPPER_CHAIN",
    "mmaemu_status",
    "tensor_core_chain",
    "hopper_gemm",
    "HopperEmulatedBackend",
    "check_promote_every",
    "chain_error_bound",
    "hopper_error_bound",
    "emulation_error_bound",
    "exponent_magnitude",
]

MMAEMU_VERSION = "0.1.0"  # the version this backend is written and tested against (`make venv` pins it)
# The `hopper` preset of mmaemu 0.1.0 (read from mmaemu.model.presets): products per block-FMA step, fraction bits
# kept below the block's alignment exponent (terms) and below the result's own exponent (the block result).
HOPPER_CHAIN = {"products_per_step": 32, "frac_bits": 13, "frac_bits_out": 13}
_U32 = 2.0**-24  # unit roundoff of FP32 (round to nearest)


def mmaemu_status() -> tuple[bool, str]:
    """(usable, why) for the pinned mmaemu."""
    try:
        import mmaemu
    except ImportError as e:
        return False, (
            f"mmaemu is not installed ({e}); install the pinned version: "
            f"pip install 'mmaemu=={MMAEMU_VERSION}' (or `make venv`, which installs it)"
        )
    ver = getattr(mmaemu, "__version__", "?")
    if ver != MMAEMU_VERSION:
        return False, (
            f"mmaemu {ver} is installed, but this backend is pinned to mmaemu=={MMAEMU_VERSION} "
            f"(an alpha package whose model may change between versions)"
        )
    return True, f"mmaemu {ver} (hopper preset, fast accumulation, no split-K)"


def _mmaemu():
    ok, why = mmaemu_status()
    if not ok:
        raise RuntimeError(f"hopper-emulated FP8 GEMM: {why}")
    import mmaemu

    return mmaemu


def tensor_core_chain(a_q: torch.Tensor, b_q: torch.Tensor) -> torch.Tensor:
    """FP32 [M, N]: one tensor-core accumulation chain (from +0) over all of a_q [M, L] · b_q [N, L]ᵀ, E4M3
    operands, as the H100's cuBLAS FP8 kernel computes it with fast accumulation and no split."""
    mm = _mmaemu()
    with torch.no_grad():
        return mm.accumulate(a_q.contiguous(), b_q.contiguous(), use_fast_accum=True, splitk=1, profile="hopper")


def check_promote_every(promote_every: int | None, a_kind: str, b_kind: str, tile: int = TILE) -> None:
    """N_C must be a positive multiple of 32 (one WGMMA consumes 32 elements of K); with per-group (1×128 /
    128×128) scales it must also divide the group, since a scale is applied when the partial sum is promoted."""
    if promote_every is not None and (promote_every <= 0 or promote_every % HOPPER_CHAIN["products_per_step"]):
        raise ValueError(f"promote_every must be a positive multiple of 32 or None, got {promote_every}")
    grouped = a_kind != "tensor" or b_kind != "tensor"
    if grouped and (promote_every is None or tile % promote_every):
        raise ValueError(
            f"promote_every = {promote_every}: with {a_kind}/{b_kind} scales each {tile}-element group "
            f"has its own scale, applied on the CUDA cores at promotion, so N_C must divide {tile} "
            f"(None or N_C > {tile} needs one scale per operand: recipe 'tensorwise')"
        )


def hopper_gemm(
    a_q: torch.Tensor,
    a_s: torch.Tensor,
    b_q: torch.Tensor,
    b_s: torch.Tensor,
    a_kind: str = "tile",
    b_kind: str = "block",
    promote_every: int | None = TILE,
    tile: int = TILE,
) -> torch.Tensor:
    """out[M, N] (FP32) = Σ_windows chain(a_q[:, w] · b_q[:, w]ᵀ) · a_s · b_s, b given as [N, K].

    Windows of `promote_every` elements of K, in K order, never straddling a scale group; each is one tensor-core
    chain, scaled and added in FP32 in the same operation order as `fp8.fp8_gemm_emulated` (so the two agree bit
    for bit wherever the chain is exact). Scale kinds as in `fp8_gemm_emulated`."""
    M, K = a_q.shape
    N = b_q.shape[0]
    if b_q.shape[1] != K:
        raise ValueError(f"hopper_gemm: K mismatch {tuple(a_q.shape)} vs {tuple(b_q.shape)}")
    check_promote_every(promote_every, a_kind, b_kind, tile)
    Kc = max(1, math.ceil(K / tile))
    sa = _rows_chunks(a_s, M, Kc, a_kind, tile)  # [M, Kc]
    sb = _rows_chunks(b_s, N, Kc, b_kind, tile)  # [N, Kc]
    window = promote_every or K
    out = None
    for lo in range(0, K, window):
        hi = min(K, lo + window)
        c = lo // tile  # scale group (constant for tensor kinds)
        part = tensor_core_chain(a_q[:, lo:hi], b_q[:, lo:hi])  # [M, N] the promoted FP32 partial sum
        part = part * sa[:, c, None] * sb[None, :, c]
        out = part if out is None else out.add_(part)  # FP32 accumulator on the CUDA cores
    return out if out is not None else torch.zeros(M, N, dtype=torch.float32, device=a_q.device)


class HopperEmulatedBackend:
    """`fp8.backend = "hopper-emulated"`: the GEMM backend interface of `linear.EmulatedBackend` (Fprop,
    Dgrad and Wgrad of `Fp8Linear` and the FP8 experts all call `gemm`), with Hopper's tensor-core accumulation
    and FP32 promotion every `promote_every` elements. Runs on any device (mmaemu has CPU and CUDA paths)."""

    name = "hopper-emulated"

    def __init__(self, promote_every: int | None = TILE):
        self.promote_every = promote_every

    def gemm(self, a_q, a_s, a_kind, b_q, b_s, b_kind):
        return hopper_gemm(a_q, a_s, b_q, b_s, a_kind, b_kind, self.promote_every)

    def __repr__(self) -> str:
        return f"HopperEmulatedBackend(promote_every={self.promote_every})"


# --------------------------------------------------------------------------------------------------
# A-priori error bounds (what a test may assert; the bench reports them beside the measured errors)


def exponent_magnitude(q: torch.Tensor) -> torch.Tensor:
    """2^e per element of an E4M3 tensor as the tensor core aligns it: e = floor(log2|x|) clamped at E4M3's
    emin = -6 (subnormals keep exponent -6), and 0 for zeros. float64."""
    x = q.double().abs()
    e = (torch.frexp(x)[1] - 1).clamp_min(-6).double()
    return torch.where(x > 0, torch.exp2(e), torch.zeros_like(x))


def chain_error_bound(length: int, abs_sum: torch.Tensor, exp_sum: torch.Tensor) -> torch.Tensor:
    """Bound on |chain − exact| for one tensor-core chain over `length` products (from +0).

    Per block-FMA step of 32 products with alignment exponent E = max(product exponents, accumulator exponent):
    each of the 32 products and the accumulator is truncated toward zero to a multiple of 2^(E−13) (error
    < u·2^E each, u = 2^−13) and the block result to 13 fraction bits of its own magnitude (< u·|d|).
    2^E ≤ P_j + |c| with P_j the block's largest 2^(e_a+e_b) (`exponent_magnitude`), and since every truncation
    is toward zero, |c| and |d| never exceed Σ|a_k b_k| over the chain (`abs_sum`). Summed over the n steps:
        |err| < u · (33 · Σ_k 2^(e_a+e_b) + 34 · n · Σ_k |a_k b_k|)
    `abs_sum`, `exp_sum` are those two sums over the chain (any shape). A worst case, not a typical error: it grows
    with the chain length like the tensor core's actual error does."""
    u = 2.0 ** -HOPPER_CHAIN["frac_bits"]
    n = math.ceil(length / HOPPER_CHAIN["products_per_step"])
    return u * (33.0 * exp_sum + 34.0 * n * abs_sum)


def _gamma(n: int) -> float:
    """γ_n = n·u/(1 − n·u): the classic bound on n rounded FP32 operations in sequence."""
    return n * _U32 / (1 - n * _U32)


def _groups(a_q, b_q, a_s, a_kind, b_s, b_kind, tile):
    """Yield (lo, hi, scale [M, N] float64) per scale group of K: all of K for tensor-wise scales on both sides,
    else the 128-chunks."""
    M, K = a_q.shape
    N = b_q.shape[0]
    Kc = max(1, math.ceil(K / tile))
    one = torch.ones((), device=a_q.device)
    sa = _rows_chunks(one if a_s is None else a_s, M, Kc, a_kind, tile).double()
    sb = _rows_chunks(one if b_s is None else b_s, N, Kc, b_kind, tile).double()
    if a_kind == "tensor" and b_kind == "tensor":
        yield 0, K, sa[:, :1] * sb[:, :1].t()
        return
    for c in range(Kc):
        yield c * tile, min(K, (c + 1) * tile), sa[:, c, None] * sb[None, :, c]


def hopper_error_bound(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    promote_every: int | None,
    a_s=None,
    a_kind: str = "tensor",
    b_s=None,
    b_kind: str = "tensor",
    tile: int = TILE,
) -> torch.Tensor:
    """Per-element bound [M, N] (float64) on |hopper_gemm − exact product of the dequantized operands|: each
    chain's bound (`chain_error_bound`) times its scales, plus the FP32 scaling and accumulation of the W promoted
    partials (γ_{W+2} · Σ scale·|a b|). Scales and kinds as in `hopper_gemm` (default: unit, tensor-wise)."""
    K = a_q.shape[1]
    W = 0
    chain = fp32 = 0.0
    ea, eb = exponent_magnitude(a_q), exponent_magnitude(b_q)
    for lo, hi, scale in _groups(a_q, b_q, a_s, a_kind, b_s, b_kind, tile):
        window = min(promote_every or K, hi - lo)
        W += math.ceil((hi - lo) / window)
        abs_sum = a_q[:, lo:hi].double().abs() @ b_q[:, lo:hi].double().abs().t()
        exp_sum = ea[:, lo:hi] @ eb[:, lo:hi].t()
        # Σ over a group's windows of each chain's bound ≤ the bound with the group's sums and the window's n;
        # each promoted partial is at most its window's Σ|a b| (every truncation is toward zero).
        chain = chain + scale * chain_error_bound(window, abs_sum, exp_sum)
        fp32 = fp32 + scale * abs_sum
    return chain + _gamma(W + 2) * fp32


def emulation_error_bound(
    a_q: torch.Tensor,
    b_q: torch.Tensor,
    a_s=None,
    a_kind: str = "tensor",
    b_s=None,
    b_kind: str = "tensor",
    tile: int = TILE,
) -> torch.Tensor:
    """Per-element bound [M, N] (float64) on |fp8_gemm_emulated − exact|: each 128-chunk is an FP32 matmul (any
    summation order: γ_128), then two scale multiplications and one addition per chunk (γ_{128 + Kc + 2})."""
    K = a_q.shape[1]
    total = 0.0
    for lo, hi, scale in _groups(a_q, b_q, a_s, a_kind, b_s, b_kind, tile):
        total = total + scale * (a_q[:, lo:hi].double().abs() @ b_q[:, lo:hi].double().abs().t())
    return _gamma(tile + math.ceil(K / tile) + 2) * total
