"""`chunked_sq_norm` (patches/deepspeed_zero1_flat_grads.py, `memory.grad_norm: fp32`): Σ g² of a flat gradient
partition from FP32 norms of 256-element pieces summed in FP64, against the exact FP64 sum.

Bound (the function's docstring): each piece's FP32 sum of squares is within (C + 1)·u of its exact value (C − 1
additions, the squares' roundings; u = 2^-24), its square root and re-squaring add 2u, the FP64 sum of the pieces is
exact to ~n·2^-53 and the final rounding adds u: (C + 4)·u relative for C = min(n, 256), whatever the length. One
FP32 pass over the whole partition has no such bound: its error grows with n (1.6e-4 at 4 M elements measured,
above this bound), which is why the pieces.
"""

from __future__ import annotations

import pytest
import torch

from patches.deepspeed_zero1_flat_grads import NORM_CHUNK, chunked_sq_norm

U = 2.0**-24


def _exact(g: torch.Tensor) -> float:
    return float(g.double().square().sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 3 * 256, (1 << 22) + 37])
def test_within_the_piece_bound_at_any_length(n, dtype):
    g = torch.Generator().manual_seed(n)
    # magnitudes over four decades, as gradients of different layers have
    flat = (torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 0, (n,), generator=g)).to(dtype)
    got = chunked_sq_norm(flat)
    assert got.dtype == torch.float32 and got.dim() == 0
    ref = _exact(flat)
    bound = (min(n, NORM_CHUNK) + 4) * U * ref
    assert abs(float(got) - ref) <= bound, (float(got), ref, bound)


def test_empty_zero_and_non_finite():
    assert float(chunked_sq_norm(torch.zeros(0))) == 0.0
    assert float(chunked_sq_norm(torch.zeros(1000))) == 0.0
    x = torch.ones(1000)
    x[999] = float("inf")  # in the tail piece
    assert float(chunked_sq_norm(x)) == float("inf")
    x[999], x[3] = 1.0, float("nan")
    assert torch.isnan(chunked_sq_norm(x))


def test_pieces_and_tail_counted_once():
    # 3 whole pieces and a tail of 225 = 15² elements, all 3.0: every piece's and the tail's sum of squares is a
    # perfect square (2304 = 48², 2025 = 45²), so each step is exact and the result must be 3·2304 + 2025
    flat = torch.full((3 * NORM_CHUNK + 225,), 3.0)
    assert NORM_CHUNK == 256
    assert float(chunked_sq_norm(flat)) == 3 * 2304 + 2025
