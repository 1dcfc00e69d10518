"""Router pitfalls of docs/facts.md §2, items 1-5, each against a literal reading of the paper."""

import torch
import torch.nn.functional as F
from tolerance import assert_within, reorder_bound

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.moe.balancing import maxvio, seq_balance_loss, update_expert_bias
from dsv3_plugin.model.moe.router import Router, group_limited_topk, skip_counting
from dsv3_plugin.model.mtp import mtp_depth_loss
from dsv3_plugin.training.transforms import build_model


def _router(**moe):
    cfg = DSv3Config.from_block({"preset": "tiny", "moe": moe})
    r = Router(8, cfg.moe)
    torch.nn.init.normal_(r.weight, std=1.0)
    return r, cfg.moe


# 1. Select with the bias, weight with the unbiased sigmoid; normalize over the selected k, then × scale.
def test_bias_only_selects_gates_use_unbiased_scores():
    r, m = _router(n_group=1, topk_group=1, top_k=2, n_routed_experts=4, route_scale=2.5)
    x = torch.randn(5, 8)
    s = torch.sigmoid(x @ r.weight.T)
    r.e_score_correction_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))  # forces experts {0, 1}
    out = r(x)
    assert sorted(out.topk_idx_TK[0].tolist()) == [0, 1] and all(sorted(t) == [0, 1] for t in out.topk_idx_TK.tolist())
    sel = s.gather(1, out.topk_idx_TK)
    expected = sel / sel.sum(-1, keepdim=True) * 2.5
    # Reordered: F.linear vs x @ Wᵀ (K = 8), then the same sigmoid/normalization (+1e-20 in the router).
    # A logit error δz moves s by <= σ'·δz <= δz/4; the gate s_k/Σs·2.5 then moves by <= g·(δs_k/s_k +
    # Σδs/Σs), plus <= 4 roundings of its own (sum, +1e-20, divide, scale).
    ds = reorder_bound(8, x.abs() @ r.weight.detach().abs().T).gather(1, out.topk_idx_TK) / 4
    g = expected.double().abs()
    bound = g * (ds / sel.double() + ds.sum(-1, keepdim=True) / sel.double().sum(-1, keepdim=True))
    assert_within(out.gates_TK, expected, bound + reorder_bound(4, g), "router gates vs the paper's formula")
    # normalized over the k, then scaled: the exact sum is 2.5; two gates of <= 4 roundings each, one add
    assert_within(out.gates_TK.sum(-1), torch.full((5,), 2.5), reorder_bound(5, 2.5), "Σ_k gates vs 2.5")
    # the bias never gets a gradient and is not a parameter
    assert "e_score_correction_bias" not in dict(r.named_parameters())
    out.gates_TK.sum().backward()
    assert r.weight.grad is not None


def test_bias_and_router_stay_fp32_under_bf16_model():
    model = build_model(DSv3Config.from_block({"preset": "tiny"})).to(torch.bfloat16)
    for moe in model.moe_layers():
        assert moe.gate.e_score_correction_bias.dtype == torch.float32
        assert moe.gate.weight.dtype == torch.float32
    assert "layers.1.mlp.gate.e_score_correction_bias" in model.state_dict()  # persistent
    assert "layers.1.mlp.gate.tokens_per_expert" not in model.state_dict()  # per-step, not saved


# 2. Group score = sum of the top-2 biased scores; unselected groups masked with -inf (not 0.0).
def test_group_score_is_top2_biased_sum():
    # 3 groups of 3. Group 0 has the single best expert but a weak second; group 1 has two good ones.
    biased = torch.tensor([[0.9, 0.1, 0.0, 0.6, 0.6, 0.0, 0.5, 0.5, 0.45]])
    idx = group_limited_topk(biased, top_k=2, n_group=3, topk_group=1)
    assert sorted(idx[0].tolist()) == [3, 4]  # max-only group scoring would pick group 0


def test_minus_inf_vs_zero_group_mask():
    # Kept group (0): its competitors have negative biased scores. Masking the other group with 0.0
    # (transformers 4.x) lets a masked expert win a top-k slot; -inf never does.
    biased = torch.tensor(
        [
            [
                0.30,
                -0.20,
                -0.30,
                -0.40,  # group 0: sum top2 = 0.10
                0.05,
                0.04,
                -0.90,
                -0.90,
            ]
        ]
    )  # group 1: sum top2 = 0.09  -> masked
    idx = group_limited_topk(biased, top_k=2, n_group=2, topk_group=1)
    assert set(idx[0].tolist()) <= {0, 1, 2, 3}
    zero_masked = biased.clone()
    zero_masked[:, 4:] = 0.0
    assert set(zero_masked.topk(2).indices[0].tolist()) & {4, 5, 6, 7}  # the 0.0 variant leaks


def test_never_more_than_topk_group_groups():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        biased = torch.randn(64, 32, generator=g)
        idx = group_limited_topk(biased, top_k=8, n_group=8, topk_group=4)
        groups = idx // 4
        assert max(len(set(row)) for row in groups.tolist()) <= 4


# 3. Sequence-wise balance loss: plain top-k of s (no bias, no groups), s normalized over all experts.
def test_seq_balance_loss_matches_eqs_17_to_20():
    g = torch.Generator().manual_seed(1)
    B, T, E, K, alpha = 3, 7, 8, 2, 0.01
    s = torch.rand(B, T, E, generator=g)
    loss = seq_balance_loss(s, K, alpha)
    ref = 0.0
    for b in range(B):
        f = [0.0] * E
        P = [0.0] * E
        for t in range(T):
            top = sorted(range(E), key=lambda i: -s[b, t, i].item())[:K]
            for i in top:
                f[i] += E / (K * T)
            tot = s[b, t].sum().item()
            for i in range(E):
                P[i] += s[b, t, i].item() / tot / T
        ref += alpha * sum(fi * pi for fi, pi in zip(f, P))
    # float32 vs this float64 loop: every term is positive, so Σ|terms| is the loss itself; 5 reductions of
    # length <= E = 8 (s/Σs over E, the mean over T, Σ f·P over E, α, the mean over B).
    assert_within(
        loss.double(),
        torch.tensor(ref / B, dtype=torch.float64),
        reorder_bound(E, ref / B, stages=5),
        "sequence-wise balance loss vs eqs. 17-20",
    )


def test_seq_balance_loss_ignores_bias_and_groups():
    cfg = DSv3Config.from_block({"preset": "tiny", "moe": {"seq_aux_alpha": 0.1}})
    model = build_model(cfg).train()
    ids = torch.randint(0, 256, (2, 16))
    model(ids)
    moe = model.moe_layers()[0]
    before = moe.aux_loss.item()
    moe.gate.e_score_correction_bias.copy_(torch.linspace(-5, 5, 16))  # changes selection, not the loss
    model(ids)
    assert moe.aux_loss.item() == before  # the first MoE layer's scores: the same ops on the same input


# 4. Bias update: sign(mean − count), γ, in place, fp32, once per call (= once per optimizer step).
def test_bias_update_sign_rule_and_counts_reset():
    r, m = _router(n_group=1, topk_group=1, top_k=1, n_routed_experts=4)
    r.train()
    r.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    ref_bias = r.e_score_correction_bias
    stats = update_expert_bias([r], gamma=0.001)
    assert r.e_score_correction_bias is ref_bias  # in place
    # 0 + γ·(±1): exactly float32(γ), as the literal below
    assert torch.equal(r.e_score_correction_bias, torch.tensor([-0.001, 0.001, 0.001, 0.001]))
    assert r.tokens_per_expert.sum() == 0
    assert stats[0]["maxvio"] == 10 / 5 - 1  # 10 / mean 5 - 1: exact in float
    assert maxvio(torch.tensor([5.0, 5.0])) == 0.0


def test_counts_only_in_training_and_not_under_skip_counting():
    r, m = _router(top_k=2)
    x = torch.randn(6, 8)
    r.eval()
    r(x)
    assert r.tokens_per_expert.sum() == 0
    r.train()
    r(x)
    assert r.tokens_per_expert.sum() == 6 * 2
    with skip_counting():
        r(x)
    assert r.tokens_per_expert.sum() == 6 * 2


def test_gamma_schedule_by_tokens():
    cfg = DSv3Config.from_block({"preset": "v3-671b"})
    assert cfg.moe.gamma(1e12) == 0.001 and cfg.moe.gamma(14.4e12) == 0.0
    assert cfg.mtp.lam(5e12) == 0.3 and cfg.mtp.lam(11e12) == 0.1


# 5. MTP loss divides by the full T and is scaled by λ/D.
def test_mtp_loss_divides_by_full_T_and_lambda():
    g = torch.Generator().manual_seed(2)
    B, T, V, k = 2, 6, 11, 1
    logits = torch.randn(B, T - k, V, generator=g)
    labels = torch.randint(0, V, (B, T - k), generator=g)
    ce_sum = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum")
    assert torch.equal(mtp_depth_loss(logits, labels, T), ce_sum / (B * T))  # same CE kernel, same divisor
    cfg = DSv3Config.from_block({"preset": "tiny", "mtp": {"loss_weight": 0.25}, "moe": {"seq_aux_alpha": 0.0}})
    model = build_model(cfg).train()
    ids = torch.randint(0, 256, (2, 12), generator=g)
    out = model(ids, labels=torch.roll(ids, -1, 1))
    assert torch.equal(out.loss, out.lm_loss + 0.25 * out.mtp_loss)  # α = 0: no balance term; same ops
