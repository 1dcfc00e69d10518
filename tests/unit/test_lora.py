"""LoRA on a frozen base (`training.lora`, `precision.fp8.frozen`, `checkpoint.frozen_base`): the adapted model
with B = 0 is the base exactly, the frozen FP8 GEMMs use the stored blocks and stay within the FP8 emulation's
bound of the dequantized weight, adapter gradients match a dense reference, nothing else trains, and a released
directory loads into FP8 storage without a dequantized copy."""

import json
import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_within, fp8_error, matmul_bound, perturbed_matmul_bound, reorder_bound

from dsv3_plugin.checkpoint.frozen_base import base_fingerprint, load_frozen_base
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.config import ConfigError, DSv3Config, FP8Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.moe.layer import GroupedExperts
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.parallel.pipeline.weight_grad import WeightGradQueue, split_weight_grads
from dsv3_plugin.precision.fp8.frozen import FrozenFp8Experts, FrozenFp8Gemm, FrozenFp8Linear, freeze_fp8
from dsv3_plugin.precision.fp8.linear import EmulatedBackend, Fp8Recipe
from dsv3_plugin.precision.fp8.quant import (
    FP8_DTYPE,
    dequantize_blockwise,
    fp8_gemm_emulated,
    quantize_blockwise,
    quantize_tilewise,
)
from dsv3_plugin.training.lora import (
    adapter_names,
    apply_lora,
    bias_update_speed,
    check_lora_checkpoint,
    lora_checkpoint_state,
    lora_model_config,
    lora_scale,
)
from dsv3_plugin.training.transforms import build_model

GEMM = FrozenFp8Gemm(Fp8Recipe(), EmulatedBackend())


def _cfg(fp8=True, **lora):
    return DSv3Config.from_block(
        {"preset": "tiny", "fp8": {"enabled": fp8}, "lora": {"rank": 4, "experts": True, **lora}}
    )


def _frozen_linear(O, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(O, K, generator=g) * 0.05
    lin = torch.nn.Linear(K, O, bias=False)
    lin.weight.data.copy_(w)
    return FrozenFp8Linear.from_linear(lin, GEMM)


def _ids(cfg, B=2, T=12, seed=1):
    return torch.randint(0, cfg.model.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ (a) B = 0


@pytest.mark.parametrize("fp8", [True, False])
def test_zero_b_gives_the_base_logits_exactly(fp8):
    cfg = _cfg(fp8)
    torch.manual_seed(0)
    base = DSv3Model(cfg)
    if fp8:
        freeze_fp8(base, cfg.fp8)
    torch.manual_seed(0)
    adapted = build_model(cfg)
    assert adapted.lora_report.experts and adapted.lora_report.linear
    ids = _ids(cfg)
    with torch.no_grad():
        want = base(ids).logits
    got = adapted(ids).logits  # with grad: the adapter nodes run (B = 0 adds exact zeros)
    if fp8:  # the same FP8 GEMMs in the same order, plus zeros
        assert torch.equal(got, want)
    else:
        # NOTE: the plain experts' kernel (GroupedSwiGLUKernel) and LoRAExpertKernel order the same products
        # differently (GEMM blocking); everything else is the same op sequence.
        assert_within(got, want, reorder_bound(cfg.model.vocab_size, want.abs().max(), stages=20), "logits")


# ------------------------------------------------------------------------------------------------ (b) FP8 GEMMs


def test_frozen_fp8_linear_uses_the_stored_blocks_and_is_within_the_fp8_bound():
    O, K, M = 136, 200, 6  # ragged: 2x2 blocks, the last ones partial
    lin = _frozen_linear(O, K)
    q, s = lin.weight, lin.weight_scale_inv
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (2, 2)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(2), requires_grad=True)
    y = lin(x)
    # the very GEMM of the emulation on the stored bytes (nothing re-quantized)
    assert torch.equal(y, fp8_gemm_emulated(*quantize_tilewise(x.detach()), q, s))
    W = dequantize_blockwise(q, s).double()  # the dequantized base
    sx = quantize_tilewise(x.detach())[1]
    dx_in = fp8_error(x, sx.repeat_interleave(128, -1)[:, :K])  # 1x128 activation tiles
    assert_within(y, x.double() @ W.t(), perturbed_matmul_bound(x, dx_in, W.t(), 0), "frozen FP8 Fprop")
    dy = torch.randn(M, O, generator=torch.Generator().manual_seed(3))
    y.backward(dy)
    sdy = quantize_tilewise(dy)[1]
    ddy = fp8_error(dy, sdy.repeat_interleave(128, -1)[:, :O])
    assert_within(x.grad, dy.double() @ W, perturbed_matmul_bound(dy, ddy, W, 0), "frozen FP8 Dgrad")


def test_frozen_fp8_experts_use_the_stored_blocks():
    E, H, I, N = 3, 64, 40, 9
    ex = GroupedExperts(E, H, I)
    FrozenFp8Experts.freeze(ex, GEMM)
    assert not list(ex.parameters()) and ex.gate_proj.dtype == FP8_DTYPE
    counts = [4, 0, 5]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(4))
    r = torch.rand(N, generator=torch.Generator().manual_seed(5))
    y = ex.kernel(x, counts, ex.gate_proj, ex.up_proj, ex.down_proj, scale_N=r)

    def mm(a, name, e):  # one emulated FP8 GEMM against expert e's stored blocks
        return fp8_gemm_emulated(*quantize_tilewise(a), getattr(ex, name)[e], getattr(ex, name + "_scale_inv")[e])

    want = torch.empty_like(y)
    for e, a, b in ((0, 0, 4), (2, 4, 9)):
        h = F.silu(mm(x[a:b], "gate_proj", e)) * mm(x[a:b], "up_proj", e) * r[a:b, None]
        want[a:b] = mm(h, "down_proj", e)
    assert torch.equal(y, want)


def test_frozen_storage_survives_dtype_casts_and_has_no_high_precision_copy():
    cfg = _cfg(True)
    torch.manual_seed(0)
    m = build_model(cfg)
    before = {n: b.clone() for n, b in m.named_buffers() if b.dtype == FP8_DTYPE}
    m.bfloat16()
    fp8 = {n: b for n, b in m.named_buffers() if b.dtype == FP8_DTYPE}
    assert set(fp8) == set(before) and all(
        torch.equal(fp8[n].view(torch.uint8), before[n].view(torch.uint8)) for n in fp8
    )
    assert all(b.dtype == torch.float32 for n, b in m.named_buffers() if n.endswith("_scale_inv"))
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == set(adapter_names(m))
    # no decoder-layer GEMM weight is a parameter any more: the frozen base is the FP8 bytes only
    for n, p in m.named_parameters():
        if n.startswith("layers.") and "lora_" not in n:
            assert n.endswith(("layernorm.weight", "gate.weight")), n


# ------------------------------------------------------------------------------------------------ (c) gradients


def test_linear_adapter_gradients_match_a_dense_reference():
    cfg = _cfg(True, dropout=0.0, alpha=12.0, use_rslora=True)
    s = lora_scale(cfg.lora)
    assert s == 12.0 / 2.0  # alpha / sqrt(r)
    O, K, M = 136, 200, 7
    lin = _frozen_linear(O, K)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].o_proj = lin
    apply_lora(model, cfg, dtype=torch.float32)
    with torch.no_grad():
        lin.lora_B.normal_(0, 0.1, generator=torch.Generator().manual_seed(6))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(7), requires_grad=True)
    dy = torch.randn(M, O, generator=torch.Generator().manual_seed(8))
    lin(x).backward(dy)
    A, B = lin.lora_A.detach().double().requires_grad_(), lin.lora_B.detach().double().requires_grad_()
    W = dequantize_blockwise(lin.weight, lin.weight_scale_inv).double()
    xd = x.detach().double()
    (xd @ W.t() + s * (xd @ A.t()) @ B.t()).backward(dy.double())
    # the adapters' gradients do not depend on the base (y = Wx + z): fp32 vs fp64, two GEMMs each
    t = xd @ A.detach().t()
    assert_within(lin.lora_B.grad, B.grad, s * matmul_bound(dy.t(), t, torch.float32, stages=2), "dL/dB")
    dt = s * dy.double() @ B.detach()
    assert_within(lin.lora_A.grad, A.grad, matmul_bound(dt.t(), xd, torch.float32, stages=2), "dL/dA")


def _dense_experts(x, counts, mm, ad, s, r):
    """Autograd reference of the adapted experts: mm(x, k, e) = x·W_kᵀ of expert e (k: 0 gate, 1 up, 2 down),
    ad = (A1, B1, A3, B3, A2, B2)."""
    A1, B1, A3, B3, A2, B2 = ad
    out, a = [], 0
    for e, n in enumerate(counts):
        xe = x[a : a + n]
        g = mm(xe, 0, e) + s * (xe @ A1[e].t()) @ B1[e].t()
        u = mm(xe, 1, e) + s * (xe @ A3[e].t()) @ B3[e].t()
        h = F.silu(g) * u * r[a : a + n, None]
        out.append(mm(h, 2, e) + s * (h @ A2[e].t()) @ B2[e].t())
        a += n
    return torch.cat(out)


class _FrozenMm(torch.autograd.Function):
    """x·Wᵀ by the frozen FP8 GEMMs (Fprop, and Dgrad in backward): the kernel's own base, as a reference op."""

    @staticmethod
    def forward(ctx, x, q, s):
        ctx.qs = (q, s)
        return GEMM.fwd(x, q, s)

    @staticmethod
    def backward(ctx, dy):
        return GEMM.dgrad(dy, *ctx.qs), None, None


@pytest.mark.parametrize("fp8", [False, True])
def test_expert_adapter_gradients_match_a_dense_reference(fp8):
    cfg = _cfg(fp8, dropout=0.0)
    s = lora_scale(cfg.lora)
    E, H, I, N = 3, 64, 40, 10
    ex = GroupedExperts(E, H, I)
    if fp8:
        FrozenFp8Experts.freeze(ex, GEMM)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].experts = ex
    apply_lora(model, cfg, dtype=torch.float32)
    names = [f"{k}_lora_{ab}" for k in ("w1", "w3", "w2") for ab in "AB"]
    with torch.no_grad():
        for i, n in enumerate(names[1::2]):
            getattr(ex, n).normal_(0, 0.1, generator=torch.Generator().manual_seed(20 + i))
    counts = [6, 0, 4]
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(9), requires_grad=True)
    r = torch.rand(N, generator=torch.Generator().manual_seed(10))
    dy = torch.randn(N, H, generator=torch.Generator().manual_seed(11))
    ex.kernel(x, counts, ex.gate_proj, ex.up_proj, ex.down_proj, scale_N=r).backward(dy)
    ws = ("gate_proj", "up_proj", "down_proj")
    if fp8:
        # NOTE: the reference runs the kernel's own FP8 GEMMs (same calls on the same operands: the same FP8
        # products); what differs is the high-precision SwiGLU / adapter arithmetic around them, in fp32 on both
        # sides, and no FP8 rounding lies on the path from those to the adapters' gradients.
        qs = [(ex.get_buffer(n), ex.get_buffer(n + "_scale_inv")) for n in ws]
        dtype, ad = torch.float32, [getattr(ex, n).detach().clone().requires_grad_() for n in names]

        def mm(a, k, e):
            return _FrozenMm.apply(a, qs[k][0][e], qs[k][1][e])
    else:
        w = [getattr(ex, n).detach().double() for n in ws]
        dtype, ad = torch.float64, [getattr(ex, n).detach().double().requires_grad_() for n in names]

        def mm(a, k, e):
            return a @ w[k][e].t()

    xd = x.detach().to(dtype).requires_grad_()
    _dense_experts(xd, counts, mm, ad, s, r.to(dtype)).backward(dy.to(dtype))
    # the layer's reductions (gate/up, down, adapters, their backward) are at most max(H, I, N) long;
    # 16 stages per pass (REDUCTIONS_PER_BLOCK) x 2 passes covers the longest path
    K = max(H, I, N)
    for n, ref in zip(names, ad):
        got = getattr(ex, n).grad
        assert got is not None and got[1].abs().max() == 0  # expert 1 had no rows
        assert_within(got, ref.grad, reorder_bound(K, ref.grad.abs().max(), stages=32), f"dL/d{n}")
    if not fp8:  # (with FP8 the input gradient's Dgrad quantizes dL/dg, which differs in its last bits)
        assert_within(x.grad, xd.grad, reorder_bound(K, xd.grad.abs().max(), stages=32), "dL/dx")


# ------------------------------------------------------------------------------------------------ (d) frozen, W split


def test_frozen_base_takes_no_grad_and_the_w_split_defers_only_the_adapters():
    cfg = _cfg(True)
    torch.manual_seed(0)
    m = build_model(cfg)
    split_weight_grads(m)
    ids = _ids(cfg)
    q = WeightGradQueue()
    with q.deferring("mb0"):
        m(ids, labels=ids).loss.backward()
    adapters = set(adapter_names(m))
    # B = 0: dA = 0 and dB = s·dzᵀ·t, both deferred; every adapter of a layer that ran is a W op
    assert all(p.grad is None for n, p in m.named_parameters() if n in adapters)
    assert q.pop("mb0") > 0
    got = {n for n, p in m.named_parameters() if p.grad is not None}
    assert got == adapters
    assert all(not p.requires_grad for n, p in m.named_parameters() if n not in adapters)
    assert any(m.get_parameter(n).grad.abs().max() > 0 for n in adapters if n.endswith("lora_B"))


def test_lora_honours_targets_and_experts():
    torch.manual_seed(0)
    m = build_model(_cfg(True, targets=["q_a_proj", "down_proj"], experts=False))
    names = set(adapter_names(m))
    assert names and all(".q_a_proj." in n or ".down_proj." in n for n in names)
    assert not any(".experts." in n for n in names) and not any(n.startswith("mtp.") for n in names)
    torch.manual_seed(0)
    m2 = build_model(_cfg(True, targets=["up_proj"], experts=True))
    ex = {n for n in adapter_names(m2) if ".experts." in n}
    assert ex and all(n.rsplit(".", 1)[1] in ("w3_lora_A", "w3_lora_B") for n in ex)
    A = m2.get_parameter(sorted(ex)[0])
    assert A.shape == (cfg_experts := m2.cfg.moe.n_routed_experts, 4, m2.cfg.model.hidden_size)
    # peft's Kaiming-uniform(a = sqrt(5)) A: bound 1/sqrt(fan_in), per expert its own draw
    assert A.abs().max() <= 1 / math.sqrt(A.shape[2]) and not torch.equal(A[0], A[cfg_experts - 1])


def test_config_refuses_targets_naming_no_module():
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        DSv3Config.from_block({"preset": "tiny", "lora": {"targets": []}})


def test_frozen_fp8_needs_the_blockwise_recipe():
    with pytest.raises(ConfigError, match="blockwise"):
        freeze_fp8(DSv3Model(DSv3Config.from_block({"preset": "tiny"})), FP8Config(enabled=True, recipe="tensorwise"))


# ------------------------------------------------------------------------------------------------ loading


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_tiny_release(tmp_path_factory.mktemp("lora_release") / "ckpt", fp8=True)


def test_released_fp8_base_loads_into_frozen_storage_as_stored(release):
    from dsv3_plugin.checkpoint.reader import CheckpointReader

    m = load_frozen_base(release, fp8={"enabled": True}, lora={"rank": 4, "experts": True})
    with CheckpointReader(release) as r:
        q, s = r.get_fp8("model.layers.1.self_attn.q_a_proj.weight")
        assert torch.equal(m.layers[1].self_attn.q_a_proj.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(m.layers[1].self_attn.q_a_proj.weight_scale_inv, s)
        q5, s5 = r.get_fp8("model.layers.2.mlp.experts.5.down_proj.weight")
        assert torch.equal(m.layers[2].mlp.experts.down_proj[5].view(torch.uint8), q5.view(torch.uint8))
        assert torch.equal(m.layers[2].mlp.experts.down_proj_scale_inv[5], s5)
        assert torch.equal(m.embed_tokens.weight, r.get("model.embed_tokens.weight", torch.float32))
    assert m.base_fingerprint == base_fingerprint(release) and m.base_fingerprint.startswith("sha256:")
    assert {n for n, p in m.named_parameters() if p.requires_grad} == set(adapter_names(m))
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(m(ids).logits).all()


def test_base_fingerprint_tells_apart_a_base_of_the_same_shapes(release, tmp_path):
    """Another fine-tune of the same architecture has the same headers: the fingerprint reads data too (the first
    bytes of every tensor, every scale whole)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dsv3_plugin.checkpoint.reader import CheckpointReader

    fp = base_fingerprint(release)
    assert fp == base_fingerprint(release)
    for name in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_a_proj.weight_scale_inv"):
        other = tmp_path / name.rsplit(".", 1)[-1]
        shutil.copytree(release, other)
        with CheckpointReader(release) as r:
            shard = other / os.path.basename(r.info(name).file)
        with safe_open(str(shard), "pt") as f:
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        flat_U8 = tensors[name].view(-1).view(torch.uint8)
        flat_U8[0] ^= 1  # one bit of the first element: same shapes and headers
        save_file(tensors, str(shard), metadata=meta)
        assert base_fingerprint(other) != fp, name


def test_loading_refuses_mismatched_tensors_and_an_fp8_release_without_fp8(release, tmp_path):
    with pytest.raises(ConfigError, match="fp8.enabled"):
        load_frozen_base(release, lora={"rank": 4})
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(release):
        if f != "config.json" and os.path.isfile(os.path.join(release, f)):
            shutil.copy(os.path.join(release, f), bad / f)
    hf = json.load(open(os.path.join(release, "config.json")))
    hf["moe_intermediate_size"] = hf["moe_intermediate_size"] * 2
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match=r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight"):
        load_frozen_base(bad, fp8={"enabled": True}, lora={"rank": 4})


def test_an_expert_parallel_rank_loads_its_experts_and_the_same_adapters(release):
    from dsv3_plugin.checkpoint.hf import pretrained_config
    from dsv3_plugin.training.rank_local import RankLayout

    over = {"fp8": {"enabled": True}, "lora": {"rank": 4, "experts": True}}
    full = load_frozen_base(release, **over)
    layout = RankLayout.of(lora_model_config(pretrained_config(release, **over)), ep_rank=1, ep=2)
    part = load_frozen_base(release, layout=layout, **over)
    a, b = full.layers[2].mlp.experts, part.layers[2].mlp.experts
    n = b.gate_proj.shape[0]
    assert n == a.gate_proj.shape[0] // 2 and b.expert_range.start == n
    for w in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(b.get_buffer(w).view(torch.uint8), a.get_buffer(w)[n:].view(torch.uint8))
        assert torch.equal(b.get_buffer(w + "_scale_inv"), a.get_buffer(w + "_scale_inv")[n:])
    for k in ("w1", "w3", "w2"):  # adapters drawn per global expert: the same on every layout
        assert torch.equal(getattr(b, k + "_lora_A"), getattr(a, k + "_lora_A")[n:])
    assert torch.equal(part.layers[0].self_attn.q_a_proj.lora_A, full.layers[0].self_attn.q_a_proj.lora_A)


def test_dropout_acts_on_the_adapter_branch_in_training_only():
    cfg = _cfg(True, dropout=0.5)
    torch.manual_seed(0)
    m = build_model(cfg)
    ids = _ids(cfg)
    with torch.no_grad():
        base = m(ids).logits  # B = 0: dropout on the branch changes nothing
        for n in adapter_names(m):
            if n.endswith("lora_B"):
                m.get_parameter(n).normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        m.train()
        t1, t2 = m(ids).logits, m(ids).logits
        m.eval()
        e1, e2 = m(ids).logits, m(ids).logits
    assert not torch.equal(t1, t2) and torch.equal(e1, e2) and not torch.equal(e1, base)
    m.train()
    torch.manual_seed(0)
    m(ids, labels=ids).loss.backward()
    assert all(m.get_parameter(n).grad is not None for n in adapter_names(m) if ".layers.0." in "." + n)


def test_recompute_keeps_the_adapters_gradients_bit_identical():
    grads = []
    for mode in ("none", "norm_and_mla_up"):
        cfg = DSv3Config.from_block(
            {
                "preset": "tiny",
                "fp8": {"enabled": True},
                "memory": {"recompute": mode},
                "lora": {"rank": 4, "experts": True, "dropout": 0.1},
            }
        )
        torch.manual_seed(0)
        m = build_model(cfg)
        with torch.no_grad():
            for n in adapter_names(m):
                if n.endswith("lora_B"):
                    m.get_parameter(n).normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        torch.manual_seed(5)
        m(_ids(cfg), labels=_ids(cfg)).loss.backward()
        grads.append({n: m.get_parameter(n).grad for n in adapter_names(m)})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_mtp_off_builds_no_mtp_and_frozen_trains_the_adapters_through_it():
    torch.manual_seed(0)
    off = build_model(_cfg(True))
    assert len(off.mtp) == 0 and off.cfg.mtp.depth == 0
    ids = _ids(off.cfg)
    out = off(ids, labels=ids)
    assert out.mtp_loss is None and not out.mtp_logits
    with pytest.raises(ConfigError, match=r"lora\.mtp"):
        apply_lora(DSv3Model(_cfg(True)), _cfg(True))
    torch.manual_seed(0)
    fr = build_model(_cfg(True, mtp="frozen"))
    assert len(fr.mtp) == 1 and not any(p.requires_grad for p in fr.mtp.parameters())
    out = fr(ids, labels=ids)
    assert out.mtp_loss is not None
    out.mtp_loss.backward()  # the MTP loss alone reaches the main model's adapters through the frozen MTP layer
    assert any(p.grad is not None and p.grad.abs().max() > 0 for n, p in fr.named_parameters() if "lora_B" in n)


def test_bias_update_and_checkpoint_record():
    cfg = _cfg(True)
    assert bias_update_speed(cfg, 1e6) == 0.0
    cfg_b = _cfg(True, bias_update=True)
    assert bias_update_speed(cfg_b, 1e6) == cfg_b.moe.gamma(1e6)
    torch.manual_seed(0)
    m = build_model(cfg)
    st = lora_checkpoint_state(m)
    check_lora_checkpoint(m, st, "ckpt")
    with pytest.raises(CheckpointError, match="ckpt: adapters trained on base sha256:x"):
        check_lora_checkpoint(m, {**st, "base_fingerprint": "sha256:x"}, "ckpt")
    with pytest.raises(CheckpointError, match="ckpt: adapters differ"):
        check_lora_checkpoint(m, {**st, "adapters": st["adapters"][1:]}, "ckpt")
    with pytest.raises(CheckpointError, match="ckpt: no LoRA record"):
        check_lora_checkpoint(m, None, "ckpt")


def test_the_loader_takes_the_run_config_too(release):
    # the train path may hand over sections of `lora_model_config(cfg)` (mtp.depth 0): the release's MTP layer
    # is still checked against the release and not read
    m = load_frozen_base(release, fp8={"enabled": True}, lora={"rank": 4}, mtp={"depth": 0})
    assert len(m.mtp) == 0
    with pytest.raises(CheckpointError, match=r"model\.layers\.\d+\.\w+"):  # frozen MTP: depth must be the release's
        load_frozen_base(release, fp8={"enabled": True}, lora={"rank": 4, "mtp": "frozen"}, mtp={"depth": 0})


def test_freeze_reports_what_it_froze():
    torch.manual_seed(0)
    m = build_model(_cfg(True))
    rep = m.fp8_report
    assert rep.backend == "emulate" and "layers.1.mlp.experts" in rep.grouped
    assert "layers.0.self_attn.q_a_proj" in rep.converted and "lm_head" in rep.high_precision
    assert all(isinstance(m.get_submodule(n), FrozenFp8Linear) for n in rep.converted)


def test_a_bf16_release_stays_bf16_frozen_or_is_quantized_once_under_fp8(tmp_path):
    from dsv3_plugin.checkpoint.reader import CheckpointReader

    rel = write_tiny_release(tmp_path / "bf16", fp8=False)
    name, native = "model.layers.1.self_attn.q_b_proj.weight", "layers.1.self_attn.q_b_proj"
    with CheckpointReader(rel) as r:
        w = r.get(name, torch.float32)
    m = load_frozen_base(rel, dtype=torch.bfloat16, lora={"rank": 4})
    p = m.get_submodule(native).weight
    assert p.dtype == torch.bfloat16 and not p.requires_grad and torch.equal(p, w.bfloat16())
    m8 = load_frozen_base(rel, fp8={"enabled": True, "pow2_scales": True}, lora={"rank": 4})
    lin = m8.get_submodule(native)
    q, s = quantize_blockwise(w, 128, pow2=True)  # what the FP8 training path makes of it each call
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(lin.weight_scale_inv, s)


def test_frozen_fp8_experts_input_gradients_are_within_the_fp8_bound():
    """dx and dL/dr of frozen FP8 experts against float64 math on the dequantized weights, with g and u taken from
    the kernel's own forward GEMMs: the bound follows the backward's FP8 roundings (dy for W2's Dgrad, dL/dg and
    dL/du for W1's and W3's), each tile's scale bounded by its row's max."""
    E, H, I, N = 3, 64, 40, 9
    ex = GroupedExperts(E, H, I)
    FrozenFp8Experts.freeze(ex, GEMM)
    counts, spans = [4, 0, 5], ((0, 0, 4), (2, 4, 9))
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(4), requires_grad=True)
    r = torch.rand(N, generator=torch.Generator().manual_seed(5), requires_grad=True)
    dy = torch.randn(N, H, generator=torch.Generator().manual_seed(6))
    ex.kernel(x, counts, ex.gate_proj, ex.up_proj, ex.down_proj, scale_N=r).backward(dy)
    W = {n: [dequantize_blockwise(ex.get_buffer(n)[e], ex.get_buffer(n + "_scale_inv")[e]).double() for e in range(E)]
         for n in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip

    def fe(v, dv):  # FP8 rounding of v̂ (|v̂ - v| <= dv), tile scale <= its row's max / 448
        return fp8_error(v.abs() + dv, ((v.abs() + dv).amax(-1, keepdim=True) / 448).clamp(min=1e-4 / 448))

    for e, a, b in spans:
        xe = x.detach()[a:b]
        g = GEMM.fwd(xe, ex.gate_proj[e], ex.gate_proj_scale_inv[e]).double()  # the kernel's forward values
        u = GEMM.fwd(xe, ex.up_proj[e], ex.up_proj_scale_inv[e]).double()
        re, dye = r.detach()[a:b, None].double(), dy[a:b].double()
        sig = torch.sigmoid(g)
        dh = dye @ W["down_proj"][e]  # exact dL/d(r·h)
        ddh = perturbed_matmul_bound(dye, fe(dye, 0), W["down_proj"][e], 0)  # FP8 of dy
        silu_d = sig * (1 + g * (1 - sig))
        dg, du = dh * re * u * silu_d, dh * re * g * sig
        # + fp32 rounding of the few element-wise products (γ_8 relative, generous)
        ddg = ddh * (re * u * silu_d).abs() + reorder_bound(8, dg.abs())
        ddu = ddh * (re * g * sig).abs() + reorder_bound(8, du.abs())
        want = dg @ W["gate_proj"][e] + du @ W["up_proj"][e]
        bound = perturbed_matmul_bound(dg, ddg + fe(dg, ddg), W["gate_proj"][e], 0) + perturbed_matmul_bound(
            du, ddu + fe(du, ddu), W["up_proj"][e], 0
        )
        assert_within(x.grad[a:b], want, bound, f"expert {e} dL/dx")
        dr = (dh * F.silu(g) * u).sum(-1)
        dr_bound = (ddh * (F.silu(g) * u).abs()).sum(-1) + reorder_bound(
            I, (dh * F.silu(g) * u).abs().sum(-1), stages=2
        )
        assert_within(r.grad[a:b], dr, dr_bound, f"expert {e} dL/dr")
