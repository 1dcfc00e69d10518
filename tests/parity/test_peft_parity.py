"""LoRA adapters out of the plugin: peft 0.21.2's adapted DeepseekV3 (our adapter directory on transformers' model)
computes the logits of transformers' model loaded from our merged export; the FP8 merge stays within its derived
re-quantization bound and leaves the blocks an adapter does not change bit for bit as released."""

import warnings

import pytest
import torch
from helpers import hf_from_pretrained, lora_adapters, read_stored_tensors
from tolerance import REDUCTIONS_PER_BLOCK, assert_within, fp8_error, gamma, model_bound, unit_roundoff

from dsv3_plugin.checkpoint.lora_merge import write_merged_release
from dsv3_plugin.checkpoint.lora_names import adapter_sites, lora_scale
from dsv3_plugin.checkpoint.peft_adapter import write_peft_adapter
from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE, write_tiny_release
from dsv3_plugin.config import DSv3Config

pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")

LORAS = {
    "all_experts": {"rank": 4, "alpha": 8, "experts": True},
    # gate + up as one rank-2r adapter under rsLoRA: its alpha_pattern is alpha·sqrt(2), not 2·alpha
    "rslora_gate_up": {
        "rank": 2,
        "alpha": 3,
        "experts": True,
        "use_rslora": True,
        "targets": ["kv_b_proj", "gate_proj", "up_proj"],
    },
}


@pytest.mark.parametrize("fp8, case", [(False, "all_experts"), (True, "rslora_gate_up")])
def test_peft_logits_equal_merged_logits(tmp_path, fp8, case):
    from peft import PeftModel

    cfg = DSv3Config.from_block({**TINY_RELEASE, "lora": LORAS[case]})
    base = write_tiny_release(tmp_path / "base", fp8=fp8, seed=2)
    ad = lora_adapters(cfg, cfg.lora, seed=3, scale=0.3)
    peft_base = base
    if fp8:  # transformers has no CPU FP8 loader: peft's base is the release dequantized by the same merge, no adapters
        peft_base = tmp_path / "deq"
        write_merged_release(base, peft_base, {}, cfg, cfg.lora, to="hf-fp32")
    write_peft_adapter(tmp_path / "adapter", ad, cfg, cfg.lora)
    write_merged_release(base, tmp_path / "merged", ad, cfg, cfg.lora, to="hf-fp32", shard_bytes=200_000)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "Found missing adapter keys")
        pm = PeftModel.from_pretrained(hf_from_pretrained(peft_base), tmp_path / "adapter").eval()
    merged = hf_from_pretrained(tmp_path / "merged")
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = merged(ids).logits
        ref = pm(ids).logits
        with pm.disable_adapter():
            plain = pm(ids).logits
    # Both sides evaluate (W + s·B A) x in FP32 in different orders: peft adds s·B(A x) to W x (Linear) or W + s·BA
    # per forward (experts), the merged model rounds W' once more. model_bound's reordering stages per block, plus 3
    # per adapted GEMM (A x or BA, the B product, the sum) for at most 8 adapted GEMMs a block.
    bound = model_bound(ref, cfg, ids.numel(), passes=1) * (REDUCTIONS_PER_BLOCK + 3 * 8) / REDUCTIONS_PER_BLOCK
    assert_within(got, ref, bound, f"{case}: merged export vs peft's adapted model (fp32)")
    assert (ref - plain).abs().max() > 10 * bound.max(), "the adapters must move the logits far beyond the bound"
    # the BF16 export is the FP32 merge rounded once
    write_merged_release(base, tmp_path / "bf16", ad, cfg, cfg.lora, to="hf-bf16")
    m32, m16 = read_stored_tensors(tmp_path / "merged"), read_stored_tensors(tmp_path / "bf16")
    assert set(m32) == set(m16)
    for n, t in m16.items():
        assert torch.equal(t, m32[n] if n.endswith("e_score_correction_bias") else m32[n].to(torch.bfloat16)), n


# A model whose projections span several 128x128 blocks (the tiny preset's fit in one).
WIDE = {**TINY_RELEASE, "model": {**TINY_RELEASE["model"], "hidden_size": 256, "intermediate_size": 384}}
DENSE_GATE = "model.layers.0.mlp.gate_proj.weight"  # [384, 256]: 3 x 2 blocks


def _fp8(stored: dict, n: str) -> tuple[torch.Tensor, torch.Tensor]:
    return stored[n].view(torch.uint8), stored[n + "_scale_inv"]


def test_fp8_merge_within_bound_and_unchanged_blocks_bit_exact(tmp_path):
    cfg = DSv3Config.from_block({**WIDE, "lora": LORAS["all_experts"]})
    base = write_tiny_release(tmp_path / "base", fp8=True, seed=4, block=WIDE)
    ad = lora_adapters(cfg, cfg.lora, seed=5, scale=0.1)
    ad["layers.0.mlp.gate_proj.lora_B"][:128] = 0  # block row 0 of the dense gate: no change
    zero = {k: (torch.zeros_like(v) if "lora_B" in k else v) for k, v in ad.items()}
    write_merged_release(base, tmp_path / "zero", zero, cfg, cfg.lora, to="hf")
    write_merged_release(base, tmp_path / "m", ad, cfg, cfg.lora, to="hf")
    b, z, m = (read_stored_tensors(tmp_path / d) for d in ("base", "zero", "m"))
    # B = 0: every tensor, FP8 codes and scales included, byte for byte the release's
    assert set(z) == set(b)
    for n in b:
        assert torch.equal(z[n].view(torch.uint8), b[n].view(torch.uint8)), n
    # the unchanged block row keeps its codes and scales; the others were re-quantized
    (q0, s0), (q1, s1) = _fp8(b, DENSE_GATE), _fp8(m, DENSE_GATE)
    assert torch.equal(q1[:128], q0[:128]) and torch.equal(s1[0], s0[0])
    assert not torch.equal(q1[128:], q0[128:]) and not torch.equal(s1[1:], s0[1:])
    # every merged FP8 tensor within the bound derived in lora_merge.requantize_fp8, around W' computed in FP64
    L, s = cfg.model.num_hidden_layers, lora_scale(cfg.lora)
    u = unit_roundoff(torch.float32)
    checked = 0
    for site in adapter_sites(ad, cfg, cfg.lora):
        for e in range(cfg.moe.n_routed_experts) if site.kind == "experts" else (None,):
            n = site.released(L, e)
            A, B = (ad[site.a], ad[site.b]) if e is None else (ad[site.a][e], ad[site.b][e])
            w = _deq(b[n], b[n + "_scale_inv"])
            exact = w + s * (B.double() @ A.double())
            # our FP32 W' = fl(fl(q·scale) + fl(s · fl(B A))) differs from `exact` by the dequantization's, the
            # product's, the scaling's and the sum's roundings; the FP8 bound then holds around W' (evaluated at
            # |exact| + that difference)
            BA = B.double().abs() @ A.double().abs()
            merge = u * w.abs() + s * gamma(A.shape[0]) * BA + u * s * BA * (1 + gamma(A.shape[0]))
            merge = merge + u * (exact.abs() + merge)
            scale = _expand(m[n + "_scale_inv"], exact.shape)
            mag = exact.abs() + merge
            bound = merge + fp8_error(mag, scale) * (1 + 2**-20) + 2**-22 * mag
            assert_within(_deq(m[n], m[n + "_scale_inv"]), exact, bound, f"{n}: FP8 re-quantization of W + s·BA")
            checked += 1
    assert checked == 3 * 5 + 3 + 2 * 3 + 2 * 3 * cfg.moe.n_routed_experts


def _expand(s: torch.Tensor, shape) -> torch.Tensor:
    return s.double().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


def _deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """DeepSeek's formula, exactly (an E4M3 value times an FP32 scale is exact in FP64)."""
    return q.double() * _expand(s, q.shape)
