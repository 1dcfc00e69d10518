"""Every number of the `"dsv3"` block and of a released config.json is bounded (issue 27): a value outside the range
in which the arithmetic means something (or a size that would allocate without limit) is refused with the key it
came from, before anything is built, while DeepSeek-V3's released config.json, its relatives and every preset load.

The ranges and the reason for each are in `dsv3_plugin/config.py` (and the range column of docs/configuration.md).
"""

import copy
import json

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.config import PRESETS, ConfigError, DSv3Config

# deepseek-ai/DeepSeek-V3's config.json as released (its model-shaping keys; shared/reference deepseek_v3_facts §1.8)
V3_RELEASED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# relatives with the same architecture (deepseek_v3_facts: Kimi K2, Moonlight), which must load as well
RELATIVES = {
    "kimi-k2": {"n_routed_experts": 384, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "num_attention_heads": 64, "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
                "num_nextn_predict_layers": 0},
    "moonlight": {"hidden_size": 2048, "num_hidden_layers": 27, "first_k_dense_replace": 1, "n_routed_experts": 64,
                  "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "q_lora_rank": None,
                  "moe_intermediate_size": 1408, "intermediate_size": 11264, "num_attention_heads": 16,
                  "routed_scaling_factor": 2.446, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "rope_scaling": None,
                  "max_position_embeddings": 8192, "vocab_size": 163840, "aux_loss_alpha": 0.001, "seq_aux": True,
                  "num_nextn_predict_layers": 0},
}  # fmt: skip


def _released_loads() -> None:
    """V3's released config.json, its relatives and every preset are within every bound."""
    cfg = DSv3Config.from_hf(V3_RELEASED)
    assert (cfg.moe.route_scale, cfg.model.rope_scaling.factor, cfg.model.num_hidden_layers) == (2.5, 40.0, 61)
    for name, change in RELATIVES.items():
        assert DSv3Config.from_hf({**V3_RELEASED, **change}).model.hidden_size > 0, name
    for preset in PRESETS:
        assert DSv3Config.from_block({"preset": preset}).preset == preset
    # and what `to_hf` writes comes back
    assert (
        DSv3Config.from_hf(DSv3Config.from_block({"preset": "v3-671b"}).to_hf()).model
        == DSv3Config.from_block({"preset": "v3-671b"}).model
    )


# (dotted key in the "dsv3" block, a value the schema accepted before it was bounded)
BAD_DSV3 = [
    ("model.vocab_size", 2**30),
    ("model.hidden_size", 2**20),
    ("model.intermediate_size", 2**30),
    ("model.num_hidden_layers", 10**6),
    ("model.num_attention_heads", 10**5),
    ("model.q_lora_rank", 2**20),
    ("model.kv_lora_rank", 2**20),
    ("model.qk_nope_head_dim", 2**16),
    ("model.qk_rope_head_dim", 2**16),
    ("model.v_head_dim", 2**16),
    ("model.max_position_embeddings", 2**40),
    ("model.rms_norm_eps", 1e-45),
    ("model.rms_norm_eps", 2.0),
    ("model.rope_theta", 0.5),
    ("model.rope_theta", 1e30),
    ("model.initializer_range", 50.0),
    ("model.rope_scaling.factor", 0.5),
    ("model.rope_scaling.factor", 1e30),
    ("model.rope_scaling.original_max_position_embeddings", 2**40),
    ("model.rope_scaling.beta_fast", 1e30),
    ("model.rope_scaling.beta_slow", -1.0),
    ("model.rope_scaling.mscale", -3.0),
    ("model.rope_scaling.mscale_all_dim", 1e30),
    ("moe.n_routed_experts", 2**20),
    ("moe.n_shared_experts", 10**6),
    ("moe.intermediate_size", 2**30),
    ("moe.route_scale", 1e30),
    ("moe.bias_update_speed", 5.0),
    ("moe.seq_aux_alpha", 100.0),
    ("mtp.depth", 1000),
    ("mtp.loss_weight", 1e6),
    ("parallel.pp", 10**6),
    ("parallel.ep", 2**20),
    ("parallel.num_chunks", 10**9),
    ("parallel.p2p_timeout_s", 1e-9),
    ("fp8.promote_every", 2**30),
    ("memory.ema_decay", 1 - 1e-12),
    ("train.seq_len", 2**40),
]


def _block(key: str, value) -> dict:
    """The tiny preset's block with `key` set to `value` (related keys adjusted so only `key` is wrong)."""
    block = copy.deepcopy(PRESETS["tiny"])
    block["preset"] = None
    node = block
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return block


@pytest.mark.parametrize("key,value", BAD_DSV3, ids=[f"{k}={v!r}" for k, v in BAD_DSV3])
def test_a_value_out_of_range_is_refused_naming_its_key(key, value):
    with pytest.raises(ConfigError, match="^dsv3." + key.replace(".", r"\.") + ": must be "):
        DSv3Config.from_block(_block(key, value))


def test_schedules_and_yarn_ramp_and_data_weights_are_bounded_too():
    with pytest.raises(ConfigError, match=r"^dsv3\.moe\.bias_update_schedule\.1\.value: must be <= 1, the bound of γ"):
        DSv3Config.from_block({"moe": {"bias_update_schedule": [{"until_tokens": 10, "value": 0.001}, {"value": 3.0}]}})
    with pytest.raises(ConfigError, match=r"^dsv3\.mtp\.loss_weight_schedule\.0\.value: must be <= 10, the bound of λ"):
        DSv3Config.from_block({"mtp": {"loss_weight_schedule": [{"value": 1e30}]}})
    with pytest.raises(ConfigError, match=r"^dsv3\.mtp\.loss_weight_schedule\.0\.until_tokens: must be <= 1e\+18"):
        DSv3Config.from_block(
            {"mtp": {"loss_weight_schedule": [{"until_tokens": 1e300, "value": 0.3}, {"value": 0.1}]}}
        )
    with pytest.raises(ConfigError, match=r"^dsv3\.model\.rope_scaling\.beta_slow: must be <= beta_fast \(got 64 > 32"):
        DSv3Config.from_block({"model": {"rope_scaling": {"beta_slow": 64}}})
    with pytest.raises(ConfigError, match=r"^dsv3\.train\.data\.train\.1: the weight must be > 0 and <= 1e18"):
        DSv3Config.from_block({"train": {"data": {"train": [[1.0, "a"], [1e300, "b"]]}}})


# (config.json key, a value DSv3Config.from_hf accepted before): refused naming the key as config.json spells it
BAD_HF = [
    ("routed_scaling_factor", 1e30),  # the issue's example: all-zero logits with exit 0
    ("rms_norm_eps", 5.0),
    ("rope_theta", 1e300),
    ("initializer_range", 1e10),
    ("aux_loss_alpha", 1e5),
    ("vocab_size", 2**40),
    ("num_hidden_layers", 10**30),
    ("moe_intermediate_size", 2**40),
    ("num_nextn_predict_layers", 10**4),
    ("rope_scaling.factor", 1e300),
    ("rope_scaling.mscale", -1.0),
    ("rope_scaling.beta_fast", 1e9),
]


@pytest.mark.parametrize("key,value", BAD_HF, ids=[f"{k}={v!r}" for k, v in BAD_HF])
def test_a_released_config_value_out_of_range_is_refused_naming_the_config_json_key(key, value):
    _released_loads()
    hf = copy.deepcopy(V3_RELEASED)
    if "." in key:
        sec, name = key.split(".")
        hf[sec][name] = value
    else:
        hf[key] = value
    with pytest.raises(ConfigError, match="^" + key.replace(".", r"\.") + r" \(dsv3\.[a-z_.]+\): must be "):
        DSv3Config.from_hf(hf)


def test_no_dropout_no_attention_bias_every_layer_moe():
    """Released keys the model has no arithmetic for, when they ask for some, are refused like hidden_act."""
    for key, value in (("attention_dropout", 0.1), ("attention_bias", True), ("moe_layer_freq", 2)):
        with pytest.raises(ConfigError, match=f"^config.json: {key}: .* is not implemented"):
            DSv3Config.from_hf({**V3_RELEASED, key: value})


def test_generate_refuses_the_issue_checkpoint_by_key(tmp_path, capsys):
    """The issue's case through the CLI: a released checkpoint whose config.json says `routed_scaling_factor: 1e30`
    (it generated all-zero logits with exit 0) is exit 2 with one line naming the key, before any weight is read."""
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    d = write_tiny_release(tmp_path / "ck", fp8=False)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "routed_scaling_factor": 1e30}))
    assert main(["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "config.json: routed_scaling_factor (dsv3.moe.route_scale): must be <= 1000 (got 1e+30)" in err, err


def test_check_config_refuses_an_unbounded_float_with_exit_2(tmp_path, capsys):
    p = tmp_path / "ds.json"
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {"preset": "tiny", "moe": {"route_scale": 1e30}},
    }
    p.write_text(json.dumps(ds))
    assert main(["check-config", str(p)]) == 2
    assert capsys.readouterr().err == "error: dsv3.moe.route_scale: must be <= 1000 (got 1e+30)\n"
