"""Single-process checks of the dispatch module: EP=1 path against the plain formula, copy counting, codecs."""

import pytest
import torch
from tolerance import assert_within, reorder_bound

from dsv3_plugin.parallel.dispatch import BF16Codec, count_cross_node_copies, moe_dispatch_combine

E, H, K = 8, 5, 3


def _setup(T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(E, H, H, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K]
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
    return W, x, idx, w


def _expert(W):
    return lambda x_NH, e_N: torch.tanh(torch.bmm(x_NH.unsqueeze(1), W[e_N]).squeeze(1))


def _formula(x, W, idx, w, act=torch.tanh):
    return (act(torch.einsum("th,tkhj->tkj", x, W[idx])) * w[..., None]).sum(1)


def _envelope(x, W, idx, w, loss=None):
    """Magnitudes of the terms every forward/backward sum adds: the formula on |inputs| with tanh -> identity
    (|tanh z| <= |z|, |tanh'| <= 1), float64; with `loss`, also its gradients w.r.t. (W, x, w)."""
    xa, Wa, wa = (t.detach().abs().double().requires_grad_(True) for t in (x, W, w))
    out = _formula(xa, Wa, idx, wa, act=lambda z: z)
    return out.detach() if loss is None else torch.autograd.grad(loss(out), (Wa, xa, wa))


@pytest.mark.parametrize("dedup", [False, True])
def test_ep1_matches_formula(dedup):
    W, x, idx, w = _setup()
    out, st = moe_dispatch_combine(x, idx, w, _expert(W), E, dedup=dedup)
    ref = _formula(x, W, idx, w)
    # Reordered (float64): per-row bmm vs einsum (K = H = 5), and the k-sum by index_add_ vs .sum(1) (K = 3):
    # 2 reductions forward; the gradients of Σ out² add the backward bmm/einsum, the reduction of dW over
    # tokens (T = 10) and the k-broadcast: 5 deep.
    assert_within(
        out,
        ref,
        reorder_bound(H, _envelope(x, W, idx, w), torch.float64, stages=2),
        f"EP=1 dispatch vs formula (dedup={dedup})",
    )
    g1 = torch.autograd.grad(out.square().sum(), (W, x, w))
    g2 = torch.autograd.grad(ref.square().sum(), (W, x, w))
    env = _envelope(x, W, idx, w, loss=lambda o: o.square().sum())
    for name, a, b, m in zip(("dW", "dx", "dw"), g1, g2, env):
        assert_within(a, b, reorder_bound(10, m, torch.float64, stages=5), f"EP=1 dispatch {name} vs formula")
    assert st.cross_node_copies == 0 and st.tokens == 10 and st.copies == 10 * K


def test_bf16_codec_forward_rounds_backward_straight_through():
    W, x, idx, w = _setup()
    out, _ = moe_dispatch_combine(x, idx, w, _expert(W), E, codec=BF16Codec())
    xq = x.detach().to(torch.bfloat16).to(x.dtype)
    ref = _formula(xq, W, idx, w)
    # experts saw the bf16-rounded payload: float64 reordering only (as above), the rounding is the same
    bound = reorder_bound(H, _envelope(xq, W, idx, w), torch.float64, stages=2)
    assert_within(out, ref, bound, "BF16 payload dispatch vs formula on bf16-rounded x")
    assert ((out - _formula(x, W, idx, w)).abs() > bound).any()  # ... and not the unrounded one
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert gx.abs().sum() > 0


def test_count_cross_node_copies_by_hand():
    # E=8 over EP=4 ranks, 2 ranks per node: experts 0-3 on node 0 (ranks 0,1), 4-7 on node 1 (ranks 2,3).
    idx = torch.tensor([[4, 5, 6], [0, 2, 5], [0, 1, 3]])
    # per-expert from rank 0: row0 3 cross; row1: 5 cross, 2 -> rank 1 intra; row2: 3 -> rank 1 intra
    assert count_cross_node_copies(idx, 8, 4, 2, src_rank=0, dedup=False) == (4, 2)
    # dedup: rows 0 and 1 cross once each
    assert count_cross_node_copies(idx, 8, 4, 2, src_rank=0, dedup=True) == (2, 0)
    # from rank 3 (node 1): row2 crosses once; row1 once; row0 stays
    assert count_cross_node_copies(idx, 8, 4, 2, src_rank=3, dedup=True) == (2, 0)


def test_shape_mismatch_is_an_error():
    W, x, idx, w = _setup()
    with pytest.raises(ValueError, match="disagree"):
        moe_dispatch_combine(x, idx, w[:, :2], _expert(W), E)


def test_fp8_dispatch_codec_from_config():
    """`fp8.dispatch = true` selects the FP8 payload codec: FP8-rounded activations reach the experts and the
    gradient flows straight through; a build without the FP8 quantizer refuses the key by name."""
    from dsv3_plugin.config import ConfigError, DSv3Config
    from dsv3_plugin.parallel.dispatch import FP8Codec, codec_from_config

    cfg = DSv3Config.from_block({"preset": "tiny", "fp8": {"enabled": True, "dispatch": True}})
    assert codec_from_config(DSv3Config.from_block({"preset": "tiny"})) is None
    try:
        from dsv3_plugin.precision.fp8 import quant as fp8

        have = hasattr(fp8, "pack_dispatch")
    except ImportError:
        have = False
    if not have:
        with pytest.raises(ConfigError, match=r"^dsv3\.fp8\.dispatch"):
            codec_from_config(cfg)
        return
    codec = codec_from_config(cfg)
    assert isinstance(codec, FP8Codec)
    W, x, idx, w = _setup()
    x32 = x.detach().float().requires_grad_(True)
    W32 = W.detach().float()
    out, st = moe_dispatch_combine(x32, idx, w.detach().float(), _expert(W32), E, codec=codec)
    xq = fp8.unpack_dispatch(fp8.pack_dispatch(x32.detach()), H, torch.float32)
    ref = _formula(xq, W32, idx, w.detach().float())
    # the experts saw exactly the FP8-rounded payload; float32 reordering of bmm/einsum and the k-sum remains
    assert_within(
        out,
        ref,
        reorder_bound(H, _envelope(xq, W32, idx, w), stages=2),
        "FP8 payload dispatch vs formula on the decoded payload",
    )
    assert not torch.equal(xq, x32.detach())  # the payload really was quantized
    (gx,) = torch.autograd.grad(out.sum(), x32)
    assert gx.abs().sum() > 0
    assert codec.bytes_per_row(H, 4) == H + 4  # H bytes of FP8 + one fp32 scale per 128
