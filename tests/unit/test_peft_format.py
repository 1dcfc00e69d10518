"""PEFT adapter directories: what we write is what peft 0.21.2 writes and loads for transformers' DeepseekV3 (config
keys and values, tensor keys, shapes and values), a write -> read round trip gives the same tensors, and bad input
is refused in one line naming the file and tensor."""

import json
import os
import warnings

import pytest
import torch
from helpers import hf_from_pretrained, lora_adapters
from safetensors.torch import load_file, save_file

from dsv3_plugin.checkpoint.lora_names import adapter_sites, config_targets
from dsv3_plugin.checkpoint.peft_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft_adapter, write_peft_adapter
from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE, write_tiny_release
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.errors import CheckpointError

# peft 0.21.2 checks rank_pattern / alpha_pattern keys against targeted *modules* only, so it calls the fused experts'
# pattern (a target parameter's) unmatched although `_create_and_replace` applies it: the state-dict equality below
# (lora_A of gate_up_proj has 2r·E rows) shows it applied.
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match:RuntimeWarning")

# (LoRA block, what it exercises)
CASES = {
    "all_experts": {"rank": 4, "alpha": 8, "experts": True},  # gate+up one rank-2r adapter, down the outer wrapper
    "up_down_rslora": {"rank": 2, "alpha": 3, "experts": True, "use_rslora": True, "targets": ["q_b_proj", "up_proj"]},
    "down_only": {"rank": 3, "alpha": 16, "experts": True, "targets": ["kv_a_proj_with_mqa", "down_proj"]},
    "attention_dropout": {"rank": 8, "alpha": 16, "dropout": 0.1, "targets": ["q_a_proj", "o_proj"]},
    # peft refuses dropout on target_parameters: its config says 0 there, the metadata keeps 0.05 (round trip)
    "experts_dropout": {"rank": 2, "alpha": 4, "dropout": 0.05, "experts": True},
}


def _cfg(lora: dict):
    return DSv3Config.from_block({**TINY_RELEASE, "lora": lora})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny BF16 release (the peft base model is built from its config and weights)."""
    return write_tiny_release(tmp_path_factory.mktemp("base"), fp8=False)


def _peft_load(base_dir: str, adapter_dir: str):
    from peft import PeftModel

    with warnings.catch_warnings():
        # peft's "Found missing adapter keys" warning is the missing-keys report: make it fail the test
        warnings.filterwarnings("error", "Found missing adapter keys")
        return PeftModel.from_pretrained(hf_from_pretrained(base_dir), adapter_dir)


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_loads_what_we_write(tmp_path, base, case):
    from peft import get_peft_model_state_dict

    cfg = _cfg(CASES[case])
    ad = lora_adapters(cfg, cfg.lora, seed=1)
    dst = write_peft_adapter(tmp_path / "ad", ad, cfg, cfg.lora, base_model_name_or_path=base)
    pm = _peft_load(base, dst)
    got = get_peft_model_state_dict(pm)
    ours = load_file(os.path.join(dst, ADAPTER_WEIGHTS))
    assert set(got) == set(ours), f"missing {sorted(set(ours) - set(got))}, unexpected {sorted(set(got) - set(ours))}"
    for k, t in ours.items():
        assert torch.equal(got[k], t), k
    # peft's own config of the same adapter, saved by peft: the same keys and values
    pm.save_pretrained(tmp_path / "resaved")
    ref = json.loads((tmp_path / "resaved" / ADAPTER_CONFIG).read_text())
    mine = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    assert set(mine) == set(ref)
    for k in mine:
        if k in ("target_modules", "target_parameters"):  # peft keeps them as sets: order is not part of the format
            assert sorted(mine[k] or []) == sorted(ref[k] or []), k
        else:
            assert mine[k] == ref[k], k
    # (c) round trip: the same tensors and LoRA config back
    back, lora = read_peft_adapter(dst, cfg)
    assert lora == cfg.lora
    assert set(back) == set(ad)
    for k, t in ad.items():
        assert torch.equal(back[k], t), k


def test_reads_what_peft_writes(tmp_path, base):
    """An adapter peft itself made (get_peft_model with our config values, random weights) reads back to native
    tensors that write out to the same keys and values."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    cfg = _cfg(CASES["all_experts"])
    mine = tmp_path / "ours"
    write_peft_adapter(mine, lora_adapters(cfg, cfg.lora), cfg, cfg.lora, base_model_name_or_path=base)
    conf = json.loads((mine / ADAPTER_CONFIG).read_text())
    keep = ("r", "lora_alpha", "target_modules", "target_parameters", "rank_pattern", "alpha_pattern")
    pm = get_peft_model(hf_from_pretrained(base), LoraConfig(task_type="CAUSAL_LM", **{k: conf[k] for k in keep}))
    g = torch.Generator().manual_seed(5)
    E, r, Id = cfg.moe.n_routed_experts, cfg.lora.rank, cfg.moe.intermediate_size
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if n.endswith("experts.base_layer.lora_B.default.weight"):  # gate_up: blockdiag(B_gate, B_up) per expert
                B = torch.zeros(E, 2 * Id, 2 * r)
                B[:, :Id, :r], B[:, Id:, r:] = torch.randn(E, Id, r, generator=g), torch.randn(E, Id, r, generator=g)
                p.copy_(B.permute(1, 2, 0).reshape(2 * Id, 2 * r * E))
            elif "lora_" in n:  # peft initialises B = 0: every other factor random
                p.copy_(torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path / "peft")
    native, lora = read_peft_adapter(tmp_path / "peft", cfg)
    assert (lora.rank, lora.alpha, lora.experts) == (4, 8, True)
    assert config_targets(cfg, lora) == config_targets(cfg, cfg.lora)  # targets null there, spelled out here
    again = write_peft_adapter(tmp_path / "again", native, cfg, lora, base_model_name_or_path=base)
    ref = get_peft_model_state_dict(pm)
    got = load_file(os.path.join(again, ADAPTER_WEIGHTS))
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


# --- (e) bad input ------------------------------------------------------------------------------------------------


@pytest.fixture
def written(tmp_path):
    cfg = _cfg(CASES["all_experts"])
    ad = lora_adapters(cfg, cfg.lora)
    return cfg, ad, write_peft_adapter(tmp_path / "ad", ad, cfg, cfg.lora)


def _edit_config(d, **kv):
    p = os.path.join(d, ADAPTER_CONFIG)
    c = json.load(open(p))
    c.update(kv)
    with open(p, "w") as f:
        json.dump(c, f)


def _edit_tensors(d, fn):
    p = os.path.join(d, ADAPTER_WEIGHTS)
    t = load_file(p)
    fn(t)
    save_file(t, p)


GU = r"mlp\.experts\.gate_up_proj"
Q_A = "base_model.model.model.layers.0.self_attn.q_a_proj.lora_A.weight"


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: _edit_config(d, target_modules=["q_a_proj", "v_proj"]), r"target_modules names 'v_proj'"),
        (lambda d: _edit_config(d, target_modules=["gate_proj"]), r"target_modules names 'gate_proj'"),
        (lambda d: _edit_config(d, use_dora=True), r"use_dora = true"),
        (lambda d: _edit_config(d, target_modules=["q_proj"]), r"'q_proj', which the base model does not have"),
        (lambda d: _edit_config(d, target_parameters=["mlp.experts.w1"]), r"target_parameters names 'mlp.experts.w1'"),
        (lambda d: _edit_config(d, r=5, rank_pattern={GU: 10}, alpha_pattern={GU: 16}),
         r"lora_A\.weight in .*: shape \[4, 64\], the base model needs \[5, 64\]"),
        (lambda d: _edit_config(d, alpha_pattern={GU: 8}), r"alpha_pattern gives .*gate_up_proj another scale"),
        (lambda d: _edit_tensors(d, lambda t: t.update({Q_A.replace("layers.0", "layers.7"): t[Q_A].clone()})),
         r"layers\.7\.self_attn.* names no adapted module"),
        (lambda d: _edit_tensors(d, lambda t: t.update({Q_A: t[Q_A][:, :60].contiguous()})),
         rf"{Q_A} in .*: shape \[4, 60\]"),
        (lambda d: _edit_tensors(d, lambda t: t[Q_A].__setitem__((0, 0), float("nan"))), rf"{Q_A} in .*non-finite"),
        (lambda d: _edit_tensors(d, lambda t: t.pop(Q_A)), rf"{Q_A}: missing from"),
        (lambda d: os.remove(os.path.join(d, ADAPTER_WEIGHTS)) or open(os.path.join(d, "adapter_model.bin"), "wb"),
         r"adapter_model\.bin is a pickle: not read"),
    ],
)  # fmt: skip
def test_read_refuses(written, edit, match):
    cfg, _, d = written
    edit(d)
    with pytest.raises(CheckpointError, match=match) as e:
        read_peft_adapter(d, cfg)
    assert "\n" not in str(e.value)


def test_read_accepts_peft_parameter_suffixes(written):
    """peft's own MoE conversion writes bare "gate_up_proj" / "down_proj": the same adapter."""
    cfg, ad, d = written
    conf = json.load(open(os.path.join(d, ADAPTER_CONFIG)))
    short = {"mlp.experts.gate_up_proj": "gate_up_proj", "mlp.experts.down_proj": "experts.down_proj"}
    _edit_config(d, target_parameters=[short.get(p, p) for p in conf["target_parameters"]])
    back, _ = read_peft_adapter(d, cfg)
    assert set(back) == set(ad) and all(torch.equal(back[k], ad[k]) for k in ad)


def test_read_refuses_shared_rank_columns(written):
    """gate and up rows of the fused expert adapter mixing rank columns: not two separate rank-r adapters."""
    cfg, _, d = written
    key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    _edit_tensors(d, lambda t: t[key].fill_(0.5))
    with pytest.raises(CheckpointError, match="not block-diagonal"):
        read_peft_adapter(d, cfg)


def test_write_refuses(tmp_path):
    cfg = _cfg(CASES["all_experts"])
    ad = lora_adapters(cfg, cfg.lora)
    lo = cfg.lora
    cases = [
        ({**ad, "mtp.0.layer.self_attn.o_proj.lora_A": ad["layers.0.self_attn.o_proj.lora_A"],
          "mtp.0.layer.self_attn.o_proj.lora_B": ad["layers.0.self_attn.o_proj.lora_B"]}, lo, "no MTP layer"),
        ({k: v for k, v in ad.items() if not k.startswith("layers.2.self_attn.o_proj")}, lo,
         r"layers\.2\.self_attn\.o_proj\.lora_A: missing \(peft adapts o_proj on every layer\)"),
        (ad, lo.model_copy(update={"bias_update": True}), "router bias"),
        ({**ad, "layers.0.self_attn.q_a_layernorm.lora_A": ad["layers.0.self_attn.q_a_proj.lora_A"]}, lo,
         "not a LoRA adapter tensor"),
        ({**ad, "layers.0.self_attn.o_proj.lora_B": ad["layers.0.self_attn.o_proj.lora_B"][:, :3]}, lo,
         r"o_proj\.lora_B: shape \[64, 3\], the base model and rank 4 need \[64, 4\]"),
        ({**ad, "layers.1.mlp.experts.w2_lora_A": ad["layers.1.mlp.experts.w2_lora_A"] * float("inf")}, lo,
         r"w2_lora_A: .*Inf"),
        ({k: v for k, v in ad.items() if k != "layers.1.mlp.experts.w3_lora_B"}, lo, r"w3_lora_B: missing"),
        (ad, lo.model_copy(update={"experts": False}), "does not adapt routed experts"),
    ]  # fmt: skip
    for i, (adapters, lora, match) in enumerate(cases):
        with pytest.raises(CheckpointError, match=match) as e:
            write_peft_adapter(tmp_path / f"x{i}", adapters, cfg, lora)
        assert "\n" not in str(e.value)
        assert not os.path.exists(tmp_path / f"x{i}")
    # a valid set is accepted by the same check
    assert len(adapter_sites(ad, cfg, lo)) == 3 * 5 + 3 + 2 * 3 + 2 * 3


# --- merged export: structure and refusals (the numerics: tests/parity/test_peft_parity.py) -----------------------


def test_merge_mtp_adapter_and_replaced_tensor(tmp_path):
    """An MTP-layer adapter merges into the release's layer L (the MTP block); `replace` puts a trained tensor (the
    router bias of a `bias_update` run) in the base's place. Same op sequence as lora_merge: torch.equal."""
    from helpers import read_stored_tensors

    from dsv3_plugin.checkpoint.lora_merge import write_merged_release

    cfg = _cfg({"rank": 2, "alpha": 4, "targets": ["o_proj"]})
    base = write_tiny_release(tmp_path / "base", fp8=False)
    g = torch.Generator().manual_seed(0)
    ad = {"mtp.0.layer.self_attn.o_proj.lora_A": torch.randn(2, 64, generator=g),
          "mtp.0.layer.self_attn.o_proj.lora_B": torch.randn(64, 2, generator=g)}  # fmt: skip
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    new_bias = torch.randn(cfg.moe.n_routed_experts, generator=g)
    write_merged_release(base, tmp_path / "m", ad, cfg, cfg.lora, to="hf-fp32", replace={bias: new_bias})
    b, m = read_stored_tensors(base), read_stored_tensors(tmp_path / "m")
    o = "model.layers.3.self_attn.o_proj.weight"
    A, B = ad["mtp.0.layer.self_attn.o_proj.lora_A"], ad["mtp.0.layer.self_attn.o_proj.lora_B"]
    assert torch.equal(m[o], b[o].float() + (B @ A) * 2.0)
    assert torch.equal(m[bias], new_bias)
    for n in set(b) - {o, bias}:
        assert torch.equal(m[n], b[n].float()), n


def test_merge_refuses(tmp_path):
    from dsv3_plugin.checkpoint.lora_merge import write_merged_release

    cfg = _cfg({"rank": 2, "alpha": 4, "targets": ["o_proj"]})
    base = write_tiny_release(tmp_path / "base", fp8=True)
    ad = lora_adapters(cfg, cfg.lora)
    huge = {k: v * 1e30 for k, v in ad.items()}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    cases = [
        (ad, {"to": "hf-fp16"}, "merge target 'hf-fp16'"),
        (ad, {"replace": {"model.layers.9.mlp.gate.e_score_correction_bias": torch.zeros(16)}}, "replaces no tensor"),
        (ad, {"replace": {bias: torch.zeros(3)}}, r"e_score_correction_bias: replaces no tensor of shape \[3\]"),
        (huge, {}, r"o_proj\.weight: non-finite values \(merged with its LoRA adapter\)"),
    ]
    for i, (adapters, kw, match) in enumerate(cases):
        with pytest.raises(CheckpointError, match=match) as e:
            write_merged_release(base, tmp_path / f"x{i}", adapters, cfg, cfg.lora, **kw)
        assert "\n" not in str(e.value)
        assert not os.path.exists(tmp_path / f"x{i}")
    write_merged_release(base, tmp_path / "ok", ad, cfg, cfg.lora)
    with pytest.raises(CheckpointError, match="already exists"):
        write_merged_release(base, tmp_path / "ok", ad, cfg, cfg.lora)
