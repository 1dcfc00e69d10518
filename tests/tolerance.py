"""Derived tolerances: how far two evaluations of the same math may differ when only the ORDER of their
float roundings differs (a re-blocked GEMM, a split sum, gradients accumulated in another order).

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed. 2002): every float operation
rounds with relative error <= u, the unit roundoff (eps/2 for round-to-nearest; `torch.finfo(dt).eps` is
the spacing at 1.0, so u = eps/2). With gamma_n = n·u / (1 − n·u):
  - a sum of n terms in ANY order:     |fl(Σ x_i) − Σ x_i| <= gamma_{n−1} · Σ|x_i|          (Eq. 3.4)
  - a dot product / GEMM of length K:  |fl(A @ B) − A @ B| <= gamma_K · (|A| @ |B|)         (Eq. 3.5, 3.13)
These hold for any blocking, threading or FMA use, which is exactly what differs between CPUs and thread
counts. Two orderings are each within that of the exact value, so they differ by at most twice it:

    |got − ref| <= 2 · stages · gamma_K · M                                        (`reorder_bound`)

K: the longest reduction whose order differs; M: the magnitude of its terms (elementwise |A| @ |B| when
the operands are at hand, or the same formula evaluated on |inputs|); stages: how many reordered
reductions lie on the path to the compared value (their first-order error terms add).

Through a whole model (`model_bound`) the operands of the inner reductions are not at hand: K is the
longest reduction in the model, stages counts the reductions on the longest path (REDUCTIONS_PER_BLOCK per
decoder/MTP block, per pass), and M is the normwise proxy max|ref| of the compared tensor. That proxy
assumes the layers do not amplify relative errors (every GEMM input here is RMS-normalized) and that the
terms of each sum are not far larger than its result; the worst-case K·stages factor puts the bound
>= 1000x above what is observed, which leaves room for both. Such a bound is loose (2e-3 to 4e-3 of max|ref| on the
tiny model), so tests keep it for the rounding noise and check the structure (which parameters, which rows) exactly.

API (stable; other tests import it):
  unit_roundoff(dtype)                      u = eps/2
  gamma(n, dtype)                           n·u / (1 − n·u)
  reorder_bound(K, magnitude, dtype, stages)  2·stages·gamma_K·magnitude (float or tensor)
  matmul_bound(a, b, dtype, stages)         reorder_bound(K, |a| @ |b|) for a @ b (K = a.shape[-1])
  perturbed_matmul_bound(a, da, b, db)      |(a+δa) @ (b+δb) − a @ b| for |δa| <= da, |δb| <= db, plus the
                                            float32 accumulation: da@|b| + |a|@db + da@db + 2·gamma_K·(..)
  fp8_error(x, scale, fp8_dtype)            largest |dequant(quant(x)) − x| of a scaled FP8 cast at `scale`
                                            (elementwise): u·|x| in the normal range, half a subnormal step
                                            below it (E4M3: u = 2^-4, subnormal step 2^-9, times the scale)
  model_bound(ref, cfg, tokens, passes)     reorder_bound for a value computed through a DSv3Model (`cfg`) on
                                            `tokens` tokens: passes=1 forward only, 2 forward + backward
  LOGITS_FP32_ABS                           1e-5: README's logits acceptance figure (why it holds: below)
  assert_within(got, ref, bound, what)      elementwise |got − ref| <= bound; on failure names the worst
                                            element, its bound, how many elements exceed, and `what` (the
                                            sentence saying what was reordered). With TOL_REPORT=1 (and
                                            pytest -s) it prints the fraction of the bound each check used.
  check_within(got, ref, bound, what)       the same, returning None or the failure message: for ranks of a
                                            spawned test, which report and let the parent assert (a rank
                                            that raises leaves its peers waiting in a collective)
Where both sides run the identical op sequence, tests use `torch.equal` instead: no tolerance at all.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "unit_roundoff",
    "gamma",
    "reorder_bound",
    "matmul_bound",
    "model_bound",
    "REDUCTIONS_PER_BLOCK",
    "LOGITS_FP32_ABS",
    "perturbed_matmul_bound",
    "fp8_error",
    "assert_within",
    "check_within",
]

# README's acceptance figure for our fp32 logits (main and MTP) against transformers / the written-out
# formulas. It is a promise, not a rounding bound: the worst case `model_bound` allows ~3e-3 on the tiny
# models, but both sides run the same math with only some reductions ordered differently, and those
# errors are random-signed: measured <= 6e-7 (about 5·u·max|logit|, at 1 and 2 threads), 16x under it.
LOGITS_FP32_ABS = 1e-5

# Reductions one DSv3 block puts on the longest path, per pass: input RMSNorm, q_a, q_a RMSNorm, q_b, kv_a,
# kv_a RMSNorm, kv_b, QKᵀ, softmax sum, PV, o_proj (11); post-attention RMSNorm, router, gate|up, down, and
# the Σ over the k experts + shared expert + residual (5).
REDUCTIONS_PER_BLOCK = 16


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: the largest relative error of one round-to-nearest in `dtype`."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's gamma_n = n·u / (1 − n·u): the relative error bound of n successive roundings."""
    nu = max(int(n), 1) * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}, {dtype}): n·u = {nu} >= 1, the bound is void; reduce in a wider dtype")
    return nu / (1 - nu)


def reorder_bound(K: int, magnitude, dtype: torch.dtype = torch.float32, stages: int = 1):
    """Largest |a − b| between two orderings of `stages` reductions of length `K` whose terms have absolute
    values summing to `magnitude` (a float, or a tensor broadcastable to the compared values)."""
    c = 2 * stages * gamma(K, dtype)
    if torch.is_tensor(magnitude):
        return magnitude.double() * c
    return float(magnitude) * c


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None, stages: int = 1):
    """Elementwise bound for two orderings of `a @ b` (batched/broadcast like `@`): 2·gamma_K·(|a| @ |b|),
    the magnitude computed in float64 so the bound itself carries no rounding that matters."""
    dtype = dtype or torch.promote_types(a.dtype, b.dtype)
    return reorder_bound(a.shape[-1], a.detach().double().abs() @ b.detach().double().abs(), dtype, stages)


def perturbed_matmul_bound(a: torch.Tensor, da, b: torch.Tensor, db, dtype: torch.dtype = torch.float32):
    """Elementwise bound on |fl((a + δa) @ (b + δb)) − a @ b| for |δa| <= da, |δb| <= db (e.g. quantized
    operands vs the exact ones): the perturbation terms plus both sides' accumulation rounding."""
    a, b = a.detach().double().abs(), b.detach().double().abs()
    da, db = torch.as_tensor(da, dtype=torch.float64), torch.as_tensor(db, dtype=torch.float64)
    da, db = torch.broadcast_to(da, a.shape), torch.broadcast_to(db, b.shape)
    return da @ b + a @ db + da @ db + reorder_bound(a.shape[-1], (a + da) @ (b + db), dtype)


def fp8_error(x: torch.Tensor, scale, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """Largest |scale·fp8(x / scale) − x| (round to nearest, no saturation), elementwise; `scale` is a float
    or a tensor broadcastable to x (a tile's or block's decode scale, expanded)."""
    fi = torch.finfo(fp8_dtype)
    half_subnormal_step = fi.smallest_normal * fi.eps / 2  # E4M3: 2^-6 · 2^-3 / 2 = 2^-10
    return unit_roundoff(fp8_dtype) * x.detach().double().abs() + half_subnormal_step * torch.as_tensor(
        scale, dtype=torch.float64
    )


def model_bound(ref: torch.Tensor, cfg, tokens: int, passes: int = 2, dtype: torch.dtype = torch.float32):
    """Bound for `ref` computed through a DSv3Model built from `cfg` (a DSv3Config) on `tokens` tokens in all
    (a gradient sums over every token of the batch), reordered anywhere: K = the longest reduction, stages =
    REDUCTIONS_PER_BLOCK per block (decoder layers + MTP) + 3 (final norm, lm_head, the loss's log-sum-exp
    and token mean) per pass (1: forward; 2: forward and backward), magnitude max|ref|."""
    m, e = cfg.model, cfg.moe
    K = max(
        m.vocab_size,
        m.hidden_size,
        m.intermediate_size,
        e.intermediate_size,
        e.n_routed_experts,
        m.q_lora_rank or 0,
        m.kv_lora_rank,
        m.num_attention_heads * max(cfg.qk_head_dim, m.v_head_dim),
        int(tokens),
    )
    stages = passes * (REDUCTIONS_PER_BLOCK * (m.num_hidden_layers + cfg.mtp.depth) + 3)
    return reorder_bound(K, ref.detach().abs().max(), dtype, stages)


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound, what: str) -> float:
    """Assert |got − ref| <= bound elementwise (bound: float or broadcastable tensor). `what` says what was
    reordered, and lands in the failure message with the worst element. Returns the worst |diff|/bound."""
    got, ref = torch.as_tensor(got), torch.as_tensor(ref)
    assert got.shape == ref.shape, f"{what}: shapes differ, {tuple(got.shape)} vs {tuple(ref.shape)}"
    diff = (got.detach().double() - ref.detach().double()).abs()
    bound_t = torch.broadcast_to(torch.as_tensor(bound, dtype=torch.float64).detach(), diff.shape)
    if diff.numel() == 0:
        return 0.0
    bad = ~(diff <= bound_t)  # NaN anywhere counts as a failure
    ratio = torch.where(bound_t > 0, diff / bound_t, torch.where(diff > 0, math.inf, 0.0))
    ratio = torch.where(torch.isnan(diff), math.inf, ratio)
    worst = int(ratio.reshape(-1).argmax())
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {diff.numel()} elements exceed the bound; worst at {idx}: "
            f"got {got.reshape(-1)[worst].item():.9g}, ref {ref.reshape(-1)[worst].item():.9g}, "
            f"|diff| {diff.reshape(-1)[worst].item():.3g} > bound {bound_t.reshape(-1)[worst].item():.3g} "
            f"({ratio.reshape(-1)[worst].item():.3g}x)"
        )
    used = float(ratio.reshape(-1)[worst])
    if os.environ.get("TOL_REPORT"):  # TOL_REPORT=1 pytest -s: how much of each bound is used
        print(f"[tol] {used:.2e} of bound: {what}")
    return used


def check_within(got: torch.Tensor, ref: torch.Tensor, bound, what: str) -> str | None:
    """`assert_within` that returns its failure message instead of raising (None when it holds)."""
    try:
        assert_within(got, ref, bound, what)
    except AssertionError as e:
        return str(e)
    return None
