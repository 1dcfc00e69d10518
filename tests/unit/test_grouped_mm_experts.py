"""Routed experts through `torch.nn.functional.grouped_mm` (the CUDA path): group layout, numerics against a
float64 reference (torch 2.13 runs grouped_mm on CPU in FP32/BF16, forward and backward), and the selection."""

import pytest
import torch

from dsv3_plugin.model.kernels import apply_split
from dsv3_plugin.model.moe import grouped_mm as gme
from dsv3_plugin.model.moe import layer as moe
from dsv3_plugin.model.moe.grouped_mm import (
    ALIGN_ROWS,
    expert_kernel,
    grouped_mm_swiglu,
    padded_offsets,
    swiglu_magnitudes,
)


def test_padded_offsets_layout():
    counts = [3, 0, 17, 16, 0, 1]
    offs, pos, Np = padded_offsets(counts, 16)
    assert offs.dtype == torch.int32 and offs.tolist() == [16, 16, 48, 64, 64, 80] and Np == 80
    assert pos.tolist() == [0, 1, 2] + list(range(16, 33)) + list(range(48, 64)) + [64]
    assert all(int(o) % ALIGN_ROWS == 0 for o in offs)  # 16-byte aligned groups for BF16 and FP8
    offs, pos, Np = padded_offsets([0, 0], 16)
    assert offs.tolist() == [0, 0] and pos.numel() == 0 and Np == 0


def _problem(counts, H=64, I=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    x = torch.randn(N, H, generator=g)
    ws = [
        torch.randn(E, I, H, generator=g) * 0.1,
        torch.randn(E, I, H, generator=g) * 0.1,
        torch.randn(E, H, I, generator=g) * 0.1,
    ]
    return x, ws, torch.randn(N, H, generator=g)


def _run(fn, x, ws, counts, dy, dtype=torch.float32):
    ps = [t.detach().to(dtype).requires_grad_() for t in (x, *ws)]
    y = fn(ps[0], counts, *ps[1:])
    y.backward(dy.to(dtype))
    return [y.detach()] + [p.grad for p in ps]


def _reference(x, ws, counts, dy):
    """Float64 per-expert SwiGLU with autograd."""
    ps = [t.detach().double().requires_grad_() for t in (x, *ws)]
    outs, s = [], 0
    for e, n in enumerate(counts):
        xe = ps[0][s : s + n]
        outs.append((torch.nn.functional.silu(xe @ ps[1][e].t()) * (xe @ ps[2][e].t())) @ ps[3][e].t())
        s += n
    y = torch.cat(outs)
    y.backward(dy.double())
    return [y.detach()] + [p.grad for p in ps]


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 17, 0], [16, 16, 1, 33]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_swiglu_matches_float64(counts, dtype):
    x, ws, dy = _problem(counts)
    # inputs rounded to the kernel's dtype first: the reference sees the same operands
    x, ws, dy = x.to(dtype).float(), [w.to(dtype).float() for w in ws], dy.to(dtype).float()
    got = _run(grouped_mm_swiglu, x, ws, counts, dy, dtype)
    ref = _reference(x, ws, counts, dy)
    mags = swiglu_magnitudes(x, counts, *ws, dy)
    N, H, I = x.shape[0], x.shape[1], ws[0].shape[1]
    # First-order rounding bound: the kernel stores g, u, silu(g)·u, y and the gradients' intermediates in `dtype`
    # (≤ 6 roundings on any path) and accumulates in FP32 over at most N + H + I terms along a path.
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    scale = 6 * unit + (N + H + I) * 2.0**-24
    for name, a, b, m in zip(("y", "dx", "dw1", "dw3", "dw2"), got, ref, mags):
        assert bool(((a.double() - b).abs() <= scale * m).all()), name
    assert torch.count_nonzero(got[2][[e for e, n in enumerate(counts) if n == 0]]) == 0  # unused experts


def test_grouped_mm_equals_the_loop_kernel_on_cpu():
    """FP32 on CPU: the grouped kernel and the loop kernel agree within twice the FP32 bound of each (they order
    their operations differently: padded GEMM blocking, autograd vs the hand-written backward)."""
    counts = [5, 0, 11, 16]
    x, ws, dy = _problem(counts, seed=3)
    got = _run(grouped_mm_swiglu, x, ws, counts, dy)
    loop = moe.GroupedSwiGLUKernel()  # the loop kernel itself (apply_split never takes the grouped path)
    ref = _run(lambda x_, c, *w: apply_split(loop, list(c), x_, *w), x, ws, counts, dy)
    mags = swiglu_magnitudes(x, counts, *ws, dy)
    scale = 2 * (6 + sum(counts) + 64 + 32) * 2.0**-24
    for a, b, m in zip(got, ref, mags):
        assert bool(((a.double() - b.double()).abs() <= scale * m).all())


def test_expert_kernel_selection(monkeypatch):
    cuda = torch.device("cuda")
    assert expert_kernel(torch.device("cpu"), torch.bfloat16, 64, 32)[0] == "loop"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert expert_kernel(cuda, torch.bfloat16, 7168, 2048) == ("grouped_mm", "torch.nn.functional.grouped_mm on sm90")
    assert expert_kernel(cuda, torch.float32, 7168, 2048)[0] == "loop"  # documented for BF16 only
    kind, why = expert_kernel(cuda, torch.bfloat16, 100, 2048)
    assert kind == "loop" and "multiples of 8" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    assert expert_kernel(cuda, torch.bfloat16, 7168, 2048)[0] == "loop"
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert "no torch.nn.functional.grouped_mm" in expert_kernel(cuda, torch.bfloat16, 7168, 2048)[1]


def test_grouped_swiglu_dispatches_by_kernel(monkeypatch):
    """`moe.grouped_swiglu` (what GroupedExperts calls) takes the grouped path exactly when `expert_kernel` says so."""
    calls = []

    def spy(*a, **k):
        calls.append(1)
        return gme.grouped_mm_swiglu(*a, **k)

    counts = [4, 0, 6]
    x, ws, dy = _problem(counts)
    monkeypatch.setattr(moe, "grouped_mm_swiglu", spy)
    y_loop = moe.grouped_swiglu(x, counts, *ws)
    assert not calls
    monkeypatch.setattr(moe, "expert_kernel", lambda *a: ("grouped_mm", "forced"))
    y_grouped = moe.grouped_swiglu(x, counts, *ws)
    assert calls
    m = swiglu_magnitudes(x, counts, *ws, torch.ones_like(dy))[0]
    assert bool(((y_grouped.double() - y_loop.double()).abs() <= 2 * (6 + 10 + 64 + 32) * 2.0**-24 * m).all())
