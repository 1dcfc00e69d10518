"""FP8 in the real model: conversion scope (report §3.3.1) and 200 CPU training steps within 0.25% of FP32."""

import math
import statistics

import torch

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.precision.fp8.linear import Fp8Linear
from dsv3_plugin.training.transforms import build_model

# Smaller than `tiny` to keep 2×200 emulated steps affordable: 1 dense + 1 MoE layer (4 experts, top-2).
OVR = {
    "preset": "tiny",
    "model": {"num_hidden_layers": 2, "vocab_size": 64},
    "moe": {"n_routed_experts": 4, "n_group": 2, "topk_group": 1, "top_k": 2},
    "mtp": {"depth": 0},
}


def test_convert_scope_names_and_grads():
    cfg = DSv3Config.from_block({"preset": "tiny", "fp8": {"enabled": True}})
    m = build_model(cfg)
    ref = build_model(DSv3Config.from_block({"preset": "tiny"}))
    assert list(m.state_dict()) == list(ref.state_dict())  # checkpoints load unchanged
    rep = m.fp8_report
    assert rep.backend == "emulate" and rep.recipe == "blockwise"
    assert isinstance(m.layers[0].self_attn.q_a_proj, Fp8Linear)
    assert isinstance(m.layers[1].mlp.shared_experts.down_proj, Fp8Linear)
    assert isinstance(m.mtp[0].layer.self_attn.o_proj, Fp8Linear)
    assert rep.grouped == ["layers.1.mlp.experts", "layers.2.mlp.experts", "mtp.0.layer.mlp.experts"]
    for kept in ("embed_tokens", "lm_head", "layers.1.mlp.gate", "mtp.0.eh_proj"):
        assert kept in rep.high_precision
    assert type(m.lm_head) is torch.nn.Linear and type(m.mtp[0].eh_proj) is torch.nn.Linear
    m.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    lab = torch.roll(ids, -1, 1)
    out, out_ref = m(ids, lab), ref(ids, lab)
    out.loss.backward()
    out_ref.loss.backward()
    assert abs(out.loss.item() - out_ref.loss.item()) < 0.01 * out_ref.loss.item()
    assert out.loss.item() != out_ref.loss.item()  # the FP8 path really ran
    g, g_ref = m.layers[1].mlp.experts.gate_proj.grad, ref.layers[1].mlp.experts.gate_proj.grad
    assert g is not None and torch.nn.functional.cosine_similarity(g.flatten(), g_ref.flatten(), 0) > 0.9


def _batches(steps, B=2, T=32, V=64, seed=0):
    """A noisy permutation language: t+1 = perm[t] with prob. 0.7, uniform otherwise (entropy floor ~1.5)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(V, generator=g)
    out = []
    for _ in range(steps):
        ids = torch.empty(B, T + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, V, (B,), generator=g)
        for t in range(T):
            keep = torch.rand(B, generator=g) < 0.7
            ids[:, t + 1] = torch.where(keep, perm[ids[:, t]], torch.randint(0, V, (B,), generator=g))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _train(fp8: bool, batches, steps=200):
    """Plain single-process AdamW (paper §4.2 β, wd), 10-step warmup then cosine to 10% of the peak LR."""
    cfg = DSv3Config.from_block({**OVR, "fp8": {"enabled": fp8}})
    m = build_model(cfg)
    m.reset_parameters(seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps)))
    )
    losses = []
    for ids, lab in batches[:steps]:
        out = m(ids, lab)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(out.lm_loss.item())
    with torch.no_grad():  # held-out batches of the same language, each model in its own precision
        held_out = statistics.mean(m(ids, lab).lm_loss.item() for ids, lab in batches[steps:])
    return losses, held_out


def test_fp8_training_200_steps_within_quarter_percent_of_fp32():
    batches = _batches(208)
    l32, h32 = _train(False, batches)
    l8, h8 = _train(True, batches)
    assert l32[0] > 3.5 and statistics.mean(l32[-20:]) < 2.3  # it learned
    final32, final8 = statistics.mean(l32[-20:]), statistics.mean(l8[-20:])  # same 20 final batches
    assert abs(final8 - final32) / final32 < 0.0025, (final8, final32)
    assert abs(h8 - h32) / h32 < 0.0025, (h8, h32)
    assert l8 != l32  # and FP8 was really used


def test_fp8_dispatch_flag_changes_expert_numerics():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for dispatch in (False, True):
        m = build_model(DSv3Config.from_block({"preset": "tiny", "fp8": {"enabled": True, "dispatch": dispatch}}))
        m.reset_parameters(seed=0)
        assert m.fp8_report.dispatch is dispatch
        out = m(ids, torch.roll(ids, -1, 1))
        out.loss.backward()
        losses.append(out.loss.item())
    assert losses[0] != losses[1] and abs(losses[0] - losses[1]) < 1e-2 * losses[0]
