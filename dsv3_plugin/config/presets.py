"""Presets of the `"dsv3"` block: data, not flags. `v3-671b` matches the released config.json (and paper §4.2 for
training); `tiny` is a CPU-sized model with every feature on; `small` the same family a few times larger.
A block's `"preset"` names its base; the block's own keys deep-merge over it (`deep_merge`).
"""

from __future__ import annotations

import copy

__all__ = ["PRESETS", "deep_merge"]

_V3 = {
    "model": {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "first_k_dense_replace": 3,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 163840,
        "initializer_range": 0.006,
    },
    "moe": {
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "intermediate_size": 2048,
        "top_k": 8,
        "n_group": 8,
        "topk_group": 4,
        "route_scale": 2.5,
        "bias_update_speed": 0.001,
        "bias_update_schedule": [{"until_tokens": 14.3e12, "value": 0.001}, {"until_tokens": None, "value": 0.0}],
        "seq_aux_alpha": 0.0001,
        "ranks_per_node": 8,
    },
    "mtp": {
        "depth": 1,
        "loss_weight": 0.3,
        "loss_weight_schedule": [{"until_tokens": 10e12, "value": 0.3}, {"until_tokens": None, "value": 0.1}],
    },
    "parallel": {"ep": 64, "pp": 16, "schedule": "dualpipe"},
    "train": {"seq_len": 4096},
}

# A CPU-sized model with every feature on: q_lora, yarn, 1 dense + 2 MoE layers, 4 groups, MTP.
# top_k / topk_group = 2, as in V3 (8/4): the group score is then the top-2 sum everywhere (see router.py).
# hidden 64 (not a multiple of 128) on purpose: ragged FP8 blocks and no 128-alignment assumptions.
_TINY = {
    "model": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "first_k_dense_replace": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 256,
        "initializer_range": 0.02,
    },
    "moe": {
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "intermediate_size": 32,
        "top_k": 4,
        "n_group": 4,
        "topk_group": 2,
        "route_scale": 2.5,
        "bias_update_speed": 0.001,
        "seq_aux_alpha": 0.0001,
    },
    "mtp": {"depth": 1, "loss_weight": 0.3},
    "train": {"seq_len": 64, "steps": 60},
}

PRESETS: dict[str, dict] = {"tiny": _TINY, "v3-671b": _V3}


def deep_merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, dict values recursively (neither argument changes)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# The same family a few times larger (benches, MoE at the bench shape).
PRESETS["small"] = deep_merge(
    _TINY,
    {
        "model": {
            "vocab_size": 1024,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "q_lora_rank": 96,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
        },
        "moe": {"n_routed_experts": 64, "intermediate_size": 128, "top_k": 8, "n_group": 8, "topk_group": 4},
    },
)
