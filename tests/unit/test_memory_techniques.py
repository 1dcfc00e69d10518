"""The activation-memory techniques the memory plan counts on (report §3.2.3, §3.3.3): each one keeps less for
backward (measured with saved-tensor hooks) and leaves losses and gradients unchanged — bit for bit where the
op sequence is the same, within a derived bound where it is not."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within, gamma, reorder_bound

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.moe.layer import GroupedExperts, GroupedSwiGLUKernel, combine_rows, swiglu_rows
from dsv3_plugin.model.moe.router import fp32_linear
from dsv3_plugin.precision.fp8.experts import Fp8ExpertKernel, Fp8SwiGLUAct
from dsv3_plugin.precision.fp8.linear import EmulatedBackend, Fp8Linear, Fp8Recipe
from dsv3_plugin.precision.fp8.quant import dequantize_tilewise
from dsv3_plugin.training.recompute import MODES, apply_recompute, saved_activation_bytes
from dsv3_plugin.training.transforms import build_model


def _saved(fn, params=()):
    holder = torch.nn.ParameterList([p for p in params])
    return saved_activation_bytes(holder, fn)


def test_recompute_bit_identical_with_fp8():
    """FP8 on: recompute (norms and MLA up-projections freed and recomputed, full layers) gives the very losses
    and gradients of no recompute, and keeps less."""
    cfg = DSv3Config.from_block({"preset": "tiny", "fp8": {"enabled": True}})
    m = build_model(cfg)
    m.reset_parameters(seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=g)
    lab = torch.roll(ids, -1, 1)
    res, saved = {}, {}
    for mode in MODES:
        mm = copy.deepcopy(m)
        apply_recompute(mm, mode)
        saved[mode] = saved_activation_bytes(mm, lambda: mm(ids, lab).loss)
        out = mm(ids, lab)
        out.loss.backward()
        res[mode] = (out.loss.detach(), {n: p.grad for n, p in mm.named_parameters()})
    for mode in ("norm_and_mla_up", "full"):
        assert torch.equal(res[mode][0], res["none"][0])
        assert all(torch.equal(res[mode][1][n], res["none"][1][n]) for n in res["none"][1]), mode
    assert saved["full"] < saved["norm_and_mla_up"] < 0.8 * saved["none"]


def test_combine_rows_and_fp32_router_linear_are_autograd_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(40, 16, generator=g, requires_grad=True)
    idx = torch.randint(0, 9, (40,), generator=g)
    dout = torch.randn(9, 16, generator=g)
    ref = torch.zeros(9, 16).index_add_(0, idx, y)
    ref.backward(dout)
    ref_grad, y.grad = y.grad, None
    out = combine_rows(y, idx, 9)
    out.backward(dout)
    assert torch.equal(out, ref) and torch.equal(y.grad, ref_grad)
    assert _saved(lambda: combine_rows(y * 1, idx, 9)) == idx.numel() * 8  # only the index
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(33, 64, generator=g).to(dt).requires_grad_()
        w = (0.02 * torch.randn(8, 64, generator=g)).requires_grad_()
        dy = torch.randn(33, 8, generator=g)
        F.linear(x.float(), w.float()).backward(dy)
        gx, gw = x.grad, w.grad
        x.grad = w.grad = None
        fp32_linear(x, w).backward(dy)
        assert torch.equal(x.grad, gx) and torch.equal(w.grad, gw)
        # keeps x as given (2 bytes per element in BF16), not an FP32 copy
        assert _saved(lambda: fp32_linear(x * 1, w), [w]) == x.numel() * x.element_size()


def _experts(kernel, T=48, H=64, I=32, E=4, K=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = GroupedExperts(E, H, I, kernel)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    x = torch.randn(T, H, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    gates = torch.rand(T, K, generator=g).requires_grad_()
    dy = torch.randn(T, H, generator=g)
    return ex, x, idx, gates, dy


class _ScaleAfter(GroupedSwiGLUKernel):
    row_scale = False  # the routing weight multiplies the expert outputs afterwards (the old order)


def test_routing_weight_before_down_projection():
    """w2(s·SwiGLU(x)) instead of s·w2(SwiGLU(x)): the same math in another order (the product with s moves
    inside the length-I reduction of W2), so outputs and gradients agree within the reordering bound; the
    k expert-output rows per token are no longer kept."""
    ex, x, idx, gates, dy = _experts(GroupedSwiGLUKernel())
    ref_ex = copy.deepcopy(ex)
    ref_ex.kernel = _ScaleAfter()
    outs = []
    for e in (ex, ref_ex):
        x.grad = gates.grad = None
        y = e(x, idx, gates)
        y.backward(dy)
        outs.append((y.detach(), x.grad.clone(), gates.grad.clone(), [p.grad.clone() for p in e.parameters()]))
    (y, dx, dg, dw), (y0, dx0, dg0, dw0) = outs
    I, H = ex.gate_proj.shape[1], ex.gate_proj.shape[2]
    mag = float(y0.abs().max()) + 1.0
    assert_within(y, y0, reorder_bound(I, mag, stages=2), "expert output")
    assert_within(dx, dx0, reorder_bound(max(I, H), float(dx0.abs().max()) + 1.0, stages=3), "dx")
    assert_within(dg, dg0, reorder_bound(max(I, H), float(dg0.abs().max()) + 1.0, stages=3), "d gate")
    for a, b in zip(dw, dw0):
        assert_within(a, b, reorder_bound(x.shape[0], float(b.abs().max()) + 1.0, stages=3), "dW")
    # memory: no k·H rows of expert outputs
    kept = _saved(lambda: ex(x, idx, gates), list(ex.parameters()))
    kept_old = _saved(lambda: ref_ex(x, idx, gates), list(ref_ex.parameters()))
    assert kept_old - kept == idx.numel() * H * 4


def test_fp8_experts_routing_weight_gradient():
    """FP8 experts with the weight before W2: d gate = <W2ᵀ dy, h>, h the SwiGLU output recomputed from the FP8
    caches of g and u (unscaled), W2ᵀ dy the FP8 Dgrad — rebuilt here from the recipe's own quantizers; the
    two differ only by float32 rounding order in the length-I dot product and the SiLU."""
    r, be = Fp8Recipe(), EmulatedBackend()
    ex, x, idx, gates, dy = _experts(Fp8ExpertKernel(r, be), T=64, H=128, I=128, E=1, K=1)
    ex(x, idx, gates).backward(dy)
    with torch.no_grad():
        xq = r.act(x)
        g = be.gemm(*xq, *r.weight(ex.gate_proj[0]))
        u = be.gemm(*xq, *r.weight(ex.up_proj[0]))
        h = F.silu(dequantize_tilewise(*r.act(g)[:2])) * dequantize_tilewise(*r.act(u)[:2])
        qw2, sw2, kw2 = r.weight(ex.down_proj[0])
        dh = be.gemm(*r.act(dy), qw2.t(), sw2.t(), kw2)
        want = (dh * h).sum(-1)
    assert_within(gates.grad[:, 0], want, reorder_bound(128, (dh.abs() * h.abs()).sum(-1), stages=2), "FP8 d gate")
    assert not torch.allclose(want, want * gates.detach()[:, 0])  # the check can see a stray s


def test_fp8_weights_requantized_in_backward_bit_identical():
    """A parameter is kept by reference and re-quantized in backward: the same bytes as the FP8 copy a
    non-parameter weight keeps, so gradients are identical; nothing weight-sized is kept per micro-batch."""
    g = torch.Generator().manual_seed(3)
    lin = Fp8Linear(256, 128, bias=False)
    with torch.no_grad():
        lin.weight.copy_(0.05 * torch.randn(128, 256, generator=g))
    x = torch.randn(4, 64, 256, generator=g, requires_grad=True)
    dy = torch.randn(4, 64, 128, generator=g)
    lin(x).backward(dy)
    ref = (x.grad.clone(), lin.weight.grad.clone())
    x.grad = lin.weight.grad = None
    w_view = lin.weight * 1.0  # not a leaf: its FP8 copy is kept
    y = lin.kernel(x, w_view)
    y.backward(dy)
    assert torch.equal(x.grad, ref[0]) and torch.equal(lin.weight.grad, ref[1])
    kept = _saved(lambda: lin(x), [lin.weight])
    assert kept == 256 * 256 + 4 * 256 * 2  # Xᵀ in FP8 (M = 256 tokens) + 1×128 scales, no weight


def test_fp8_linears_share_one_input_cache():
    """Two FP8 Linears reading one tensor keep one FP8 Xᵀ, and their gradients are those of separate copies."""
    g = torch.Generator().manual_seed(4)
    a, b = Fp8Linear(256, 64, bias=False), Fp8Linear(256, 32, bias=False)
    x = torch.randn(128, 256, generator=g, requires_grad=True)
    da, db = torch.randn(128, 64, generator=g), torch.randn(128, 32, generator=g)
    (a(x) * da).sum().add((b(x.clone()) * db).sum()).backward()
    ref = (x.grad.clone(), a.weight.grad.clone(), b.weight.grad.clone())
    x.grad = a.weight.grad = b.weight.grad = None
    (a(x) * da).sum().add((b(x) * db).sum()).backward()
    assert torch.equal(x.grad, ref[0]) and torch.equal(a.weight.grad, ref[1]) and torch.equal(b.weight.grad, ref[2])
    one = 256 * 128 + 4 * 256
    assert _saved(lambda: (a(x), b(x)), [a.weight, b.weight]) == one
    assert _saved(lambda: (a(x), b(x.clone())), [a.weight, b.weight]) == 2 * one


def test_fp8_swiglu_activation():
    """Dense / shared-expert SwiGLU on the FP8 path: the forward value is silu(g)·u exactly; the backward is
    the exact derivative at the FP8-cached g̃, ũ (float32 reordering only); g and u kept at 1 byte."""
    g0 = torch.Generator().manual_seed(5)
    g = torch.randn(64, 256, generator=g0, requires_grad=True)
    u = torch.randn(64, 256, generator=g0, requires_grad=True)
    da = torch.randn(64, 256, generator=g0)
    act = Fp8SwiGLUAct(Fp8Recipe())
    a = act(g, u)
    assert torch.equal(a, F.silu(g) * u)
    a.backward(da)
    qg, sg, _ = Fp8Recipe().act(g.detach())
    qu, su, _ = Fp8Recipe().act(u.detach())
    gq = dequantize_tilewise(qg, sg).requires_grad_()
    uq = dequantize_tilewise(qu, su).requires_grad_()
    (F.silu(gq) * uq).backward(da)
    # a few float32 roundings per element (sigmoid, products) on terms of size |da|·(|u|+1)·(|g|+1)
    mag = da.abs() * (uq.detach().abs() + 1) * (gq.detach().abs() + 1)
    assert_within(g.grad, gq.grad, gamma(8) * mag, "dg")
    assert_within(u.grad, uq.grad, gamma(8) * mag, "du")
    assert _saved(lambda: act(g * 1, u * 1)) == 2 * (64 * 256 + 4 * 64 * 2)


@pytest.mark.parametrize("fp8", [False, True])
def test_experts_stacked_from_per_expert_parameters_keep_no_copy(fp8):
    """DeepSpeed's layout (one parameter per expert, stacked each call): the kernels slice the parameters in
    backward instead of keeping the stack (BF16) or its FP8 blocks per micro-batch; gradients are those of the
    stacked-parameter layout, bit for bit."""
    kernel = Fp8ExpertKernel(Fp8Recipe()) if fp8 else GroupedSwiGLUKernel()
    ex, x, idx, gates, dy = _experts(kernel, T=64, H=128, I=128, E=4, K=2)
    per = [
        [torch.nn.Parameter(w[e].detach().clone()) for e in range(4)] for w in (ex.gate_proj, ex.up_proj, ex.down_proj)
    ]
    rows = x.detach()[:64].repeat(2, 1).requires_grad_()
    expert_N = idx.reshape(-1)[:128]
    dy_rows = dy.repeat(2, 1)
    y0 = swiglu_rows(rows, expert_N, ex.gate_proj, ex.up_proj, ex.down_proj, kernel)
    y0.backward(dy_rows)
    ref = (rows.grad.clone(), [w.grad.clone() for w in (ex.gate_proj, ex.up_proj, ex.down_proj)])
    rows.grad = None
    y1 = swiglu_rows(rows, expert_N, *(torch.stack(p) for p in per), kernel)
    y1.backward(dy_rows)
    assert torch.equal(y0, y1) and torch.equal(rows.grad, ref[0])
    for w_ref, ps in zip(ref[1], per):
        assert all(torch.equal(p.grad, w_ref[e]) for e, p in enumerate(ps))
    flat = [p for ps in per for p in ps]
    stacked = _saved(lambda: swiglu_rows(rows, expert_N, *(torch.stack(p) for p in per), kernel), flat)
    leaf = _saved(
        lambda: swiglu_rows(rows, expert_N, ex.gate_proj, ex.up_proj, ex.down_proj, kernel), list(ex.parameters())
    )
    assert stacked == leaf  # no weight-sized tensor kept either way


@pytest.mark.parametrize("dedup", [False, True])
def test_expert_parallel_path_sends_the_routing_weight_with_the_rows(dedup):
    """The expert-parallel MoE (here over one rank: the all-to-alls are identities) applies the routing weight
    inside the experts too: it keeps no more for backward than the single-process layer, and computes the same
    output and gradients (the same kernels on the same rows; rows are grouped in another order, which only
    reorders the combine's sum over a token's k slots)."""
    from dsv3_plugin.model.moe.layer import DeepSeekMoE
    from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE
    from dsv3_plugin.parallel.groups import single_process_groups

    cfg = DSv3Config.from_block({"preset": "tiny"})
    torch.manual_seed(0)
    moe = DeepSeekMoE(cfg.model.hidden_size, cfg.moe)
    ep = ExpertParallelMoE.from_dense(moe, single_process_groups(), dedup=dedup)
    x = torch.randn(2, 16, cfg.model.hidden_size, requires_grad=True)
    dy = torch.randn_like(x)
    outs = []
    for m in (moe, ep):
        x.grad = None
        y = m(x)
        y.backward(dy)
        outs.append((y.detach(), x.grad.clone(), m.gate.weight.grad.clone()))
    K = cfg.moe.top_k
    for a, b, what in zip(outs[1], outs[0], ("y", "dx", "d router")):
        assert_within(a, b, reorder_bound(K, float(b.abs().max()) + 1.0, stages=2), what)
    kept_ep = _saved(lambda: ep(x), list(ep.parameters()))
    kept_sp = _saved(lambda: moe(x), list(moe.parameters()))
    rows = x.shape[0] * x.shape[1] * K
    assert kept_ep <= kept_sp + 8 * rows * 2  # at most a couple of index vectors more
