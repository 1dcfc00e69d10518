"""Expert parallelism through Megatron-Core's parallel_state: EP = 2 on 2 gloo ranks equals EP = 1 (DP = 2 both
times): per-rank logits and loss, gradients after Megatron's `finalize_model_grads` (dense params, and each
rank's expert shard against the matching rows of the EP = 1 gradient), and the router-bias update."""
import pytest
import torch

from helpers import make_tiny_hf_checkpoint, run_ranks

pytestmark = pytest.mark.dist


def _run(ckpt, ep, rank, world):
    from megatron.core.distributed import finalize_model_grads

    from dsv3_plugin import load_pretrained
    from dsv3_plugin.megatron.gpt import build_gpt_model, causal_inputs, forward_logits
    from dsv3_plugin.megatron.runtime import init_megatron, shutdown_megatron, wrap_ddp
    from dsv3_plugin.megatron.weights import load_hf_checkpoint

    init_megatron(ep=ep)
    cfg = load_pretrained(ckpt).cfg
    model = build_gpt_model(cfg)
    load_hf_checkpoint(model, ckpt)
    n_local = model.decoder.layers[1].mlp.moe.experts.gate_proj.shape[0]
    ids = torch.randint(0, cfg.model.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(1))
    ids = ids[2 * rank: 2 * rank + 2]
    model.eval()
    with torch.no_grad():
        logits, mtp = forward_logits(model, ids)
    ddp = wrap_ddp(model)
    ddp.train()
    pos, mask = causal_inputs(ids)
    loss = ddp(ids, pos, mask, labels=ids.roll(-1, 1)).mean()
    loss.backward()
    finalize_model_grads([ddp])
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    shutdown_megatron()
    return {"logits": logits, "mtp": mtp, "loss": loss.detach(), "grads": grads, "bias": bias, "n_local": n_local}


def _worker(ckpt):
    from dsv3_plugin.distributed import init_distributed
    rank, world = init_distributed()
    one = _run(ckpt, 1, rank, world)
    two = _run(ckpt, 2, rank, world)
    out = {"n_local": (one["n_local"], two["n_local"]),
           "logits": (one["logits"] - two["logits"]).abs().max().item(),
           "mtp": max((a - b).abs().max().item() for a, b in zip(one["mtp"], two["mtp"])),
           "loss": abs(one["loss"].item() - two["loss"].item()),
           "bias": max((one["bias"][n] - two["bias"][n]).abs().max().item() for n in one["bias"])}
    worst, n_expert = 0.0, 0
    lo = rank * two["n_local"]
    for n, g2 in two["grads"].items():
        g1 = one["grads"][n]
        if ".mlp.moe.experts." in n:
            g1 = g1[lo: lo + two["n_local"]]
            n_expert += 1
        worst = max(worst, (g1 - g2).abs().max().item() / (g1.abs().max().item() + 1e-12))
    out["grad_rel"] = worst
    out["n_expert_grads"] = n_expert
    return out


def test_ep2_equals_ep1_through_megatron_parallel_state(tmp_path):
    from dsv3_plugin.config import load_config
    cfg = load_config({"preset": "tiny"})
    make_tiny_hf_checkpoint(tmp_path, cfg, seed=11, bias_scale=0.05)
    for r in run_ranks(_worker, 2, str(tmp_path)):
        assert r["n_local"] == (16, 8)
        assert r["n_expert_grads"] == 9                  # (gate, up, down) x (2 MoE layers + MTP layer)
        assert r["logits"] <= 1e-5 and r["mtp"] <= 1e-5, r
        assert r["loss"] <= 1e-6, r
        assert r["grad_rel"] <= 1e-4, r
        assert r["bias"] == 0.0, r
