"""FP8 expert SwiGLU with FP8-cached SwiGLU inputs (report §3.3.3): same forward as three FP8 Linears,
gradients within FP8 error, fewer saved bytes."""

import torch
import torch.nn.functional as F

from dsv3_plugin.precision.fp8.experts import fp8_expert_swiglu
from dsv3_plugin.precision.fp8.linear import Fp8Recipe, fp8_linear
from dsv3_plugin.training.recompute import saved_activation_bytes


def _params(H=200, I=136, n=150, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).requires_grad_()
    ws = [(torch.randn(*s, generator=g) * 0.05).requires_grad_() for s in ((I, H), (I, H), (H, I))]
    return x, ws


def _unfused(x, w1, w3, w2, recipe=Fp8Recipe()):
    return fp8_linear(F.silu(fp8_linear(x, w1, recipe)) * fp8_linear(x, w3, recipe), w2, recipe)


def _grads(fn, params, dy):
    for t in params:
        t.grad = None
    out = fn()
    out.backward(dy)
    return out.detach(), [t.grad.clone() for t in params]


def test_forward_bit_identical_and_grads_close():
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for recipe in (Fp8Recipe(), Fp8Recipe("tensorwise"), Fp8Recipe(pow2=True)):
        x, (w1, w3, w2) = _params()
        ps = (x, w1, w3, w2)
        dy = torch.randn(150, 200, generator=torch.Generator().manual_seed(3))
        y, got = _grads(lambda: fp8_expert_swiglu(x, w1, w3, w2, recipe), ps, dy)
        y_ref, ref = _grads(lambda: _unfused(x, w1, w3, w2, recipe), ps, dy)
        _, exact = _grads(lambda: F.silu(x @ w1.t()) * (x @ w3.t()) @ w2.t(), ps, dy)
        assert torch.equal(y, y_ref)
        for a, b, e in zip(got, ref, exact):
            assert 0 < rel(a, b) < 0.08  # the FP8 rounding of cached g, u
            assert rel(a, e) < 0.1 and rel(a, e) < 1.3 * rel(b, e), (rel(a, e), rel(b, e))


def test_saves_fewer_bytes_than_three_linears():
    x, (w1, w3, w2) = _params(n=256)
    owner = torch.nn.ParameterList([torch.nn.Parameter(w) for w in (w1, w3, w2)])
    fused = saved_activation_bytes(owner, lambda: fp8_expert_swiglu(x, *owner))
    unfused = saved_activation_bytes(owner, lambda: _unfused(x, *owner))
    assert fused < 0.6 * unfused, (fused, unfused)
