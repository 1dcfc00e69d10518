import torch

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.moe.balancing import update_expert_bias
from dsv3_plugin.training.transforms import build_model


def test_shapes_and_backward():
    cfg = DSv3Config.from_block({"preset": "tiny", "mtp": {"depth": 2}})
    m = build_model(cfg).train()
    ids = torch.randint(0, 256, (2, 10))
    out = m(ids, labels=torch.roll(ids, -1, 1))
    assert out.logits.shape == (2, 10, 256)
    assert [t.shape for t in out.mtp_logits] == [(2, 9, 256), (2, 8, 256)]
    assert out.balance_loss is not None and out.balance_loss > 0
    out.loss.backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    assert not missing, missing
    # every MoE router counted B*T*K assignments; MTP depth k sees T-k positions
    for layer in m.layers[1:]:
        assert layer.mlp.gate.tokens_per_expert.sum() == 2 * 10 * cfg.moe.top_k
    for k, mtp in enumerate(m.mtp, 1):
        assert mtp.layer.mlp.gate.tokens_per_expert.sum() == 2 * (10 - k) * cfg.moe.top_k


def test_bias_update_changes_routing_counts_reset():
    m = build_model(DSv3Config.from_block({"preset": "tiny"})).train()
    ids = torch.randint(0, 256, (4, 16))
    m(ids)
    stats = update_expert_bias(m, gamma=0.01)
    assert len(stats) == len(m.moe_layers()) == 3
    for moe in m.moe_layers():
        assert moe.gate.tokens_per_expert.sum() == 0
        assert set(moe.gate.e_score_correction_bias.abs().unique().tolist()) <= {0.0, torch.tensor(0.01).item()}


def test_eval_does_not_count():
    m = build_model(DSv3Config.from_block({"preset": "tiny"})).eval()
    m(torch.randint(0, 256, (1, 8)))
    assert all(moe.gate.tokens_per_expert.sum() == 0 for moe in m.moe_layers())
