"""DeepSpeed bf16 on the dsv3 path, without processes: what the engine prepares and what the validation refuses
(the live engines are inspected in tests/dist/test_train_bf16.py)."""

import pytest
import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.deepspeed import split_ds_config
from dsv3_plugin.deepspeed.engine import check_fp32_router_state, mixed_precision_dtype, prepare_mixed_precision
from dsv3_plugin.deepspeed.run_config import validate_ds_config
from dsv3_plugin.training.transforms import build_model


def _ds(**top):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {"preset": "tiny"},
        **top,
    }


def test_mixed_precision_dtype_follows_the_enabled_section():
    assert mixed_precision_dtype(_ds()) is None
    assert mixed_precision_dtype(_ds(bf16={"enabled": False})) is None
    assert mixed_precision_dtype(_ds(bf16={"enabled": True})) is torch.bfloat16
    assert mixed_precision_dtype(_ds(fp16={"enabled": True})) is torch.float16


def test_prepare_lets_router_weights_follow_the_model_dtype_and_keeps_the_bias_fp32():
    """Without bf16 nothing changes (the router weight stays FP32 under .to(bf16), as before); with it the weight
    becomes a BF16 compute copy (one dtype for ZeRO's flat buffers) while bias and counts stay FP32."""
    model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    prepare_mixed_precision(model, _ds())
    model.to(torch.bfloat16)
    assert {m.gate.weight.dtype for m in model.moe_layers()} == {torch.float32}
    model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    prepare_mixed_precision(model, _ds(bf16={"enabled": True}))
    model.to(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for moe in model.moe_layers():
        assert moe.gate.e_score_correction_bias.dtype == moe.gate.tokens_per_expert.dtype == torch.float32
    check_fp32_router_state(model)
    # what a cast of the buffers (data_types.buffer_dtype) would do is caught
    name = "layers.1.mlp.gate.e_score_correction_bias"
    gate = model.get_submodule("layers.1.mlp.gate")
    gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.bfloat16()
    with pytest.raises(RuntimeError, match=name.replace(".", r"\.")):
        check_fp32_router_state(model)


def test_a_cast_of_the_model_keeps_the_router_state_exact():
    """A loaded bias (released checkpoints carry non-zero FP32 biases) must survive the engine's BF16 cast
    bit for bit, not come back as a BF16-rounded FP32 (1.001 -> 1.0); the same for the kept FP32 weight."""
    for bf16_section in (False, True):
        model = build_model(DSv3Config.from_block({"preset": "tiny"}))
        g = torch.Generator().manual_seed(0)
        for moe in model.moe_layers():
            moe.gate.e_score_correction_bias.copy_(
                1 + torch.rand(moe.gate.e_score_correction_bias.shape, generator=g) * 1e-3
            )
            moe.gate.tokens_per_expert.copy_(torch.arange(moe.gate.tokens_per_expert.numel()) + 2**24 + 1)
        before = {n: b.clone() for n, b in model.named_buffers() if "gate." in n}
        w_before = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("gate.weight")}
        prepare_mixed_precision(model, _ds(bf16={"enabled": bf16_section}))
        model.to(torch.bfloat16)
        for n, b in model.named_buffers():
            if n in before:
                assert b.dtype == torch.float32 and torch.equal(b, before[n]), n
        for n, p in model.named_parameters():
            if n in w_before:  # kept FP32 and exact without the bf16 section; a BF16 compute copy with it
                assert torch.equal(p, w_before[n] if not bf16_section else w_before[n].bfloat16()), n


def test_gating_math_stays_fp32_with_a_bf16_router_weight():
    model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    prepare_mixed_precision(model, _ds(bf16={"enabled": True}))
    model.to(torch.bfloat16)
    gate = model.moe_layers()[0].gate
    x_TH = torch.randn(5, gate.weight.shape[1]).bfloat16()
    out = gate(x_TH)
    assert out.scores_TE.dtype == out.gates_TK.dtype == torch.float32
    # the same op sequence as Router.scores on FP32 copies of the BF16 operands
    assert torch.equal(out.scores_TE, torch.sigmoid(torch.nn.functional.linear(x_TH.float(), gate.weight.float())))


@pytest.mark.parametrize("value", ["bf16", "fp16"])
def test_buffer_dtype_that_would_cast_the_router_bias_is_refused(value):
    d = _ds(bf16={"enabled": True}, data_types={"buffer_dtype": value})
    with pytest.raises(ConfigError, match=r"^data_types\.buffer_dtype: must be absent or fp32"):
        split_ds_config(d)
    with pytest.raises(ConfigError, match=r"^data_types\.buffer_dtype"):
        validate_ds_config(d, target="train", world_size=1)
    split_ds_config(_ds(bf16={"enabled": True}, data_types={"buffer_dtype": "fp32"}))  # accepted
    split_ds_config(_ds(data_types={"buffer_dtype": value}))  # FP32 training: DeepSpeed casts nothing then


def test_fp32_gradient_accumulation_is_refused_with_pipeline_parallelism():
    d = _ds(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}, gradient_accumulation_steps=2)
    d["dsv3"] = {"preset": "tiny", "parallel": {"pp": 2, "schedule": "dualpipev"}, "model": {"num_hidden_layers": 2}}
    with pytest.raises(ConfigError, match=r"^data_types\.grad_accum_dtype: 'fp32' with bf16 and dsv3\.parallel\.pp"):
        validate_ds_config(d, target="train", world_size=2)
    d["dsv3"]["parallel"] = {"pp": 1}
    validate_ds_config(d, target="train", world_size=2)  # pp = 1: DeepSpeed's BF16_Optimizer, supported


def test_memory_bound_counts_bf16_weights_gradients_and_activations_at_2_bytes():
    """The host-memory check is a lower bound: under bf16 the module's weights, gradients and activations are
    2-byte; the FP32 master and moments (optimizer term) and the FP32 build are unchanged."""
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.deepspeed.validate import check_memory

    cfg = DSv3Config.from_block({"preset": "tiny"})
    fp32 = check_memory(cfg, _ds(), 1, 1, 2**62).parts
    bf16 = check_memory(cfg, _ds(bf16={"enabled": True}), 1, 1, 2**62).parts
    assert bf16["weights"] * 2 == fp32["weights"] and bf16["gradients"] * 2 == fp32["gradients"]
    assert bf16["optimizer"] == fp32["optimizer"] and bf16["build"] == fp32["build"]
    assert bf16["activations"] < fp32["activations"]  # (the logits' FP32 copy for the loss stays 4 B)


def test_fp8_gemms_take_bf16_inputs():
    """fp8.enabled under bf16: an FP8 Linear quantizes an FP32 copy of its BF16 operands (the same FP8 bytes and
    scales as from those values in FP32) and accumulates in FP32, so with BF16 operands every result is the
    FP32-operand result cast to BF16: output, input gradient, and weight gradient (in the weight's dtype)."""
    from dsv3_plugin.precision.fp8 import fp8_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(128, 256, generator=g) * 0.05).bfloat16().requires_grad_()
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y, y32 = fp8_linear(x, w), fp8_linear(x32, w32)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    dy = torch.randn(4, 128, generator=g).bfloat16()
    y.backward(dy)
    y32.backward(dy.float())
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, x32.grad.bfloat16()) and torch.equal(w.grad, w32.grad.bfloat16())


def _cast_like_deepspeed(model):
    prepare_mixed_precision(model, _ds(bf16={"enabled": True}))
    return model.to(torch.bfloat16)  # what deepspeed.initialize does to the module under bf16


@pytest.mark.parametrize("world,rank,fp8", [(1, 0, False), (4, 3, False), (1, 0, True)])
def test_dsv3_train_builds_in_bf16_directly_with_the_values_of_the_cast_fp32_build(tmp_path, world, rank, fp8):
    """`dsv3 train` under bf16 creates parameters in BF16 (no FP32 copy of the model first), from scratch and from
    a released FP8 checkpoint; after the engine's cast both are bit-identical to an FP32 build cast the same way
    (each tensor is drawn / dequantized in FP32 and rounded once), router bias and counts FP32 and exact."""
    from helpers import write_rank_local_checkpoint

    from dsv3_plugin.checkpoint.hf import load_pretrained
    from dsv3_plugin.checkpoint.init_from import build_train_model as _build_model
    from dsv3_plugin.training.rank_local import RankLayout

    cfg, _ = write_rank_local_checkpoint(tmp_path / "ck")
    if fp8:  # the FP8 Linear / expert transforms wrap the BF16-built modules as they wrap the FP32 ones
        cfg = cfg.model_copy(update={"fp8": cfg.fp8.model_copy(update={"enabled": True})})
    if world > 1:
        cfg = cfg.model_copy(
            update={"parallel": cfg.parallel.model_copy(update={"pp": 2, "ep": 2, "schedule": "dualpipev"})}
        )
    layout = RankLayout.for_rank(cfg, rank, world)
    for init_from in (None, str(tmp_path / "ck")):
        torch.manual_seed(7)
        direct = _build_model(cfg, init_from, rank=rank, world=world, dtype=torch.bfloat16)
        assert {
            p.dtype for n, p in direct.named_parameters() if not n.endswith("gate.weight") and p.device.type != "meta"
        } == {torch.bfloat16}  # owned ones
        torch.manual_seed(7)
        ref = (
            _build_model(cfg, None, rank=rank, world=world)
            if init_from is None
            else load_pretrained(
                init_from,
                layout=None if layout.is_full else layout,
                **{s: cfg.to_dict()[s] for s in ("moe", "mtp", "parallel", "fp8", "memory", "train")},
            )
        )
        a, b = _cast_like_deepspeed(direct).state_dict(), _cast_like_deepspeed(ref).state_dict()
        assert a.keys() == b.keys()
        for k in a:
            if a[k].device.type != "meta":
                assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (init_from, k)
        biases = [v for k, v in a.items() if k.endswith("e_score_correction_bias") and v.device.type != "meta"]
        assert biases and all(v.dtype == torch.float32 for v in biases)
