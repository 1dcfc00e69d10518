"""FP8 released checkpoints: `load_pretrained` logits equal transformers' logits on the dequantized weights
(fp32, 1e-5), including hidden sizes that are not multiples of 128 and several block grids; MTP logits
equal a reference built from the paper's formula (eqs. 21-23) on the dequantized MTP tensors."""

import pytest
import torch
from helpers import (
    dequantize_by_formula,
    make_tiny_hf_checkpoint,
    mtp_reference_logits,
    read_stored_tensors,
    transformers_on,
)
from tolerance import LOGITS_FP32_ABS, assert_within

from dsv3_plugin import load_pretrained
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.checkpoint.synthetic import quantize_checkpoint
from dsv3_plugin.config import DSv3Config

CASES = {
    "tiny_block128": ({}, (128, 128)),  # hidden 64: one ragged block
    "hidden_200": ({"model": {"hidden_size": 200, "rope_scaling": None}}, (128, 128)),  # 128 + 72 columns
    "tiny_block32": ({}, (32, 32)),  # many blocks, ragged 40-row kv_a
}


def _fp8_and_reference(tmp_path, cfg, block):
    """(FP8 dir, dict of dequantized fp32 tensors, transformers model on them)."""
    src = tmp_path / "float"
    make_tiny_hf_checkpoint(src, cfg, seed=7, bias_scale=0.1)
    with CheckpointReader(src) as r:
        floats = {n: r.get(n, torch.float32) for n in r.names()}
        hf_cfg = dict(r.config)
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(floats, str(fp8), hf_cfg, shard_bytes=60_000, block=block)
    with CheckpointReader(fp8) as r:
        assert r.is_quantized() and len(r.files()) > 1
    deq = dequantize_by_formula(read_stored_tensors(fp8), block)  # the formula, index by index
    return fp8, deq, transformers_on(deq, cfg, tmp_path / "dequantized")


@pytest.mark.parametrize("name", sorted(CASES))
def test_fp8_logits_match_transformers_on_dequantized_weights(tmp_path, name):
    over, block = CASES[name]
    cfg = DSv3Config.from_block({"preset": "tiny", **over})
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
        # MTP logits vs eqs. 21-23 evaluated with transformers' block on the dequantized MTP tensors
        ref_mtp = mtp_reference_logits(cfg, deq, hf, ids)
        assert len(out.mtp_logits) == len(ref_mtp) == 1
        assert_within(
            out.mtp_logits[0],
            ref_mtp[0],
            LOGITS_FP32_ABS,
            "MTP logits from FP8 files vs eqs. 21-23 on dequantized weights",
        )
        # the requested dtype: bf16 = the fp32 dequantization rounded once
        bf = load_pretrained(fp8, dtype=torch.bfloat16)
        assert all(torch.equal(p, q.to(torch.bfloat16)) for p, q in zip(bf.parameters(), ours.parameters()))
