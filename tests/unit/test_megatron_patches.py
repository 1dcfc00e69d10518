"""patches/megatron_cpu.py (reversible, version-guarded, never on CUDA machines), plugin import side effects,
the SDPA core attention and the DSv3Config -> Megatron config bridge. Single process, no process group."""

import importlib
import math
import os
import sys

import pytest
import torch
from tolerance import assert_within, reorder_bound

# `patches/` installs as `dsv3_plugin_patches` (pyproject.toml, [tool.setuptools.package-dir]).
megatron_cpu = importlib.import_module("dsv3_plugin_patches.megatron_cpu")


def _megatron_state():
    import megatron.core.optimizer.clip_grads as cg
    import megatron.core.optimizer.optimizer as mopt
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    import torch._dynamo.eval_frame as eval_frame

    return (
        eval_frame._stance,  # torch.compile's stance: force_eager while applied
        "te_general_gemm" in vars(moe_utils),
        torch.cuda.current_device,
        mrandom._CUDA_RNG_STATE_TRACKER,
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        mla.HAVE_TE,
        mopt.FP32Optimizer.__dict__["__init__"],
        mopt.clip_grad_by_total_norm_fp32,
        cg.get_grad_norm_fp32,
    )


def test_importing_the_package_does_not_import_megatron():
    import subprocess

    code = (
        "import sys, dsv3_plugin.megatron as m; assert 'megatron' not in sys.modules, 'megatron imported'; "
        "assert 'dsv3_plugin_patches.megatron_cpu' not in sys.modules"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env={**os.environ, "PYTHONPATH": root})


def test_importing_the_plugin_changes_nothing():
    before = _megatron_state()
    import dsv3_plugin.megatron as plugin

    for mod in ("spec", "moe", "attention", "config", "gpt", "weights", "runtime", "pretrain_gpt"):
        importlib.import_module(f"dsv3_plugin.megatron.{mod}")
    plugin.get_layer_spec(False)
    assert _megatron_state() == before
    assert not megatron_cpu.is_applied()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are never applied on CUDA machines")
def test_apply_and_revert_restore_the_exact_objects():
    import megatron.core.transformer.multi_latent_attention as mla

    before = _megatron_state()
    assert megatron_cpu.apply() is True
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
        assert mla.HAVE_TE is False
        import megatron.core.transformer.moe.moe_utils as moe_utils

        assert moe_utils.te_general_gemm is None  # bound (0.16.1 without TE leaves it unbound)
        assert _megatron_state() != before
        assert megatron_cpu.apply() is True  # idempotent
    finally:
        megatron_cpu.revert()
    assert _megatron_state() == before
    with megatron_cpu.cpu_shims():
        assert megatron_cpu.is_applied()
    assert _megatron_state() == before


def test_untested_version_is_refused(monkeypatch):
    monkeypatch.setattr(megatron_cpu, "megatron_core_version", lambda: "0.17.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _megatron_state()
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 is untested"):
        megatron_cpu.apply()
    assert _megatron_state() == before


def test_not_applied_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _megatron_state()
    assert megatron_cpu.apply() is False
    assert not megatron_cpu.is_applied()
    assert _megatron_state() == before


def test_cpu_rng_tracker_forks_named_states():
    tracker = megatron_cpu.CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(1)
    outside = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outside)  # caller's stream untouched
    with tracker.fork():
        b = torch.rand(3)  # the named stream continues
    g = torch.Generator().manual_seed(7)
    ref = torch.rand(6, generator=g)
    assert torch.equal(torch.cat([a, b]), ref)


def _sdpa(k_dim=12, v_dim=8):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from dsv3_plugin.megatron.attention import SDPACoreAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, attention_dropout=0.0)
    return SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self", softmax_scale=0.3, k_channels=k_dim, v_channels=v_dim)


def test_sdpa_core_attention_matches_softmax_reference():
    attn = _sdpa()
    s, b, h = 5, 2, 2
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(s, b, h, 12, generator=g), torch.randn(s, b, h, 12, generator=g)
    v = torch.randn(s, b, h, 8, generator=g)
    out = attn(q, k, v, None)
    assert out.shape == (s, b, h * 8)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * 0.3
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, h * 8)
    assert_within(out, ref, _sdpa_bound(q, k, v, scores), "SDPA vs einsum-softmax reference")
    # Megatron's explicit mask (True = masked) combines with causality: masking key 0 changes row >= 1 only
    mask = torch.zeros(1, 1, s, s, dtype=torch.bool)
    mask[..., 0] = True
    mask[..., 0, 0] = False  # row 0 keeps its only key
    out2 = attn(q, k, v, mask)
    scores2 = scores.masked_fill(mask[0], -math.inf)
    ref2 = torch.einsum("bhst,tbhd->sbhd", scores2.softmax(-1), v).reshape(s, b, h * 8)
    assert_within(out2, ref2, _sdpa_bound(q, k, v, scores2), "SDPA with mask vs einsum-softmax reference")


def _sdpa_bound(q, k, v, scores_BHST, scale=0.3):
    """First-order bound for SDPA's kernel vs the einsum reference, both float32. Reordered: QKᵀ (K = d = 12),
    the softmax's max/exp/sum over the <= s keys, and PV (K = s). A score error δs moves p_t by
    <= p_t·(δs_t + Σ p δs); the output then adds Σ_t δp_t·|v_t| to PV's own rounding."""
    s = scores_BHST.shape[-1]
    ds = reorder_bound(q.shape[-1], scale * torch.einsum("sbhd,tbhd->bhst", q.abs(), k.abs()))
    p = scores_BHST.double().softmax(-1)
    dp = p * (ds + (p * ds).sum(-1, keepdim=True)) + reorder_bound(s + 2, p)  # + exp, Σ, divide
    va = v.abs().double()
    bound = torch.einsum("bhst,tbhd->sbhd", dp, va) + reorder_bound(s, torch.einsum("bhst,tbhd->sbhd", p, va))
    return bound.reshape(s, q.shape[1], -1)


def test_config_bridge_and_contradiction_errors():
    from dsv3_plugin.config import ConfigError, DSv3Config
    from dsv3_plugin.megatron.config import to_transformer_config

    cfg = DSv3Config.from_block({"preset": "tiny"})
    tc = to_transformer_config(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.q_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim) == (3, 64, 32, 16, 8)
    assert tc.moe_layer_freq == [0, 1, 1] and tc.moe_router_enable_expert_bias
    assert tc.moe_router_score_function == "sigmoid" and tc.moe_router_topk_scaling_factor == 2.5
    assert (tc.rope_type, tc.rotary_scaling_factor, tc.mscale_all_dim) == ("yarn", 4, 1.0)
    assert tc.mtp_num_layers == 1 and tc.dsv3_config is cfg
    plain = to_transformer_config(DSv3Config.from_block({"preset": "tiny", "model": {"rope_scaling": None}}))
    assert (plain.rope_type, plain.rotary_scaling_factor, plain.mscale_all_dim) == ("rope", 1.0, 0.0)
    with pytest.raises(ConfigError, match=r"^megatron\.num_layers"):
        to_transformer_config(cfg, num_layers=4)


def test_megatron_lm_args_must_agree_with_dsv3_config(tmp_path):
    import argparse
    import json

    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.megatron.gpt import transformer_config_from_args

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    ok = transformer_config_from_args(argparse.Namespace(dsv3_config=str(p), num_layers=3, hidden_size=None))
    assert ok.num_layers == 3
    with pytest.raises(ConfigError, match=r"^--hidden-size: 128 contradicts"):
        transformer_config_from_args(argparse.Namespace(dsv3_config=str(p), hidden_size=128))


def test_megatron_lms_own_script_reads_the_config_once_for_every_chunk(tmp_path):
    """Under Megatron-LM's own pretrain_gpt.py (patches/pretrain_gpt.diff) the builder of every model chunk asks for
    the run's config: the first reads `--dsv3-config`, the later ones get the same object; the typed functions
    refuse what is not a `DSv3Config`."""
    import argparse
    import json

    from dsv3_plugin.config import load_config
    from dsv3_plugin.megatron import config as mcfg
    from dsv3_plugin.megatron.gpt import transformer_config_from_args

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    args = argparse.Namespace(dsv3_config=str(p))
    before = mcfg.CONFIG_BUILDS
    chunks = [transformer_config_from_args(args) for _ in range(2)]
    assert mcfg.CONFIG_BUILDS == before + 1
    assert chunks[0].dsv3_config is chunks[1].dsv3_config is mcfg.run_config(args)
    assert mcfg.run_config(argparse.Namespace(dsv3_config=str(p))) is not chunks[0].dsv3_config  # another run
    with pytest.raises(TypeError, match=r"^to_transformer_config: takes a DSv3Config \(got dict\)"):
        mcfg.to_transformer_config({"preset": "tiny"})
    with pytest.raises(TypeError, match=r"^set_run_config: takes a DSv3Config \(got str\)"):
        mcfg.set_run_config(args, str(p))
    assert load_config(str(p)) == chunks[0].dsv3_config


def test_only_megatron_config_builds_run_configs():
    """`megatron/config.py` is the one module of dsv3_plugin/megatron that reads a config file or validates a block
    (what `CONFIG_BUILDS` counts); the others take the `DSv3Config` it built."""
    import ast
    import pathlib

    import dsv3_plugin.megatron

    readers = {"load_config", "read_ds_json", "model_validate", "DSv3Config", "FP8Config"}
    found = []
    for path in sorted(pathlib.Path(dsv3_plugin.megatron.__file__).parent.glob("*.py")):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in readers:
                    found.append(f"{path.name}:{node.lineno} {name}")
            elif isinstance(node, ast.ImportFrom) and node.module == "dsv3_plugin.config":
                found += [
                    f"{path.name}:{node.lineno} import {a.name}"
                    for a in node.names
                    if a.name in readers - {"DSv3Config", "FP8Config"}
                ]
    assert found == []


def test_spec_flag_selects_the_layer_spec():
    """Megatron-LM's `--spec MODULE NAME` is resolved, not just validated: ours by default (for the
    --transformer-impl given), any importable spec otherwise; a callable is called with the config."""
    import argparse

    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.megatron.gpt import selected_layer_spec
    from dsv3_plugin.megatron.spec import get_layer_spec

    ours = get_layer_spec(False)
    assert selected_layer_spec(argparse.Namespace(spec=None), None, False) is ours
    assert selected_layer_spec(argparse.Namespace(spec=["dsv3_plugin.megatron", "layer_spec"]), None, False) is ours
    other = selected_layer_spec(
        argparse.Namespace(spec=["megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"]), None, False
    )
    assert isinstance(other, ModuleSpec) and other is not ours  # Megatron's own local spec, called
    with pytest.raises(ConfigError, match=r"^--spec other.module layer_spec: cannot import"):
        selected_layer_spec(argparse.Namespace(spec=["other.module", "layer_spec"]), None, False)


def test_spec_reachable_the_way_megatron_lm_imports_it():
    from megatron.core.transformer.spec_utils import import_module
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from dsv3_plugin.megatron.attention import SDPACoreAttention

    spec = import_module(("dsv3_plugin.megatron", "layer_spec"))  # what `--spec dsv3_plugin.megatron layer_spec` does
    assert spec is not None and spec.module is TransformerLayer
    assert spec.submodules.self_attention.submodules.core_attention is SDPACoreAttention


def test_megatron_lm_integration_refuses_untested_version(monkeypatch):
    import megatron.core.package_info as pi

    from dsv3_plugin.megatron.gpt import check_megatron_version

    monkeypatch.delenv("DSV3_ALLOW_UNTESTED_MEGATRON", raising=False)
    monkeypatch.setattr(pi, "__version__", "0.18.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.18\.0 is untested"):
        check_megatron_version()


def test_schedules_follow_tokens_seen():
    import argparse

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.config import apply_schedules, follow_schedules, to_transformer_config
    from dsv3_plugin.megatron.gpt import _megatron_lm_tokens_seen

    cfg = DSv3Config.from_block(
        {
            "preset": "tiny",
            "moe": {
                "bias_update_schedule": [{"until_tokens": 1000, "value": 0.001}, {"until_tokens": None, "value": 0.0}]
            },
            "mtp": {
                "loss_weight_schedule": [{"until_tokens": 500, "value": 0.3}, {"until_tokens": None, "value": 0.1}]
            },
        }
    )
    tc = to_transformer_config(cfg)
    assert (tc.moe_router_bias_update_rate, tc.mtp_loss_scaling_factor) == (0.001, 0.3)
    assert apply_schedules(tc, 600) == (0.001, 0.1) and tc.mtp_loss_scaling_factor == 0.1
    assert apply_schedules(tc, 2000) == (0.0, 0.1) and tc.moe_router_bias_update_rate == 0.0

    class Fake(torch.nn.Module):  # stands in for the GPTModel: the hook only reads `.config`
        def __init__(self):
            super().__init__()
            self.config = to_transformer_config(cfg)

        def forward(self, x):
            return x

    args = argparse.Namespace(consumed_train_samples=0, seq_length=64)
    m = Fake()
    follow_schedules(m, lambda: _megatron_lm_tokens_seen(args))
    m(torch.zeros(1))
    assert m.config.moe_router_bias_update_rate == 0.001
    args.consumed_train_samples = 20  # 1280 tokens
    m(torch.zeros(1))
    assert (m.config.moe_router_bias_update_rate, m.config.mtp_loss_scaling_factor) == (0.0, 0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="uses the CPU shims")
def test_ffn_adapter_through_the_018_builder_protocol():
    """What TransformerLayer does from core 0.18 on (run for real by the 0.19 tests): `mlp = builder(config=,
    pg_collection=, is_mtp_layer=, name=)`, then `set_layer_number(n)`, then
    `mlp(hidden [s, b, h], padding_mask=...) -> (out, None)`."""
    import megatron.core.tensor_parallel.random as mrandom

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.config import to_transformer_config
    from dsv3_plugin.megatron.spec import _build_ffn

    cfg = DSv3Config.from_block({"preset": "tiny"})
    tc = to_transformer_config(cfg)
    with megatron_cpu.cpu_shims():
        tracker = mrandom._CUDA_RNG_STATE_TRACKER
        tracker.add("model-parallel-rng", 11)
        tracker.add(mrandom.get_expert_parallel_rng_tracker_name(), 12)
        dense = _build_ffn(config=tc, pg_collection=None, is_mtp_layer=False, name="decoder.layers.0.mlp")
        dense.set_layer_number(1)
        moe = _build_ffn(config=tc, pg_collection=None, is_mtp_layer=False, name="decoder.layers.1.mlp")
        moe.set_layer_number(2)
        mtp = _build_ffn(config=tc, pg_collection=None, is_mtp_layer=True, name="mtp.layers.0.mlp")
        mtp.set_layer_number(1)  # 0.19 numbers MTP layers 1..D (is_mtp_layer=True)
    assert (dense.kind, moe.kind, mtp.kind, mtp.num_mtp_shift) == ("dense", "moe", "moe", 1)
    x_SBH = torch.randn(6, 2, cfg.model.hidden_size, generator=torch.Generator().manual_seed(0))
    out, bias = dense(x_SBH, padding_mask=None)
    assert bias is None
    # the adapter calls the same modules on the same (transposed) views: identical op sequences, equal bits
    assert torch.equal(out, dense.dense(x_SBH))
    moe.eval()
    out, _ = moe(x_SBH)
    assert torch.equal(out, moe.moe(x_SBH.transpose(0, 1)).transpose(0, 1))
    mtp.train()
    out, _ = mtp(x_SBH)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # the rolled-in padding row
    assert float(mtp.moe.gate.local_tokens_per_expert.sum()) == 5 * 2 * cfg.moe.top_k
    assert mtp.moe.gate.expert_bias is mtp.moe.gate.e_score_correction_bias
    pad = torch.zeros(2, 6, dtype=torch.bool)
    assert torch.equal(dense(x_SBH, padding_mask=pad | True)[0], dense.dense(x_SBH))
    assert torch.equal(moe(x_SBH, padding_mask=pad)[0], moe(x_SBH)[0])
    with pytest.raises(ValueError, match="padding_mask"):
        moe(x_SBH, padding_mask=pad | True)
