"""The one validation (`dsv3_plugin.deepspeed.validate.validate_ds_config`): strict types, finite numbers, files that
are not UTF-8 JSON, the DeepSpeed keys, world-size rules, the memory bound — and the engine refusing what check-config
refuses, with the same message."""

import json
import re

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, DSv3Config, load_config

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {"preset": "tiny"},
}


def _ds(**top):
    d = json.loads(json.dumps(DS))
    d.update(top)
    return d


# ---- strict types: no coercion, and the message names the key that is wrong --------------------------------
STRICT = [
    ({"moe": {"n_routed_experts": "4"}}, 'dsv3.moe.n_routed_experts: must be an integer (got "4", a string)'),
    ({"moe": {"top_k": True}}, "dsv3.moe.top_k: must be an integer (got true, a boolean)"),
    ({"moe": {"top_k": 4.0}}, "dsv3.moe.top_k: must be an integer (got 4.0, a number)"),
    ({"model": {"num_hidden_layers": 1e30}}, "dsv3.model.num_hidden_layers: must be an integer"),
    ({"moe": {"route_scale": "2.5"}}, 'dsv3.moe.route_scale: must be a number (got "2.5", a string)'),
    ({"moe": {"route_scale": False}}, "dsv3.moe.route_scale: must be a number (got false, a boolean)"),
    ({"moe": {"norm_topk_prob": 1}}, "dsv3.moe.norm_topk_prob: must be true or false (got 1, a number)"),
    ({"moe": {"route_scale": float("inf")}}, "dsv3.moe.route_scale: must be a finite number (got inf)"),
    ({"moe": {"bias_update_speed": float("nan")}}, "dsv3.moe.bias_update_speed: must be a finite number (got nan)"),
    ({"model": {"vocab_size": 10**40}}, "dsv3.model.vocab_size: must be within +-10^36 (got a 41-digit integer)"),
    ({"moe": {"max_nodes_per_token": "2"}}, "dsv3.moe.max_nodes_per_token: must be an integer"),
    ({"moe": [1]}, "dsv3.moe: must be an object (got [1], an array)"),
    ({"preset": ["tiny"]}, 'dsv3.preset: unknown preset ["tiny"]'),
    ({"train": {"seed": -1}}, "dsv3.train.seed: must be >= 0 (got -1)"),
    ({"parallel": {"p2p_timeout_s": 1e300}}, "dsv3.parallel.p2p_timeout_s: must be <= 604800"),
]


@pytest.mark.parametrize("block, msg", STRICT, ids=[m.split(":")[0] for _, m in STRICT])
def test_strict_types_name_the_key(block, msg):
    with pytest.raises(ConfigError) as e:
        DSv3Config.from_block(block)
    assert str(e.value).startswith(msg), str(e.value)


def test_ints_are_accepted_where_floats_are_expected_but_not_strings():
    c = DSv3Config.from_block({"moe": {"route_scale": 3, "bias_update_speed": 0}, "model": {"rope_theta": 50000}})
    assert c.moe.route_scale == 3.0 and isinstance(c.moe.route_scale, float)
    for bad in ("3", True, "3.0"):
        with pytest.raises(ConfigError, match=r"^dsv3\.moe\.route_scale: must be a number"):
            DSv3Config.from_block({"moe": {"route_scale": bad}})


@pytest.mark.parametrize(
    "literal, shown",
    [
        ("1e400", "1e400, which overflows a 64-bit float"),
        ("-1e400", "-1e400, which overflows a 64-bit float"),
        ("Infinity", "Infinity"),
        ("-Infinity", "-Infinity"),
        ("NaN", "NaN"),
    ],
)
def test_non_finite_literals_in_a_file_name_the_key(tmp_path, capsys, literal, shown):
    p = tmp_path / "c.json"
    p.write_text(
        json.dumps(_ds()).replace('"preset": "tiny"', f'"preset": "tiny", "moe": {{"route_scale": {literal}}}')
    )
    assert main(["check-config", str(p)]) == 2
    assert capsys.readouterr().err == f"error: dsv3.moe.route_scale: must be a finite number (got {shown})\n"


def test_non_finite_deepspeed_key_named(tmp_path, capsys):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(_ds()).replace('"lr": 0.001', '"lr": NaN'))
    assert main(["check-config", str(p)]) == 2
    assert capsys.readouterr().err.startswith("error: optimizer.params.lr: must be a finite number (got NaN)")


# ---- files that are not plain UTF-8 JSON ------------------------------------------------------------------------
def _bad_files(tmp_path):
    text = json.dumps(_ds())
    deep = '{"dsv3": ' + "[" * 10000 + "]" * 10000 + "}"
    return {
        "utf16.json": (text.encode("utf-16"), "is UTF-16-encoded; save it as UTF-8"),
        "utf16be.json": (text.encode("utf-16-be"), "is UTF-16-BE-encoded"),
        "utf32.json": (text.encode("utf-32"), "is UTF-32-encoded"),
        "latin1.json": (
            text.replace('"tiny"', '"tiny", "note": "d\u00e9j\u00e0"').encode("latin-1"),
            "not valid UTF-8 (byte 0xe9 at offset",
        ),
        "deep.json": (deep.encode(), "nested deeper than 64 levels"),
        "deep100.json": (
            ('{"dsv3": {"preset": "tiny", "a": ' + "[" * 100 + "]" * 100 + "}}").encode(),
            "nested deeper than 64 levels",
        ),
        "dup.json": (
            text.replace('"preset": "tiny"', '"preset": "tiny", "preset": "small"').encode(),
            "key 'preset' appears twice",
        ),
        "bigint.json": (text.replace("2,", "1" + "0" * 5000 + ",").encode(), "an integer literal has 5001 digits"),
        "array.json": (b"[1, 2]", "must hold a JSON object (got [1, 2], an array)"),
        "empty.json": (b"", "not valid JSON"),
        "nodsv3.json": (json.dumps({"train_micro_batch_size_per_gpu": 1}).encode(), 'has no "dsv3" block'),
    }


def test_unreadable_files_name_the_file(tmp_path, capsys):
    for name, (data, needle) in _bad_files(tmp_path).items():
        p = tmp_path / name
        p.write_bytes(data)
        assert main(["check-config", str(p)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: {p}: ") and needle in err and "Traceback" not in err, (name, err)
    assert main(["check-config", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["check-config", str(tmp_path / "missing.json")]) == 2
    assert "file not found" in capsys.readouterr().err


def test_utf8_bom_is_accepted(tmp_path, capsys):
    """NOTE: the decision documented in json_input.py and the README: a UTF-8 BOM is skipped, not refused."""
    p = tmp_path / "bom.json"
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps(_ds()).encode())
    assert main(["check-config", str(p)]) == 0
    assert capsys.readouterr().out.startswith(f"ok: {p}")
    assert load_config(p).preset == "tiny"


def test_from_hf_config_json_errors_name_the_file(tmp_path):
    from dsv3_plugin.config import DSv3Config

    hf = DSv3Config.from_block({"preset": "tiny"}).to_hf()
    del hf["kv_lora_rank"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=r"config\.json: required key 'kv_lora_rank' is missing"):
        DSv3Config.from_hf(p)
    p.write_bytes(json.dumps(hf).encode("utf-16"))
    with pytest.raises(ConfigError, match=r"config\.json: is UTF-16-encoded"):
        DSv3Config.from_hf(p)


# ---- the DeepSpeed keys: same refusal from check-config and from the engine ------------------------------------
DS_BAD = [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage: the dsv3 DeepSpeed path runs ZeRO stage 1"),
    ({"zero_optimization": {"stage": "1"}}, 'zero_optimization.stage: must be an integer (got "1", a string)'),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage: must be an integer (got true, a boolean)"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}}, "zero_optimization.reduce_bucket_size:"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping: must be a number in [0, 1e9]"),
    ({"gradient_clipping": 1e30}, "gradient_clipping: must be a number in [0, 1e9]"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e30}}}, "optimizer.params.lr: must be <= 10 (got 1e+30)"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 2.0}}}, "optimizer.params.eps: must be <= 1 (got 2.0)"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 1e3}}}, "optimizer.params.weight_decay: must be <="),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e30}}},
        "scheduler.params.warmup_max_lr: must be <= 10",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2**40}}},
        "scheduler.params.warmup_num_steps: must be <= 2^31 - 1",
    ),
    ({"train_micro_batch_size_per_gpu": "2"}, "train_micro_batch_size_per_gpu: must be an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu: must be an integer >= 1"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps: must be an integer >= 1"),
    ({"steps_per_print": 0}, "steps_per_print: must be an integer >= 1"),
    ({"optimizer": {"type": 3}}, "optimizer.type: must be a string"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}, "optimizer.params.lr: must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.2]}}}, "optimizer.params.betas: must be two numbers"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "optimizer.params.max_grad_norm:"),
    (
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "momentum": 0.9}}},
        "optimizer.params: AdamW refuses them",
    ),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer.type: ZeRO refuses the untested optimizer SGD"),
    ({"optimizer": {"type": "Adamm"}}, 'optimizer.type: unknown optimizer "Adamm"'),
    ({"scheduler": {"type": "WarmupLR"}}, "scheduler.params: required"),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "10"}}},
        "scheduler.params.warmup_num_steps: must be a number",
    ),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params: WarmupDecayLR refuses them"),
    ({"scheduler": {"type": "Warmup", "params": {}}}, "scheduler.type: unknown LR schedule"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled: must be true or false"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled: fp16 and bf16 cannot both be enabled"),
    ({"communication_data_type": "fp7"}, "DeepSpeed config: refused by DeepSpeed's parser"),
]


@pytest.mark.parametrize("top, msg", DS_BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(DS_BAD)])
def test_deepspeed_keys_refused_by_check_config_and_engine(tmp_path, capsys, top, msg):
    from dsv3_plugin.deepspeed import split_ds_config

    d = _ds(**top)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    assert main(["check-config", str(p), "--target", "engine"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + msg), err
    with pytest.raises(ConfigError) as e:
        split_ds_config(d)
    assert f"error: {e.value}\n" == err


def test_engine_refuses_what_deepspeed_would(capsys):
    """A config without micro-batch size or optimizer fails inside deepspeed.initialize with an assert; the
    engine refuses it first, naming the key."""
    import torch

    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.training.transforms import build_model

    with torch.device("meta"):
        model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    with pytest.raises(ConfigError, match=r"^train_micro_batch_size_per_gpu: required"):
        initialize(model, {"dsv3": {"preset": "tiny"}})
    with pytest.raises(ConfigError, match=r"^optimizer: required"):
        initialize(model, {"train_micro_batch_size_per_gpu": 1, "dsv3": {"preset": "tiny"}})


# ---- world-size rules (--nproc) and the batch triple ----------------------------------------------------------
def test_world_size_rules(tmp_path, capsys):
    from dsv3_plugin.deepspeed.run_config import validate_ds_config

    p = tmp_path / "c.json"
    p.write_text(json.dumps({**_ds(), "dsv3": {"preset": "tiny", "parallel": {"ep": 4}}}))
    assert main(["check-config", str(p)]) == 0
    assert "world-size rules not checked" in capsys.readouterr().out
    assert main(["check-config", str(p), "--nproc", "2"]) == 2
    assert capsys.readouterr().err == "error: dsv3.parallel.ep: must divide the world size (got ep=4, world=2)\n"
    assert main(["check-config", str(p), "--nproc", "8"]) == 0
    assert "checked for 8 rank(s)" in capsys.readouterr().out

    d = _ds(train_batch_size=16)
    del d["train_micro_batch_size_per_gpu"]
    c = validate_ds_config(d, world_size=4)
    assert (c.ds["train_micro_batch_size_per_gpu"], c.ds["gradient_accumulation_steps"]) == (4, 1)
    assert validate_ds_config(_ds(train_batch_size=16), world_size=4).ds["gradient_accumulation_steps"] == 2
    with pytest.raises(ConfigError, match=r"^train_batch_size: must equal .* \(got 12 != 2 x 1 x 4\)"):
        validate_ds_config(_ds(train_batch_size=12), world_size=4)
    with pytest.raises(ConfigError, match=r"^train_batch_size: 2 does not split over 4 data-parallel rank"):
        validate_ds_config({**d, "train_batch_size": 2}, world_size=4)
    with pytest.raises(ConfigError, match=r"^dsv3\.parallel\.pp: must divide the world size \(got pp=2, world=3\)"):
        validate_ds_config(
            {
                **_ds(gradient_accumulation_steps=4),
                "dsv3": {
                    "preset": "tiny",
                    "model": {"num_hidden_layers": 4},
                    "parallel": {"pp": 2, "schedule": "dualpipev"},
                },
            },
            world_size=3,
        )


def test_low_level_guards_say_the_same(tmp_path):
    """The in-rank guards that remain (group builders) raise the validation's message word for word."""
    from dsv3_plugin.deepspeed.run_config import validate_ds_config
    from dsv3_plugin.parallel.groups import ep_layout

    with pytest.raises(ConfigError) as low:
        ep_layout(2, 4, 1)
    with pytest.raises(ConfigError) as one:
        validate_ds_config({**_ds(), "dsv3": {"preset": "tiny", "parallel": {"ep": 4}}}, world_size=2)
    assert str(low.value) == str(one.value)


# ---- the memory bound -----------------------------------------------------------------------------------------
def test_memory_estimate_refuses_huge_sizes_with_bytes_and_key(tmp_path, capsys):
    p = tmp_path / "c.json"
    for over, key in [
        # (sizes inside the config's bounds that still ask for TiBs: the estimate, not the bound, refuses them)
        (
            {"dsv3": {"preset": "small", "model": {"num_hidden_layers": 1024, "hidden_size": 8192}}},
            "dsv3.model.num_hidden_layers",
        ),
        (
            {
                "dsv3": {
                    "preset": "tiny",
                    "moe": {"n_routed_experts": 16384, "intermediate_size": 8192, "n_group": 1, "topk_group": 1},
                }
            },
            "dsv3.moe.n_routed_experts",
        ),
        ({"train_micro_batch_size_per_gpu": 10**12}, "train_micro_batch_size_per_gpu"),
    ]:
        p.write_text(json.dumps({**_ds(), **over}))
        assert main(["check-config", str(p), "--nproc", "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {key}: dsv3 train needs at least ") and f"{key} = " in err, err
        assert "bytes" in err or "PiB" in err or "TiB" in err, err
    # one rank fits, a million on one host do not: the message names the rank count, not a size key
    p.write_text(json.dumps(_ds()))
    assert main(["check-config", str(p), "--nproc", "1000000"]) == 2
    assert capsys.readouterr().err.startswith("error: --nproc: 1000000 ranks on one host need at least ")
    # a model that fits this host but not a 1 GiB one
    p.write_text(json.dumps({**_ds(), "dsv3": {"preset": "small", "model": {"vocab_size": 2**20}}}))
    assert main(["check-config", str(p)]) == 0
    assert "dsv3 train needs >= " in capsys.readouterr().out
    assert main(["check-config", str(p), "--host-memory-gib", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: dsv3.model.vocab_size: dsv3 train needs at least ")


def test_memory_estimate_is_a_lower_bound_of_the_model_size():
    """The build term is exactly 4 bytes per parameter of the model dsv3 train builds."""
    import torch

    from dsv3_plugin.training.memory_estimate import estimate_train_memory
    from dsv3_plugin.training.transforms import build_model

    for over in [
        {"preset": "tiny"},
        {"preset": "small"},
        {"preset": "tiny", "model": {"tie_word_embeddings": True}},
        {"preset": "tiny", "mtp": {"depth": 2}, "model": {"q_lora_rank": None}},
    ]:
        cfg = DSv3Config.from_block(over)
        with torch.device("meta"):
            n = sum(p.numel() for p in build_model(cfg).parameters())
        est = estimate_train_memory(cfg)
        assert est.parts["build"] <= 4 * n <= est.parts["build"] * 1.01, (over, est.params, n)


def test_pp_with_ep_accepts_a_pipeline_rank_without_moe_layer():
    """pp = 2 x ep = 2: 1F1B over 2 MoE layers and no MTP leaves pipeline rank 1 only the head (the head counts
    as a layer in the split), so it holds no expert parameter group. DeepSpeed's ZeRO-1 all-reduces a gradient
    norm per group over the pipeline (once a gloo size mismatch in the first step, so this was refused); the
    pipeline engine now sums one norm per stage (patches/deepspeed_zero_pipeline_norm.py; trained against the
    single process in tests/dist/test_pipeline_ep_train.py, 1F1B with a dense-only stage 0)."""
    from dsv3_plugin.deepspeed.run_config import validate_ds_config

    def ds(schedule, gas):
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "dsv3": {
                "preset": "tiny",
                "model": {"num_hidden_layers": 2, "first_k_dense_replace": 0},
                "mtp": {"depth": 0},
                "parallel": {"pp": 2, "ep": 2, "schedule": schedule},
            },
        }

    for schedule, gas in (("1f1b", 2), ("dualpipev", 4)):
        assert validate_ds_config(ds(schedule, gas), world_size=4).cfg.parallel.ep == 2


# ---- the W split: on by default where the schedule has W ops; true elsewhere is refused ---------------------
@pytest.mark.parametrize(
    "parallel, on",
    [
        ({"pp": 2, "schedule": "dualpipev"}, True),
        ({"pp": 2, "schedule": "dualpipe"}, True),
        ({"pp": 2, "schedule": "1f1b"}, False),
        ({}, False),
        ({"pp": 2, "schedule": "dualpipev", "split_weight_grads": False}, False),
        ({"pp": 2, "schedule": "dualpipe", "split_weight_grads": True}, True),
    ],
)
def test_split_weight_grads_default_follows_the_schedule(parallel, on):
    assert DSv3Config.from_block({"preset": "tiny", "parallel": parallel}).parallel.split_w() is on


def test_split_weight_grads_true_needs_the_plugins_two_chunk_schedules_on_the_megatron_path():
    import argparse

    from dsv3_plugin.megatron.schedule_args import resolve_pipeline_schedule

    args = argparse.Namespace(dsv3_pipeline_schedule=None, pipeline_model_parallel_size=2)
    # DualPipeV / DualPipe run W ops: the split is taken
    for schedule in ("dualpipev", "dualpipe"):
        cfg = DSv3Config.from_block(
            {"preset": "tiny", "parallel": {"pp": 2, "schedule": schedule, "split_weight_grads": True}}
        )
        assert resolve_pipeline_schedule(args, argparse.ArgumentParser(), set(), cfg, "the JSON's") == schedule
    # no pipeline in this run (the block's own checks refuse a schedule without W ops): refused, not ignored
    args = argparse.Namespace(dsv3_pipeline_schedule=None, pipeline_model_parallel_size=1)
    with pytest.raises(
        ConfigError,
        match=r"dsv3\.parallel\.split_weight_grads = true: with Megatron the W split runs in the plugin's dualpipev",
    ):
        resolve_pipeline_schedule(args, argparse.ArgumentParser(), set(), cfg, "the JSON's")


# ---- overlapped FB pairs: on by default where there is EP communication and FB ops; true elsewhere is refused --
@pytest.mark.parametrize(
    "parallel, on",
    [
        ({"pp": 2, "ep": 2, "schedule": "dualpipev"}, True),
        ({"pp": 2, "ep": 2, "schedule": "dualpipe"}, True),
        ({"pp": 2, "ep": 2, "schedule": "1f1b"}, False),
        ({"pp": 2, "schedule": "dualpipev"}, False),
        ({"ep": 2}, False),
        ({"pp": 2, "ep": 2, "schedule": "dualpipev", "overlap_ep_comm": False}, False),
        ({"pp": 2, "ep": 2, "schedule": "dualpipe", "overlap_ep_comm": True}, True),
    ],
)
def test_overlap_ep_comm_default_follows_ep_and_the_schedule(parallel, on):
    assert DSv3Config.from_block({"preset": "tiny", "parallel": parallel}).parallel.overlap_ep() is on


_NEEDS = {
    "split_weight_grads": "pp > 1 and a schedule with W ops",
    "overlap_ep_comm": "ep > 1, pp > 1 and a schedule with FB ops",
}


@pytest.mark.parametrize(
    "key, parallel, why",
    [
        ("split_weight_grads", {"pp": 2, "schedule": "1f1b"}, "schedule '1f1b' has no W ops"),
        ("split_weight_grads", {"pp": 1, "schedule": "dualpipev"}, "pp = 1 runs no pipeline schedule"),
        ("overlap_ep_comm", {"pp": 2, "ep": 2, "schedule": "1f1b"}, "schedule '1f1b' has no FB ops"),
        ("overlap_ep_comm", {"pp": 1, "ep": 2, "schedule": "dualpipev"}, "pp = 1 runs no pipeline"),
        ("overlap_ep_comm", {"pp": 2, "schedule": "dualpipev"}, "ep = 1 has no all-to-all"),
    ],
)
def test_schedule_switch_true_where_it_cannot_apply_is_refused(key, parallel, why):
    """`split_weight_grads` / `overlap_ep_comm`: true where the layout has nothing to split or overlap is refused,
    naming the key; false is fine."""
    with pytest.raises(ConfigError, match=rf"^dsv3\.parallel\.{key}: true needs {re.escape(_NEEDS[key])} .*" + why):
        DSv3Config.from_block({"preset": "tiny", "parallel": {**parallel, key: True}})
    DSv3Config.from_block({"preset": "tiny", "parallel": {**parallel, key: False}})
