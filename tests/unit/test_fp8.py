"""FP8 quantizers and the FP8 Linear against DeepSeek-V3's reference semantics (report §3.3, `act_quant`,
`weight_dequant`, `fp8_gemm`)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerance import assert_within, fp8_error, matmul_bound, perturbed_matmul_bound, reorder_bound, unit_roundoff

from dsv3_plugin.config import ConfigError, FP8Config
from dsv3_plugin.precision.fp8.linear import Fp8Linear, Fp8Recipe, fp8_linear, select_backend, te_recipe_spec
from dsv3_plugin.precision.fp8.quant import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_blockwise,
    dequantize_tilewise,
    fp8_gemm_emulated,
    fp8_grouped_gemm_emulated,
    lowprec_gemm,
    pack_dispatch,
    quantize_blockwise,
    quantize_dispatch,
    quantize_tensorwise,
    quantize_tilewise,
    truncate_mantissa,
    unpack_dispatch,
    widen_fp8,
)


def _ref_act_quant(x, pow2=False):
    """Naive per-tile loop written from the reference kernel's description (independent of the vectorised code)."""
    M, K = x.shape
    Kc = math.ceil(K / 128)
    q = torch.empty(M, K, dtype=FP8_DTYPE)
    s = torch.empty(M, Kc)
    for i in range(M):
        for c in range(Kc):
            seg = x[i, c * 128 : (c + 1) * 128].float()
            amax = max(seg.abs().max().item(), 1e-4)
            sc = torch.tensor(amax, dtype=torch.float32) / torch.tensor(448.0)
            if pow2:  # smallest power of two >= sc, exactly (math.frexp: sc = m·2^e, 0.5 <= m < 1)
                m, e = math.frexp(sc.item())
                sc = torch.tensor(2.0 ** (e - 1 if m == 0.5 else e))
            s[i, c] = sc
            q[i, c * 128 : (c + 1) * 128] = (seg / sc).clamp(-448, 448).to(FP8_DTYPE)
    return q, s


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t


# ---------------------------------------------------------------------------------------------- quantizers
def test_zero_tile_gives_clamped_scale_and_no_nan():
    x = torch.zeros(3, 256)
    x[1, 128:] = torch.linspace(-2, 2, 128)
    q, s = quantize_tilewise(x)
    assert s.shape == (3, 2)
    assert torch.all(s[0] == torch.tensor(AMAX_EPS) / FP8_MAX)  # all-zero tile: amax clamped to 1e-4
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all()
    assert torch.equal(dequantize_tilewise(q, s)[0], torch.zeros(256))
    assert s[1, 1] == torch.tensor(2.0) / 448  # scale = amax / 448


def test_tiny_values_use_amax_clamp():
    x = torch.full((1, 128), 1e-6)
    q, s = quantize_tilewise(x)
    assert s.item() == (torch.tensor(AMAX_EPS) / FP8_MAX).item()  # the same float32 division
    v = 1e-6 / (1e-4 / 448)  # 4.48: not pushed to 448
    assert abs(q.float().max().item() - v) <= unit_roundoff(FP8_DTYPE) * v  # one E4M3 rounding


def test_exact_values_and_max_maps_to_448():
    x = torch.tensor([[896.0, -448.0, 2.0, 0.0] + [0.0] * 124])
    q, s = quantize_tilewise(x)
    assert s.item() == 2.0
    assert q.float()[0, :4].tolist() == [448.0, -224.0, 1.0, 0.0]


def test_ue8m0_scales_are_powers_of_two_ceiling():
    torch.manual_seed(0)
    x = torch.randn(7, 300) * torch.logspace(-3, 3, 7)[:, None]
    q, s = quantize_tilewise(x, pow2=True)
    m, e = torch.frexp(s)
    assert torch.all(m == 0.5)  # exact powers of two
    _, s_plain = quantize_tilewise(x)
    assert torch.all(s >= s_plain) and torch.all(s < 2 * s_plain)  # 2^ceil(log2 s)
    assert q.float().abs().max() <= FP8_MAX


def test_ragged_tiles_and_blocks():
    torch.manual_seed(1)
    x = torch.randn(5, 200)
    x[:, 150] = 1000.0  # outlier in the short last tile only
    q, s = quantize_tilewise(x)
    assert s.shape == (5, 2) and torch.all(s[:, 1] == torch.tensor(1000.0) / 448)
    assert torch.all(s[:, 0] < 1.0)  # first tile unaffected
    w = torch.randn(576, 200)  # kv_a_proj-like ragged rows
    w[570, 199] = -50.0
    qw, sw = quantize_blockwise(w)
    assert sw.shape == (5, 2) and qw.shape == (576, 200)
    assert sw[4, 1] == torch.tensor(50.0) / 448
    assert torch.all(sw[:4] < 1.0) and sw[4, 0] < 1.0
    # weight_dequant: y[i, j] = q[i, j] * s[i // 128, j // 128], checked element-wise on a sample
    y = dequantize_blockwise(qw, sw)
    for i, j in [(0, 0), (127, 128), (128, 127), (575, 199), (300, 150)]:
        assert y[i, j] == qw[i, j].float() * sw[i // 128, j // 128]


@settings(max_examples=25, deadline=None)
@given(
    M=st.integers(1, 4),
    K=st.integers(1, 300),
    pow2=st.booleans(),
    scale=st.sampled_from([1e-5, 1.0, 1e4]),
    seed=st.integers(0, 2**16),
)
def test_tilewise_matches_reference_bitwise_and_roundtrip_bound(M, K, pow2, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * scale
    q, s = quantize_tilewise(x, pow2=pow2)
    rq, rs = _ref_act_quant(x, pow2)
    assert torch.equal(s, rs)
    assert torch.equal(_bits(q), _bits(rq))
    # E4M3: 3 mantissa bits -> |err| <= |x|·2^-4 for normals, <= half the subnormal step 2^-9 · s otherwise
    err = (dequantize_tilewise(q, s) - x).abs()
    s_full = s.repeat_interleave(128, -1)[:, :K]
    assert torch.all(err <= x.abs() * 2.0**-4 + s_full * 2.0**-10)


@settings(max_examples=15, deadline=None)
@given(N=st.integers(1, 300), K=st.integers(1, 300), pow2=st.booleans(), seed=st.integers(0, 2**16))
def test_blockwise_roundtrip_bound(N, K, pow2, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    q, s = quantize_blockwise(w, pow2=pow2)
    assert s.shape == (math.ceil(N / 128), math.ceil(K / 128))
    blocks_amax = (
        torch.nn.functional.pad(w.abs(), (0, -K % 128, 0, -N % 128))
        .reshape(s.shape[0], 128, s.shape[1], 128)
        .amax((1, 3))
    )
    # s = fl(amax / 448), then fl(s·448) and the right side's product each round once: (1 − u)² vs (1 + u)
    assert torch.all(s * FP8_MAX >= blocks_amax.clamp(min=AMAX_EPS) * (1 - 4 * unit_roundoff()))
    err = (dequantize_blockwise(q, s) - w).abs()
    s_full = s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert torch.all(err <= w.abs() * 2.0**-4 + s_full * 2.0**-10)


def test_fine_grained_beats_tensorwise_on_outlier_channels():
    """Activations whose token norms span 10^±1.5 with outlier channels ×1000 (report Fig. 7's motivation):
    per-tensor scaling pushes the small tokens into E4M3's subnormal range, 1×128 tiles do not."""
    torch.manual_seed(0)
    x = torch.randn(256, 1024) * torch.logspace(-1.5, 1.5, 256)[:, None]
    x[:, 7::256] *= 1000.0
    keep = torch.ones(1024, dtype=torch.bool)
    keep[7::256] = False

    def per_token_rel(y):  # mean over tokens of the relative error on the ordinary channels
        return ((y - x)[:, keep].norm(dim=1) / x[:, keep].norm(dim=1)).mean().item()

    q, s = quantize_tilewise(x)
    qt, st_ = quantize_tensorwise(x)
    e_tile, e_tensor = per_token_rel(dequantize_tilewise(q, s)), per_token_rel(qt.float() * st_)
    # per tile, values in E4M3's normal range are within u = 2^-4 relative, and the few that a tile's outlier
    # pushes below it are off by <= half a subnormal step (2^-10 of the scale), negligible in a token's norm:
    # so <= u per token. One tensor scale sends whole small tokens to subnormals, far beyond that.
    u8 = unit_roundoff(FP8_DTYPE)
    assert e_tile <= u8 and e_tensor > 5 * e_tile, (e_tile, e_tensor)
    qb, sb = quantize_blockwise(x)
    assert per_token_rel(dequantize_blockwise(qb, sb)) < e_tensor


# ---------------------------------------------------------------------------------------------- GEMM
def test_per_128_promotion_beats_single_low_precision_accumulation():
    torch.manual_seed(0)
    K = 4096
    a = torch.rand(4, K) + 0.5
    b = torch.rand(4, K) + 0.5
    qa, sa = quantize_tilewise(a)
    qb, sb = quantize_tilewise(b)
    exact = dequantize_tilewise(qa, sa).double() @ dequantize_tilewise(qb, sb).double().t()
    promoted = fp8_gemm_emulated(qa, sa, qb, sb, "tile", "tile", acc_mantissa_bits=13)
    single = lowprec_gemm(dequantize_tilewise(qa, sa), dequantize_tilewise(qb, sb), 13, promote_every=None)
    e_prom = ((promoted.double() - exact).abs() / exact.abs()).max().item()
    e_single = ((single.double() - exact).abs() / exact.abs()).max().item()
    # A 13-bit accumulator that truncates loses < 2^-13 of the running sum per add, so a promoted 128-term
    # chunk of positive terms is within gamma_128 = 128·2^-13/(1 − 128·2^-13) of exact (Higham's bound
    # with 2^-13 for u); the single accumulation shows the report's "nearly 2%" at K = 4096.
    t = 128 * 2.0**-13
    assert e_single > 1e-2 and e_prom <= t / (1 - t) and e_single > 50 * e_prom, (e_single, e_prom)
    # promotion every 128 in the same low-precision accumulator also removes most of the error
    chunked = lowprec_gemm(dequantize_tilewise(qa, sa), dequantize_tilewise(qb, sb), 13, promote_every=128)
    assert ((chunked.double() - exact).abs() / exact.abs()).max().item() < e_single / 10


def test_truncate_mantissa():
    x = torch.tensor([1.0 + 2**-5 + 2**-20, -3.999])
    assert truncate_mantissa(x, 23).tolist() == x.tolist()
    assert truncate_mantissa(x, 5)[0].item() == 1.0 + 2**-5
    assert truncate_mantissa(x, 1)[1].item() == -3.0  # toward zero


def _deq_tile(t):
    q, s = quantize_tilewise(t)
    return dequantize_tilewise(q, s)


def _tile_err(t, pow2=False):
    """fp8_error of t's 1×128 tiles (along its last dim) at their scales, elementwise."""
    _, s = quantize_tilewise(t, pow2=pow2)
    return fp8_error(t, s.repeat_interleave(128, -1)[:, : t.shape[1]])


def _block_err(w, pow2=False):
    """fp8_error of w's 128×128 blocks at their scales, elementwise."""
    _, s = quantize_blockwise(w, pow2=pow2)
    return fp8_error(w, s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]])


def test_fp8_linear_uses_the_right_tile_orientation_per_gemm():
    """Fprop/Dgrad/Wgrad equal FP32 GEMMs of the dequantized operands, each quantized along its own K."""
    torch.manual_seed(0)
    x = torch.randn(3, 100, 200, requires_grad=True)  # M = 300 tokens (ragged 128-tiles)
    w = (torch.randn(150, 200) * 0.05).requires_grad_()
    dy = torch.randn(3, 100, 150)
    y = fp8_linear(x, w)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 200), dy.reshape(-1, 150)
    qw, sw = quantize_blockwise(w.detach())
    w_deq = dequantize_blockwise(qw, sw)
    y_ref = _deq_tile(x2) @ w_deq.t()
    dx_ref = _deq_tile(dy2) @ w_deq  # dY 1×128 along N, W 128×128
    dw_ref = _deq_tile(dy2.t()) @ _deq_tile(x2.t()).t()  # both 1×128 along M (tokens)
    # the same FP8 operands on both sides; only the FP32 accumulation order differs (per-128 promotion vs
    # one matmul): the GEMM bound on the dequantized operands
    operands = {
        "Fprop": (_deq_tile(x2), w_deq.t()),
        "Dgrad": (_deq_tile(dy2), w_deq),
        "Wgrad": (_deq_tile(dy2.t()), _deq_tile(x2.t()).t()),
    }
    for (name, (a, b)), got, ref in zip(
        operands.items(), (y.detach().reshape(-1, 150), x.grad.reshape(-1, 200), w.grad), (y_ref, dx_ref, dw_ref)
    ):
        assert_within(got, ref, matmul_bound(a, b), f"{name}: fp8_linear vs FP32 GEMM of the same FP8 operands")
    # a wrong orientation (quantizing dY for Wgrad along N instead of M) is different beyond that noise
    wrong = _deq_tile(dy2).t() @ _deq_tile(x2)
    assert ((wrong - dw_ref).abs() > matmul_bound(*operands["Wgrad"])).any()


def test_fp8_linear_within_fp8_error_of_fp32_and_bf16_io():
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)
    w = (torch.randn(192, 256) * 0.05).requires_grad_()
    g = torch.randn(64, 192)
    y = fp8_linear(x, w)
    (y * g).sum().backward()
    gx, gw = x.grad, w.grad
    x32, w32 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y32 = x32 @ w32.t()
    (y32 * g).sum().backward()
    # FP8 vs FP32, elementwise: each GEMM's two operands carry their E4M3 cast error (1×128 tiles along the
    # reduction for activations and gradients, 128×128 blocks for the weight) into the product
    xd, wd = x.detach(), w.detach()
    cases = {
        "y": (y, y32, xd, _tile_err(xd), wd.t(), _block_err(wd).t()),
        "dx": (gx, x32.grad, g, _tile_err(g), wd, _block_err(wd)),
        "dw": (gw, w32.grad, g.t(), _tile_err(g.t()), xd, _tile_err(xd.t()).t()),
    }
    for name, (got, ref, a, da, b, db) in cases.items():
        assert_within(got, ref, perturbed_matmul_bound(a, da, b, db), f"{name}: FP8 vs FP32 GEMM")
        # ... and really quantized: beyond FP32 reordering somewhere
        assert ((got - ref).abs() > matmul_bound(a, b)).any(), name
    assert w.grad.dtype == torch.float32  # FP32 master weight gradient
    yb = fp8_linear(x.detach().bfloat16(), w.detach())
    assert yb.dtype == torch.bfloat16


def test_tensorwise_recipe_runs_and_pow2_changes_scales():
    torch.manual_seed(0)
    x = torch.randn(16, 256, requires_grad=True)
    w = (torch.randn(32, 256) * 0.05).requires_grad_()
    y = fp8_linear(x, w, Fp8Recipe("tensorwise"))
    y.sum().backward()
    (_, sx), (_, sw) = quantize_tensorwise(x.detach()), quantize_tensorwise(w.detach())  # one scale each
    xd, wd = x.detach(), w.detach()
    assert_within(
        y,
        xd @ wd.t(),
        perturbed_matmul_bound(xd, fp8_error(xd, sx), wd.t(), fp8_error(wd, sw).t()),
        "tensorwise FP8 GEMM vs FP32",
    )
    y2 = fp8_linear(x, w, Fp8Recipe("blockwise", pow2=True))
    assert not torch.equal(y2, fp8_linear(x, w, Fp8Recipe("blockwise", pow2=False)))


def test_fp8_linear_module_keeps_parameters_and_names():
    lin = torch.nn.Linear(64, 32, bias=True)
    f = Fp8Linear.from_linear(lin, Fp8Recipe(), None)
    assert f.weight is lin.weight and f.bias is lin.bias
    assert list(f.state_dict()) == ["weight", "bias"]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    wd = lin.weight.detach()
    bound = perturbed_matmul_bound(x, _tile_err(x), wd.t(), _block_err(wd).t()) + reorder_bound(1, lin.bias.abs())
    assert_within(f(x), lin(x), bound, "Fp8Linear vs nn.Linear (+ bias in FP32)")


# ---------------------------------------------------------------------------------------------- backends, TE
def test_backend_selection_on_cpu_is_reported_emulation():
    b, why = select_backend(FP8Config(), "cpu")
    assert b.name == "emulate" and "te:" in why and "torch:" in why
    with pytest.raises(ConfigError, match=r"dsv3\.fp8\.backend"):
        select_backend(FP8Config(backend="te"), "cpu")
    with pytest.raises(ConfigError, match=r"dsv3\.fp8\.backend"):
        select_backend(FP8Config(backend="torch"), "cpu")


TE_BLOCK_FIELDS = {
    "fp8_format",
    "fp8_quant_fwd_inp",
    "fp8_quant_fwd_weight",
    "fp8_quant_bwd_grad",
    "x_block_scaling_dim",
    "w_block_scaling_dim",
    "grad_block_scaling_dim",
}


def test_te_recipe_spec_matches_deepseek_defaults():
    name, f = te_recipe_spec(FP8Config(pow2_scales=True))
    assert name == "Float8BlockScaling" and set(f) == TE_BLOCK_FIELDS
    assert (f["x_block_scaling_dim"], f["w_block_scaling_dim"], f["grad_block_scaling_dim"]) == (1, 2, 1)
    assert f["fp8_format"] == "E4M3" and f["fp8_quant_bwd_grad"] == {"power_2_scale": True, "amax_epsilon": 1e-4}
    assert te_recipe_spec(FP8Config(recipe="tensorwise"))[0] == "Float8CurrentScaling"


# ---------------------------------------------------------------------------------------------- dispatch payload
def test_dispatch_payload_roundtrip_pow2():
    torch.manual_seed(0)
    x = torch.randn(6, 200).bfloat16()
    p = pack_dispatch(x)
    assert p.dtype == torch.uint8 and p.shape == (6, 200 + 4 * 2)
    q, s = quantize_dispatch(x)
    assert torch.all(torch.frexp(s)[0] == 0.5)
    y = unpack_dispatch(p, 200)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, dequantize_tilewise(q, s, dtype=torch.bfloat16))
    assert torch.equal(unpack_dispatch(p[3:5], 200), y[3:5])  # rows split independently
    with pytest.raises(ValueError, match="unpack_dispatch"):
        unpack_dispatch(p[:, :-1], 200)


def test_dispatch_qdq_autograd_and_idempotence():
    from dsv3_plugin.precision.fp8.quant import dequantize_dispatch, fp8_combine_grad_qdq, fp8_dispatch_qdq

    torch.manual_seed(0)
    x = (torch.randn(9, 300) * torch.logspace(-3, 3, 9)[:, None]).requires_grad_()
    y = fp8_dispatch_qdq(x)
    q, s = quantize_dispatch(x.detach())
    assert torch.equal(y, dequantize_dispatch(q, s, torch.float32))
    assert torch.equal(fp8_dispatch_qdq(y.detach()), y.detach())  # pow2: re-quantizing is exact
    g = torch.randn(9, 300)
    y.backward(g)
    assert torch.equal(x.grad, g)  # dispatch backward: BF16, untouched
    z = x.detach().clone().requires_grad_()
    out = fp8_combine_grad_qdq(z)
    assert torch.equal(out, z)  # combine forward: untouched
    out.backward(g)
    qg, sg = quantize_dispatch(g)
    assert torch.equal(z.grad, dequantize_dispatch(qg, sg, torch.float32))


def test_torch_backend_layouts_pass_torch_checks():
    """cuBLAS-only blockwise GEMMs cannot run on CPU; torch's meta kernels still validate our operand and
    scale shapes for all three GEMM kinds, and the tensorwise path runs on CPU against the emulation."""
    from dsv3_plugin.precision.fp8.linear import EmulatedBackend, TorchScaledMMBackend

    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(40, 200, generator=g), torch.randn(136, 200, generator=g), torch.randn(40, 136, generator=g)
    r, tb = Fp8Recipe(), TorchScaledMMBackend()
    qw, sw, kw = r.weight(w)
    cases = {
        (40, 136): (r.act(x), (qw, sw, kw)),
        (40, 200): (r.act(dy), (qw.t(), sw.t(), kw)),
        (136, 200): (r.act(dy.t()), r.act(x.t())),
    }
    meta = lambda ops: tuple(t.to("meta") if torch.is_tensor(t) else t for t in ops)  # noqa: E731
    for shape, (a, b) in cases.items():
        assert tuple(tb.gemm(*meta(a), *meta(b)).shape) == shape
    tw = Fp8Recipe("tensorwise")
    a, b = tw.act(x), tw.weight(w)
    ref = EmulatedBackend().gemm(*a, *b)
    # the same FP8 operands: torch accumulates q·q then scales, the emulation scales then accumulates:
    # K = 200 terms plus 3 roundings for the scaling, on |a_deq| @ |b_deq|
    a_deq, b_deq = a[0].float() * a[1], b[0].float() * b[1]
    assert_within(
        tb.gemm(*a, *b),
        ref,
        reorder_bound(200 + 3, a_deq.abs() @ b_deq.abs().t()),
        "torch _scaled_mm (tensorwise) vs emulated GEMM",
    )


def test_no_fp8_activation_cache_without_grad():
    from dsv3_plugin.training.recompute import saved_activation_bytes

    lin = Fp8Linear(256, 128, bias=False)
    x = torch.randn(64, 256)
    with torch.no_grad():
        y0 = lin(x)
    y1 = lin(x)
    assert torch.equal(y0, y1) and y0.grad_fn is None
    saved = saved_activation_bytes(lin, lambda: lin(x))  # Xᵀ FP8 cache + FP8 weight for Dgrad
    lin.weight.requires_grad_(False)
    saved_no_wgrad = saved_activation_bytes(lin, lambda: lin(x.requires_grad_()))
    assert saved - saved_no_wgrad == 64 * 256 + 4 * 256  # 1 byte/elem + one fp32 scale per 128


def test_widen_fp8_is_the_conversion_bit_for_bit():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE)  # every E4M3 code, NaNs included
    want = codes.float()
    assert torch.equal(widen_fp8(codes).view(torch.int32), want.view(torch.int32))
    q = codes[torch.randperm(256, generator=torch.Generator().manual_seed(0))].reshape(16, 16)
    for t in (q, q.t(), q[:, ::2]):  # contiguous, transposed (layout kept), other strides
        assert torch.equal(widen_fp8(t).view(torch.int32), t.float().view(torch.int32))
    assert widen_fp8(q.t()).stride() == q.t().float().stride()


@pytest.mark.parametrize("O, K", [(136, 200), (256, 128)])  # ragged blocks; O a multiple of 128
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_emulated_gemm_is_one_emulated_gemm_per_expert_bit_for_bit(O, K, transpose):
    g = torch.Generator().manual_seed(1)
    E, counts = 4, [3, 0, 7, 2]
    q = torch.empty(E, O, K, dtype=FP8_DTYPE)
    s = torch.empty(E, math.ceil(O / 128), math.ceil(K / 128))
    for e in range(E):
        q[e], s[e] = quantize_blockwise(torch.randn(O, K, generator=g) * (e + 1))
    aq, sa = quantize_tilewise(torch.randn(sum(counts), O if transpose else K, generator=g))
    spans = [(0, 0, 3), (2, 3, 10), (3, 10, 12)]
    got = fp8_grouped_gemm_emulated(aq, sa, spans, q, s, transpose=transpose)
    for e, a, b in spans:
        w, ws = (q[e].t(), s[e].t()) if transpose else (q[e], s[e])
        assert torch.equal(got[a:b], fp8_gemm_emulated(aq[a:b], sa[a:b], w, ws))
    assert torch.equal(fp8_grouped_gemm_emulated(widen_fp8(aq), sa, spans, q, s, transpose=transpose), got)
    with pytest.raises(ValueError, match="cover"):
        fp8_grouped_gemm_emulated(aq, sa, spans[:2], q, s, transpose=transpose)
