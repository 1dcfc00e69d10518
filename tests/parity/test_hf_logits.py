"""`load_pretrained` logits vs transformers' DeepseekV3ForCausalLM on the same released-format files (fp32)."""

import pytest
import torch
from helpers import make_tiny_hf_checkpoint
from tolerance import LOGITS_FP32_ABS, assert_within

from dsv3_plugin import load_pretrained
from dsv3_plugin.config import DSv3Config

CASES = {
    "tiny": {},
    "no_q_lora": {"model": {"q_lora_rank": None}},
    "one_group": {"moe": {"n_group": 1, "topk_group": 1}},
    "eight_groups": {"moe": {"n_routed_experts": 16, "n_group": 8, "topk_group": 2, "top_k": 4}},
    "hidden_200_no_yarn": {"model": {"hidden_size": 200, "rope_scaling": None}, "moe": {"n_shared_experts": 2}},
    "no_shared_two_dense": {
        "model": {"first_k_dense_replace": 2, "num_hidden_layers": 4},
        "moe": {"n_shared_experts": 0},
    },
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(tmp_path, name):
    cfg = DSv3Config.from_block({"preset": "tiny", **CASES[name]})
    hf = make_tiny_hf_checkpoint(tmp_path, cfg, seed=3, bias_scale=0.1, shard_bytes=40_000 if name == "tiny" else None)
    ours = load_pretrained(tmp_path).eval()
    assert torch.count_nonzero(ours.layers[-1].mlp.gate.e_score_correction_bias) > 0
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert got.shape == ref.shape
    # the README's figure (see tolerance.LOGITS_FP32_ABS for why it holds with a 10x margin)
    assert_within(got, ref, LOGITS_FP32_ABS, f"{name}: our logits vs transformers (fp32, same weights)")


def test_sharded_checkpoint_really_sharded(tmp_path):
    cfg = DSv3Config.from_block({"preset": "tiny"})
    make_tiny_hf_checkpoint(tmp_path, cfg, shard_bytes=40_000)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
