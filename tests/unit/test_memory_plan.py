"""`dsv3 memory-plan`: the activation formula matches what the model saves; schedule factors and ZeRO-1."""
import json

import pytest
import torch

from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, load_config
from dsv3_plugin.training.memory_plan import layer_activation_bytes, param_counts, plan
from dsv3_plugin.training.transforms import build_model
from dsv3_plugin.training.recompute import apply_recompute, saved_activation_bytes


@pytest.mark.parametrize("fp8", [False, True])
def test_activation_formula_matches_measured_saved_bytes(fp8):
    """Per-token slope of saved bytes (two token counts, so weight-sized FP8 copies cancel) vs the formula."""
    cfg = load_config({"preset": "small", "fp8": {"enabled": fp8}})
    m = build_model(cfg)

    def measured(layer, T):
        x = torch.randn(2, T, cfg.model.hidden_size, requires_grad=True)
        cos, sin = m.rope(T, x.device, x.dtype)
        return saved_activation_bytes(m, lambda: layer(x, cos, sin))

    for mode in ("none", "norm_and_mla_up", "full"):
        apply_recompute(m, mode)
        for li in (0, 1):                                                # dense layer, MoE layer
            slope = (measured(m.layers[li], 96) - measured(m.layers[li], 32)) / 128
            est = layer_activation_bytes(cfg, li >= 1, mode, fp8, act_bytes=4)   # the model runs in fp32
            assert 0.8 < est / slope < 1.2, (mode, li, est, slope)


def test_param_counts_match_model():
    cfg = load_config({"preset": "tiny"})
    m = build_model(cfg)
    pc = param_counts(cfg)
    attn = sum(p.numel() for p in m.layers[0].self_attn.parameters()) + 2 * cfg.model.hidden_size
    assert pc["attn"] == attn
    assert pc["routed_experts"] == sum(p.numel() for p in m.layers[1].mlp.experts.parameters())
    assert pc["router"] == m.layers[1].mlp.gate.weight.numel()
    assert pc["embed"] == m.embed_tokens.weight.numel()


def test_v3_plan_shapes_and_schedule_relations():
    cfg = load_config({"preset": "v3-671b"})
    rows = {r.schedule: r for r in plan(cfg, pp=16, ep=64, dp=128)}
    # DualPipe keeps two stages per rank (2x parameters); DualPipeV one model copy over 2*PP chunks
    assert rows["dualpipe"].params_GiB > 1.8 * rows["1f1b"].params_GiB
    assert rows["dualpipev"].params_GiB < rows["dualpipe"].params_GiB
    total_params = sum(param_counts(cfg)[k] for k in ("embed", "head")) + 3 * (
        param_counts(cfg)["attn"] + param_counts(cfg)["dense_mlp"]) + 58 * (
        param_counts(cfg)["attn"] + param_counts(cfg)["shared_experts"] + param_counts(cfg)["router"]
        + param_counts(cfg)["routed_experts"])
    assert 660e9 < total_params < 680e9                                 # 671B without MTP (report: 671B)
    small = {r.schedule: r for r in plan(cfg, 16, 64, 128, bf16_moments=True, recompute="norm_and_mla_up",
                                         fp8=True)}
    for s in rows:
        assert small[s].optimizer_GiB < rows[s].optimizer_GiB
        assert small[s].activations_GiB < rows[s].activations_GiB
    # ZeRO-1: more DP replicas -> less optimizer state per rank, same params
    big_dp = {r.schedule: r for r in plan(cfg, 16, 64, 256)}
    assert big_dp["1f1b"].optimizer_GiB < rows["1f1b"].optimizer_GiB
    assert big_dp["1f1b"].params_GiB == rows["1f1b"].params_GiB
    with pytest.raises(ConfigError, match=r"dsv3\.parallel\.ep"):
        plan(cfg, 16, 64, 100)


def test_cli_table_json_and_bad_input(capsys):
    assert main(["memory-plan", "--preset", "v3-671b", "--pp", "16", "--ep", "64", "--dp", "128"]) == 0
    out = capsys.readouterr().out
    assert "dualpipev" in out and "optimizer_GiB" in out
    assert main(["memory-plan", "--preset", "v3-671b", "--pp", "16", "--ep", "64", "--dp", "128", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in d["ranks"]] == ["1f1b", "dualpipe", "dualpipev"] and d["world_size"] == 2048
    assert main(["memory-plan", "--preset", "v3-671b", "--pp", "16", "--ep", "64", "--dp", "96"]) == 2
    assert "dsv3.parallel.ep" in capsys.readouterr().err
