"""Grouped expert computation (sorted rows, per-expert GEMMs into preallocated slices, hand-written backward)
against autograd over the plain per-expert formula."""
import pytest
import torch
import torch.nn.functional as F

from dsv3_plugin.moe import GroupedExperts, grouped_swiglu, swiglu_rows


def _weights(E, I, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True) for s in ((E, I, H), (E, I, H), (E, H, I))]


def test_gradcheck_with_empty_experts():
    counts = [2, 0, 3, 1, 0]
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    w = _weights(5, 3, 5, torch.double)
    assert torch.autograd.gradcheck(lambda *a: grouped_swiglu(a[0], counts, *a[1:]), (x, *w))


@pytest.mark.parametrize("presorted", [False, True])
def test_matches_plain_autograd_fp32(presorted):
    E, I, H, N = 6, 8, 12, 40
    w = _weights(E, I, H, torch.float32, seed=1)
    x = torch.randn(N, H, requires_grad=True)
    e = torch.randint(0, E - 1, (N,))                   # the last expert gets no rows
    if presorted:                                       # the no-sort fast path (EP = 1)
        e = e.sort().values
    gy = torch.randn(N, H)
    y = swiglu_rows(x, e, *w)
    got = torch.autograd.grad((y * gy).sum(), (x, *w))
    ref = torch.stack([F.linear(F.silu(F.linear(x[n], w[0][e[n]])) * F.linear(x[n], w[1][e[n]]), w[2][e[n]])
                       for n in range(N)])
    want = torch.autograd.grad((ref * gy).sum(), (x, *w))
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(got[1][E - 1]) == 0        # unused expert: exact zero gradient


def test_grouped_experts_forward_and_no_rows():
    ge = GroupedExperts(4, 6, 5)
    x = torch.randn(7, 6)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    gates = torch.rand(7, 2)
    out = ge(x, idx, gates)
    ref = sum(gates[:, k, None] * torch.stack([F.linear(F.silu(F.linear(x[t], ge.gate_proj[idx[t, k]])) *
                                                         F.linear(x[t], ge.up_proj[idx[t, k]]), ge.down_proj[idx[t, k]])
                                                for t in range(7)]) for k in range(2))
    assert torch.allclose(out, ref, atol=1e-6)
    assert grouped_swiglu(x[:0], [0, 0, 0, 0], ge.gate_proj, ge.up_proj, ge.down_proj).shape == (0, 6)


def test_bench_pair_is_the_same_layer_as_transformers():
    """`dsv3 bench moe` compares like with like: same outputs and gradients at a small shape."""
    from dsv3_plugin.bench.moe import build_pair
    ours, theirs, x = build_pair(tokens=48, hidden=32, ffn=16, experts=8, top_k=4, groups=4, topk_group=2)
    gy = torch.randn_like(x)
    outs = []
    for m in (ours, theirs):
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(gy)
        outs.append((y.detach(), xi.grad))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-5)
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-5)
    assert torch.allclose(ours.experts.down_proj.grad, theirs.experts.down_proj.grad, atol=1e-5)
