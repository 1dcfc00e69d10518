"""Aux-loss-free bias update through Megatron-Core's own `finalize_model_grads` (2 gloo ranks, DP = 2):
our routers (decoder MoE layers and the MTP layer) expose `expert_bias` / `local_tokens_per_expert`, Megatron
all-reduces the counts and applies the sign step; the result must equal our standalone
`balancing.update_expert_bias` on the same per-rank batches, and the expert loads seen before the update must
equal the standalone model's (the MTP layer's padded positions are not counted)."""
import pytest
import torch

from helpers import make_tiny_hf_checkpoint, run_ranks

pytestmark = pytest.mark.dist


def _worker(ckpt):
    from megatron.core.distributed import finalize_model_grads

    from dsv3_plugin import load_pretrained
    from dsv3_plugin.balancing import routers_of, update_expert_bias
    from dsv3_plugin.megatron.gpt import build_gpt_model, causal_inputs
    from dsv3_plugin.megatron.runtime import init_megatron, shutdown_megatron, wrap_ddp
    from dsv3_plugin.megatron.weights import load_hf_checkpoint

    rank, world = init_megatron()
    ours = load_pretrained(ckpt)
    cfg = ours.cfg
    model = build_gpt_model(cfg)
    load_hf_checkpoint(model, ckpt)
    ddp = wrap_ddp(model)
    ddp.train()
    ids_all = torch.randint(0, cfg.model.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(0))
    ids = ids_all[2 * rank: 2 * rank + 2]
    pos, mask = causal_inputs(ids)
    ddp(ids, pos, mask, labels=ids.roll(-1, 1)).mean().backward()
    mega_routers = [m for m in model.modules() if hasattr(m, "expert_bias")]
    loads_mega = [r.local_tokens_per_expert.clone() for r in mega_routers]
    before = [r.expert_bias.clone() for r in mega_routers]
    finalize_model_grads([ddp])
    after = [r.expert_bias.clone() for r in mega_routers]
    counts_zeroed = all(float(r.local_tokens_per_expert.abs().sum()) == 0 for r in mega_routers)

    ours.train()
    ours(ids)
    loads_ours = [r.tokens_per_expert.clone() for r in routers_of(ours)]
    update_expert_bias(ours, cfg.moe.gamma(0.0))                   # all-reduce over the world (= DP)
    ref = [r.e_score_correction_bias.clone() for r in routers_of(ours)]
    shutdown_megatron()
    return {
        "n": (len(mega_routers), len(ref)),
        "loads": [(a - b).abs().max().item() for a, b in zip(loads_mega, loads_ours)],
        "bias": [(a - b).abs().max().item() for a, b in zip(after, ref)],
        "moved": [(a - b).abs().max().item() for a, b in zip(after, before)],
        "zeroed": counts_zeroed, "gamma": cfg.moe.gamma(0.0),
    }


def test_finalize_model_grads_updates_our_router_bias(tmp_path):
    from dsv3_plugin.config import load_config
    cfg = load_config({"preset": "tiny"})
    make_tiny_hf_checkpoint(tmp_path, cfg, seed=5, bias_scale=0.05)
    for r in run_ranks(_worker, 2, str(tmp_path)):
        assert r["n"] == (3, 3)                      # 2 MoE decoder layers + the MTP layer
        assert r["loads"] == [0.0, 0.0, 0.0]
        assert all(d <= 1e-7 for d in r["bias"]), r
        assert all(abs(m - r["gamma"]) < 1e-6 for m in r["moved"]), r
        assert r["zeroed"]
