"""FP8 released checkpoints: `load_pretrained` logits equal transformers' logits on the dequantized weights
(fp32, 1e-5), including hidden sizes that are not multiples of 128 and several block grids; MTP logits
equal a reference built from the paper's formula (eqs. 21-23) on the dequantized MTP tensors."""
import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from dsv3_plugin import load_pretrained
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.checkpoint.synthetic import quantize_checkpoint
from dsv3_plugin.config import load_config
from helpers import hf_config, make_tiny_hf_checkpoint
from tolerance import LOGITS_FP32_ABS, assert_within

CASES = {
    "tiny_block128": ({}, (128, 128)),                                       # hidden 64: one ragged block
    "hidden_200": ({"model": {"hidden_size": 200, "rope_scaling": None}}, (128, 128)),  # 128 + 72 columns
    "tiny_block32": ({}, (32, 32)),                                          # many blocks, ragged 40-row kv_a
}


def _formula(w_fp8, s, block):
    """w[i, j] = float(w_fp8[i, j]) * scale_inv[i // b0, j // b1], index by index."""
    O, I = w_fp8.shape
    return w_fp8.float() * s[(torch.arange(O) // block[0])[:, None], (torch.arange(I) // block[1])[None, :]]


def _fp8_and_reference(tmp_path, cfg, block):
    """(FP8 dir, dict of dequantized fp32 tensors, transformers model on them)."""
    src = tmp_path / "float"
    make_tiny_hf_checkpoint(src, cfg, seed=7, bias_scale=0.1)
    with CheckpointReader(src) as r:
        floats = {n: r.get(n, torch.float32) for n in r.names()}
        hf_cfg = dict(r.config)
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(floats, str(fp8), hf_cfg, shard_bytes=60_000, block=block)
    deq = {}
    with CheckpointReader(fp8) as r:
        assert r.is_quantized() and len(r.files()) > 1
        for n in r.names():
            deq[n] = _formula(r.raw(n), r.raw(n + "_scale_inv"), block) if r.is_fp8(n) else r.raw(n).float()
    ref_dir = tmp_path / "dequantized"
    os.makedirs(ref_dir)
    save_file({n: t.contiguous() for n, t in deq.items()}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    with open(ref_dir / "config.json", "w") as f:
        json.dump(hf_cfg, f)
    hf = DeepseekV3ForCausalLM.from_pretrained(ref_dir, config=hf_config(cfg), dtype=torch.float32).eval()
    return fp8, deq, hf


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_logits_match_transformers_on_dequantized_weights(tmp_path, name):
    over, block = CASES[name]
    cfg = load_config({"preset": "tiny", **over})
    fp8, deq, hf = _fp8_and_reference(tmp_path, cfg, block)
    ours = load_pretrained(fp8).eval()
    # the weights really were FP8 (quantization changed them) and were loaded dequantized
    kv = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert torch.equal(ours.layers[0].self_attn.kv_a_proj_with_mqa.weight, deq[kv])
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    # both sides hold the same dequantized fp32 weights: the README's fp32 logits figure applies as is
    assert_within(out.logits, ref, LOGITS_FP32_ABS, f"{name}: logits from FP8 files vs transformers on deq.")
    if name == "tiny_block32":
        _check_mtp(cfg, deq, hf, ids, out.mtp_logits)
        # the requested dtype: bf16 = the fp32 dequantization rounded once
        bf = load_pretrained(fp8, dtype=torch.bfloat16)
        assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(bf.parameters(), ours.parameters()))


def _check_mtp(cfg, deq, hf, ids, got):
    L, T, eps = cfg.model.num_hidden_layers, ids.shape[1], cfg.model.rms_norm_eps
    p = f"model.layers.{L}."
    w = {n[len(p):]: t for n, t in deq.items() if n.startswith(p)}
    hc = hf_config(cfg)
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"
    block = DeepseekV3DecoderLayer(hc, L).float().eval()
    sd = {k: v for k, v in w.items()
          if ".experts." not in k and not k.startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
    E = cfg.moe.n_routed_experts
    sd["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
    sd["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    missing, unexpected = block.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]

    def norm(x, weight):
        n = DeepseekV3RMSNorm(x.shape[-1], eps)
        n.weight.data.copy_(weight)
        return n(x)

    with torch.no_grad():
        h0 = hf.model(ids).last_hidden_state                                  # after the final norm (§6)
        emb = w["embed_tokens.weight"][ids[:, 1:]]                            # Emb(t_{i+1})
        x = torch.cat([norm(emb, w["enorm.weight"]), norm(h0[:, :-1], w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        pos = torch.arange(T - 1)[None]
        causal = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
        x = block(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=causal, position_ids=pos)
        x = x[0] if isinstance(x, tuple) else x
        ref = norm(x, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T
    assert len(got) == 1
    assert_within(got[0], ref, LOGITS_FP32_ABS, "MTP logits from FP8 files vs eqs. 21-23 on dequantized weights")
