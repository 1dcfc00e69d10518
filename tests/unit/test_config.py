import json

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.config import PRESETS, ConfigError, DSv3Config, load_config

# (override of the "dsv3" block, dotted key the error must start with)
INVALID = [
    ({"moe": {"top_k": 17}}, "dsv3.moe.top_k"),
    ({"moe": {"top_k": 0}}, "dsv3.moe.top_k"),
    ({"moe": {"top_k": "four"}}, "dsv3.moe.top_k"),
    ({"moe": {"n_group": 3}}, "dsv3.moe.n_group"),
    ({"moe": {"topk_group": 5}}, "dsv3.moe.topk_group"),
    ({"moe": {"top_k": 1, "topk_group": 2}}, "dsv3.moe.top_k"),
    ({"moe": {"n_group": 16, "topk_group": 2}}, "dsv3.moe.n_group"),  # 1 expert per group
    ({"moe": {"top_k": 12, "topk_group": 2}}, "dsv3.moe.top_k"),  # > 2 groups x 4 experts
    ({"moe": {"n_routed_experts": 0}}, "dsv3.moe.n_routed_experts"),
    ({"moe": {"n_shared_experts": -1}}, "dsv3.moe.n_shared_experts"),
    ({"moe": {"route_scale": 0}}, "dsv3.moe.route_scale"),
    ({"moe": {"score_func": "softmax"}}, "dsv3.moe.score_func"),
    ({"moe": {"bias_update_speed": -0.001}}, "dsv3.moe.bias_update_speed"),
    ({"moe": {"seq_aux_alpha": -1}}, "dsv3.moe.seq_aux_alpha"),
    (
        {"moe": {"bias_update_schedule": [{"until_tokens": 10, "value": 0.1}, {"until_tokens": 5, "value": 0}]}},
        "dsv3.moe.bias_update_schedule.1.until_tokens",
    ),
    (
        {"moe": {"bias_update_schedule": [{"until_tokens": None, "value": 0.1}, {"until_tokens": 5, "value": 0}]}},
        "dsv3.moe.bias_update_schedule.0.until_tokens",
    ),
    ({"moe": {"bias_update_schedule": [{"until_tokens": 5}]}}, "dsv3.moe.bias_update_schedule.0.value"),
    ({"moe": {"typo_key": 1}}, "dsv3.moe.typo_key"),
    ({"moe": {"max_nodes_per_token": 3, "topk_group": 2}}, "dsv3.moe.max_nodes_per_token"),
    ({"moe": {"max_nodes_per_token": 5}}, "dsv3.moe.topk_group"),
    ({"model": {"hidden_size": 0}}, "dsv3.model.hidden_size"),
    ({"model": {"qk_rope_head_dim": 7}}, "dsv3.model.qk_rope_head_dim"),
    ({"model": {"first_k_dense_replace": 9}}, "dsv3.model.first_k_dense_replace"),
    ({"model": {"q_lora_rank": 0}}, "dsv3.model.q_lora_rank"),
    ({"model": {"rope_scaling": {"type": "ntk"}}}, "dsv3.model.rope_scaling.type"),
    ({"model": {"rope_scaling": {"factor": -1}}}, "dsv3.model.rope_scaling.factor"),
    ({"model": {"vocab": 10}}, "dsv3.model.vocab"),
    ({"mtp": {"depth": -1}}, "dsv3.mtp.depth"),
    ({"mtp": {"loss_weight": -0.3}}, "dsv3.mtp.loss_weight"),
    (
        {"mtp": {"loss_weight_schedule": [{"until_tokens": -1, "value": 0.3}]}},
        "dsv3.mtp.loss_weight_schedule.0.until_tokens",
    ),
    ({"parallel": {"ep": 3}}, "dsv3.parallel.ep"),
    ({"parallel": {"ep": 0}}, "dsv3.parallel.ep"),
    ({"parallel": {"schedule": "gpipe"}}, "dsv3.parallel.schedule"),
    ({"parallel": {"pp": 3, "schedule": "dualpipe"}}, "dsv3.parallel.pp"),
    ({"parallel": {"pp": 2, "schedule": "dualpipev", "num_chunks": 2}}, "dsv3.parallel.num_chunks"),
    ({"parallel": {"pp": 2, "schedule": "dualpipe", "num_chunks": 5}}, "dsv3.parallel.num_chunks"),
    ({"parallel": {"ep": 4}, "moe": {"ranks_per_node": 3}}, "dsv3.moe.ranks_per_node"),
    ({"fp8": {"dispatch": True}}, "dsv3.fp8.dispatch"),
    ({"fp8": {"enabled": True, "recipe": "delayed"}}, "dsv3.fp8.recipe"),
    ({"fp8": {"enabled": True, "dispatch": True, "recipe": "tensorwise"}}, "dsv3.fp8.dispatch"),
    ({"memory": {"recompute": "some"}}, "dsv3.memory.recompute"),
    ({"memory": {"ema_decay": 1.5}}, "dsv3.memory.ema_decay"),
    ({"memory": {"grad_norm": "fp16"}}, "dsv3.memory.grad_norm"),
    ({"memory": {"grad_norm": "fp32", "flat_grads": False}}, "dsv3.memory.grad_norm"),
    ({"memory": {"grad_norm": "fp32"}, "parallel": {"ep": 2}}, "dsv3.memory.grad_norm"),
    ({"memory": {"grad_norm": "fp32"}, "parallel": {"pp": 2}}, "dsv3.memory.grad_norm"),
    ({"train": {"seq_len": 1}}, "dsv3.train.seq_len"),
    ({"preset": "v4"}, "dsv3.preset"),
    ({"unknown_section": {}}, "dsv3.unknown_section"),
]


@pytest.mark.parametrize("block,key", INVALID, ids=[k for _, k in INVALID])
def test_invalid_config_names_the_key(block, key):
    with pytest.raises(ConfigError) as e:
        DSv3Config.from_block(block)
    msg = str(e.value)
    assert msg.startswith(key + ":"), msg
    assert isinstance(e.value, ValueError)


def test_at_least_30_invalid_cases():
    assert len(INVALID) >= 30


def test_example_message_format():
    with pytest.raises(ConfigError, match=r"^dsv3\.moe\.top_k: must be <= n_routed_experts \(got 17 > 16\)$"):
        DSv3Config.from_block({"moe": {"top_k": 17}})


def test_v3_preset_matches_released_config():
    c = DSv3Config.from_block({"preset": "v3-671b"})
    hf = c.to_hf()
    released = {
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "num_nextn_predict_layers": 1,
    }
    for k, v in released.items():
        assert hf[k] == v, k
    assert hf["rope_scaling"] == {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    assert c.moe.seq_aux_alpha == 0.0001 and c.moe.bias_update_speed == 0.001


def test_from_hf_round_trip_and_missing_aux_alpha():
    c = DSv3Config.from_block({"preset": "v3-671b"})
    hf = c.to_hf()
    hf.pop("aux_loss_alpha")
    hf.pop("seq_aux")
    back = DSv3Config.from_hf(hf)
    assert back.model == c.model
    assert back.moe.seq_aux_alpha == 0.0001  # released configs omit it; 0 would silently disable the loss


def test_reads_dsv3_block_of_deepspeed_json(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 1},
                "dsv3": {"preset": "tiny", "moe": {"max_nodes_per_token": 1}},
            }
        )
    )
    c = load_config(p)
    assert c.moe.topk_group == 1 and c.preset == "tiny"
    assert set(PRESETS) >= {"tiny", "v3-671b"}


def test_check_config_exit_codes(tmp_path, capsys):
    good = tmp_path / "good.json"
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    good.write_text(json.dumps({**ds, "dsv3": {"preset": "tiny"}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**ds, "dsv3": {"preset": "tiny", "moe": {"top_k": 99}}}))
    nojson = tmp_path / "broken.json"
    nojson.write_text("{not json")
    assert main(["check-config", str(good)]) == 0
    assert main(["check-config", str(bad)]) == 2
    assert "dsv3.moe.top_k: must be <= n_routed_experts" in capsys.readouterr().err
    assert main(["check-config", str(nojson)]) == 2
    assert main(["check-config", str(tmp_path / "missing.json")]) == 2


def test_check_config_console_script(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dsv3": {"moe": {"n_group": 5}}}))
    r = subprocess.run([sys.executable, "-m", "dsv3_plugin", "check-config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2 and "dsv3.moe.n_group" in r.stderr
