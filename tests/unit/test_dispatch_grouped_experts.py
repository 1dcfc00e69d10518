"""Grouped expert computation (sorted rows, per-expert GEMMs into preallocated slices, hand-written backward)
against autograd over the plain per-expert formula."""

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within, reorder_bound

from dsv3_plugin.model.moe import layer as moe_layer
from dsv3_plugin.model.moe import padded_experts
from dsv3_plugin.model.moe.grouped_mm import swiglu_magnitudes
from dsv3_plugin.model.moe.layer import GroupedExperts, grouped_swiglu, swiglu_rows


def _weights(E, I, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True) for s in ((E, I, H), (E, I, H), (E, H, I))]


def test_gradcheck_with_empty_experts():
    counts = [2, 0, 3, 1, 0]
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    w = _weights(5, 3, 5, torch.double)
    assert torch.autograd.gradcheck(lambda *a: grouped_swiglu(a[0], counts, *a[1:]), (x, *w))


def _per_row(x, e, w1, w3, w2, act=F.silu):
    """The plain per-expert formula, one row at a time (the reference's summation order)."""
    return torch.stack(
        [F.linear(act(F.linear(x[n], w1[e[n]])) * F.linear(x[n], w3[e[n]]), w2[e[n]]) for n in range(x.shape[0])]
    )


def _envelope(x, e, w, gy):
    """Magnitudes of every term the forward and backward sum: the same formula on |inputs| with SiLU replaced
    by 1.1·h (|silu(h)| <= |h|, |silu'(h)| <= 1.1), in float64, so each intermediate and each gradient is
    the sum of the absolute values of the terms the real computation adds up."""
    xa = x.detach().abs().double().requires_grad_(True)
    wa = [t.detach().abs().double().requires_grad_(True) for t in w]
    ya = _per_row(xa, e, *wa, act=lambda h: 1.1 * h)
    return (ya.detach(), *torch.autograd.grad((ya * gy.abs().double()).sum(), (xa, *wa)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("presorted", [False, True])
def test_matches_plain_autograd_fp32(presorted, seed):
    E, I, H, N = 6, 8, 12, 40
    w = _weights(E, I, H, torch.float32, seed=1 + seed)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(N, H, generator=g).requires_grad_(True)
    e = torch.randint(0, E - 1, (N,), generator=g)  # the last expert gets no rows
    if presorted:  # the no-sort fast path (EP = 1)
        e = e.sort().values
    gy = torch.randn(N, H, generator=g)
    y = swiglu_rows(x, e, *w)
    got = torch.autograd.grad((y * gy).sum(), (x, *w))
    ref = _per_row(x, e, *w)
    want = torch.autograd.grad((ref * gy).sum(), (x, *w))
    # Reordered: per-expert GEMMs over sorted rows (blocked, any order) vs one F.linear per row, and the
    # hand-written backward's GEMMs vs autograd's. Longest reduction K = H = 12; the deepest value (dx)
    # passes through 4 reductions (W2ᵀgy, then W1ᵀ·, W3ᵀ· and their sum); magnitudes from the envelope.
    env = _envelope(x, e, w, gy)
    for name, a, b, m in zip(("y", "dx", "dw1", "dw3", "dw2"), (y, *got), (ref, *want), env):
        assert_within(
            a,
            b,
            reorder_bound(H, m, stages=4),
            f"grouped SwiGLU {name} vs per-row autograd "
            f"(expert GEMMs blocked differently, presorted={presorted}, seed={seed})",
        )
    assert torch.count_nonzero(got[1][E - 1]) == 0  # unused expert: exact zero gradient


def test_grouped_experts_forward_and_no_rows():
    torch.manual_seed(0)
    ge = GroupedExperts(4, 6, 5)
    x = torch.randn(7, 6)
    idx = torch.tensor([[0, 1], [1, 2], [0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    gates = torch.rand(7, 2)
    out = ge(x, idx, gates)
    w = (ge.gate_proj, ge.up_proj, ge.down_proj)
    ref = sum(gates[:, k, None] * _per_row(x, idx[:, k], *w) for k in range(2))
    # Reordered: grouped expert GEMMs (K <= 6) vs per-row F.linear, then the k = 2 gated sum by index_add_
    # vs in slot order: 3 reductions deep (W1/W3, W2, the k-sum); magnitude Σ_k g_k · envelope.
    mag = sum(gates[:, k, None].double() * _envelope(x, idx[:, k], w, torch.zeros(7, 6))[0] for k in range(2))
    assert_within(out, ref, reorder_bound(6, mag, stages=3), "GroupedExperts vs per-row formula")
    assert grouped_swiglu(x[:0], [0, 0, 0, 0], ge.gate_proj, ge.up_proj, ge.down_proj).shape == (0, 6)


@pytest.mark.parametrize("layout", ["rows", "rows_fused", "padded"])
def test_gradcheck_every_layout(monkeypatch, layout):
    """Every layout of the kernel's GEMMs is the exact derivative, routing weights (`scale_N`) and experts without
    rows included: float64 gradcheck, with the BF16/FP16 choices forced: per-expert GEMMs with gate and up as two
    GEMMs or one against [W1; W3] (g | u in one buffer), or batched GEMMs over the padded [E, C, ·] layout."""
    monkeypatch.setattr(moe_layer, "fuse_gate_up", lambda dtype: layout == "rows_fused")
    real = padded_experts.plan  # padded: C = 2, experts 0 and 2 overflow (3 rows > 2)
    monkeypatch.setattr(padded_experts, "plan", lambda d, c, dev: real(d, c, dev, C=2) if layout == "padded" else None)
    counts = [2, 0, 3, 1, 0]
    x = torch.randn(6, 5, dtype=torch.double, requires_grad=True)
    s = torch.rand(6, dtype=torch.double).requires_grad_(True)
    w = _weights(5, 3, 5, torch.double)
    kernel = moe_layer.GroupedSwiGLUKernel()
    assert torch.autograd.gradcheck(lambda *a: kernel(a[0], counts, *a[1:4], scale_N=a[4]), (x, *w, s))


def _stacked(ws):
    """DeepSpeed's layout: one parameter per expert, stacked each call (the kernel then slices the parameters)."""
    per_expert = [[p.detach().clone().requires_grad_(p.requires_grad) for p in w.unbind(0)] for w in ws]
    return [torch.stack(ps) for ps in per_expert], per_expert


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "per_expert_params"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_grads", [(True, True, True), (False, True, True)])
def test_loop_kernel_matches_float64(monkeypatch, dtype, layout, w_grads, padded):
    """The expert kernel in FP32 and in BF16 against float64 autograd on the same (rounded) operands, routing
    weights applied inside, an expert without rows; per-expert GEMMs (in BF16 gate and up as one GEMM:
    `fuse_gate_up`) or batched GEMMs over the padded layout (`padded_experts`, forced here: these counts pad 68
    rows for 32, past `PAD_LIMIT`); also with only some weight gradients asked for (the un-fused W for gate/up
    then) and DeepSpeed's per-expert parameters (stacked again in backward by the padded layout)."""
    real = padded_experts.plan  # padded: C = 9, expert 2 (17 rows) overflows into the rows after the [4, 9] block
    monkeypatch.setattr(padded_experts, "plan", lambda d, c, dev: real(d, c, dev, C=9) if padded else None)
    counts = [9, 0, 17, 6]
    E, I, H, N = len(counts), 16, 32, sum(counts)
    g = torch.Generator().manual_seed(7)
    # operands rounded to `dtype` first: the float64 reference sees what the kernel sees
    x = torch.randn(N, H, generator=g).to(dtype)
    ws = [(torch.randn(*sh, generator=g) * 0.1).to(dtype) for sh in ((E, I, H), (E, I, H), (E, H, I))]
    s = torch.rand(N, generator=g).clamp_min(0.05).to(dtype).float()  # routing weights in (0, 1], FP32 as routed
    dy = torch.randn(N, H, generator=g).to(dtype)
    xs = x.clone().requires_grad_(True)
    params = [w.clone().requires_grad_(need) for w, need in zip(ws, w_grads)]
    args, per_expert = (params, None) if layout == "stacked" else _stacked(params)
    y = moe_layer.GroupedSwiGLUKernel()(xs, counts, *args, scale_N=s)
    y.backward(dy)
    grads = [
        p.grad if per_expert is None else (torch.stack([q.grad for q in per_expert[i]]) if w_grads[i] else None)
        for i, p in enumerate(params)
    ]

    rx = x.double().requires_grad_(True)
    rw = [w.double().requires_grad_(True) for w in ws]
    outs, o = [], 0
    for e, n in enumerate(counts):
        xe = rx[o : o + n]
        outs.append((F.silu(xe @ rw[0][e].t()) * (xe @ rw[1][e].t()) * s[o : o + n, None].double()) @ rw[2][e].t())
        o += n
    ref_y = torch.cat(outs)
    ref = torch.autograd.grad((ref_y * dy.double()).sum(), (rx, *rw))
    mags = swiglu_magnitudes(x, counts, *ws, dy)  # |s| <= 1: the unscaled terms bound the scaled ones
    # Roundings on the longest path (dx, dW1): g|u, silu(g)·u... counted per stored intermediate in `dtype`:
    # g|u, da = dy·W2, da·s, da·u, silu'(g)·(da·u), the GEMM's output: <= 7 (y, dW2: 5), compounded; plus FP32
    # accumulation in every GEMM over at most N + H + 2I terms (dx's K = 2I when fused).
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    scale = (1 + unit) ** 7 - 1 + (N + H + 2 * I) * 2.0**-24
    for name, a, b, m in zip(("y", "dx", "dw1", "dw3", "dw2"), (y, xs.grad, *grads), (ref_y, *ref), mags):
        if a is None:
            continue
        assert a.dtype == dtype, name
        assert bool(((a.double() - b).abs() <= scale * m).all()), f"{name} ({dtype}, {layout}, {w_grads}, {padded})"
    for gw in grads:
        if gw is not None:
            assert torch.count_nonzero(gw[1]) == 0  # the expert without rows: exactly zero


def test_padded_plan_choice_and_rows():
    """BF16/FP16 only; C by the cost model, a multiple of BLOCK_GRANULE; each sorted row gets its own buffer row:
    e·C + j for row j < C of expert e, the overflow rows after the block, sorted by expert."""
    cpu = torch.device("cpu")
    assert padded_experts.BLOCK_GRANULE == 32
    even = [128, 120, 0, 136]
    p = padded_experts.plan(torch.bfloat16, even, cpu)
    assert p is not None and p.C == 160 and p.overflow == () and p.rows == 4 * 160
    assert padded_experts.plan(torch.float16, even, cpu).C == 160
    assert padded_experts.plan(torch.float32, even, cpu) is None
    assert padded_experts.plan(torch.bfloat16, [0, 0], cpu) is None
    skewed = [100] * 15 + [1000]  # one hot expert: its rows beyond the others' go to the overflow
    p = padded_experts.plan(torch.bfloat16, skewed, cpu)
    assert p.C == 128 and p.overflow == ((15, 2048, 2920),)
    p = padded_experts.plan(torch.float32, [3, 4, 0, 1], cpu, C=2)
    assert p.rows == 8 + 1 + 2 and p.overflow == ((0, 8, 9), (1, 9, 11))
    assert p.dst_N.tolist() == [0, 1, 8, 2, 3, 9, 10, 6]


def test_padded_layout_is_the_default_bf16_path_on_even_routing(monkeypatch):
    """Without forcing: BF16 rows spread evenly take the padded layout (its forward is called), FP32 does not."""
    calls = []
    real = padded_experts.forward
    monkeypatch.setattr(padded_experts, "forward", lambda *a: calls.append(1) or real(*a))
    counts = [5, 6, 5, 6]
    for dtype, want in ((torch.bfloat16, 1), (torch.float32, 0)):
        calls.clear()
        x = torch.randn(sum(counts), 8).to(dtype)
        w = [t.to(dtype) for t in _weights(4, 4, 8, torch.float32)]
        moe_layer.GroupedSwiGLUKernel()(x, counts, *w)
        assert len(calls) == want, dtype
