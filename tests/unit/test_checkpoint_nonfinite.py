"""Non-finite checkpoints are refused (CheckpointError naming tensor and shard; CLI exit 2) by every entry point
that reads weights (`CheckpointReader`, `load_pretrained`, `dsv3 convert`, `dsv3 generate`), unless the opt-out
`allow_non_finite` / `--allow-non-finite` is given; and the fast FP8 dequantization decodes E4M3's NaN code as
DeepSeek's formula `float(w_fp8) * scale` does: as NaN."""

import os
import re
import shutil

import pytest
import torch
from test_checkpoint_reader import KV, _rewrite, _shard_of, tiny_hf_cfg

from dsv3_plugin import load_pretrained
from dsv3_plugin.checkpoint.convert import convert
from dsv3_plugin.checkpoint.reader import CheckpointReader, dequantize_fp8_blockwise, dequantize_fp8_reference
from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.errors import CheckpointError

NORM = "model.layers.0.input_layernorm.weight"  # BF16 in the file
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"  # FP32 in the file
EMB = "model.layers.3.eh_proj.weight"  # BF16 in the release, 2-D


def _same_bits_nan_aware(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 7), (300, 1100), (1100, 1030)])
def test_fast_dequant_decodes_e4m3_nan_code_as_nan(shape, dtype):
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(shape, generator=g) * 4).to(torch.float8_e4m3fn)
    u8 = w.view(torch.uint8).view(-1)
    u8[::97] = 0x7F  # +NaN code
    u8[5::131] = 0xFF  # -NaN code
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    s = torch.rand(grid, generator=g) * 1e-2 + 1e-4
    ref = dequantize_fp8_reference(w, s, dtype=dtype)
    fast = dequantize_fp8_blockwise(w, s, dtype=dtype)
    assert int(torch.isnan(ref).sum()) == int(((u8 & 0x7F) == 0x7F).sum()) > 0
    assert _same_bits_nan_aware(fast, ref)
    with pytest.raises(CheckpointError, match=r"^w in f\.safetensors: \d+ FP8 NaN codes"):
        dequantize_fp8_blockwise(w, s, dtype=dtype, name="w", file="f.safetensors", check_finite=True)


def test_fast_dequant_e5m2_inf_and_nan_codes():
    w = torch.randn(200, 150).to(torch.float8_e5m2)
    u8 = w.view(torch.uint8).view(-1)
    u8[3], u8[10], u8[20] = 0x7C, 0xFC, 0x7E  # +Inf, -Inf, NaN
    s = torch.full((2, 2), 0.5)
    assert _same_bits_nan_aware(
        dequantize_fp8_blockwise(w, s, dtype=torch.float32), dequantize_fp8_reference(w, s, dtype=torch.float32)
    )
    with pytest.raises(CheckpointError, match=r"3 FP8 Inf/NaN codes"):
        dequantize_fp8_blockwise(w, s, check_finite=True, name="w")


# ---- one damaged value per case, in a sharded FP8 checkpoint ----------------------------------------
def _set_fp8_code(d):
    u8 = d[KV].view(torch.uint8).clone()
    u8[3, 5] = 0x7F
    d[KV] = u8.view(torch.float8_e4m3fn)


def _scale(value):
    def edit(d):
        s = d[KV + "_scale_inv"].clone()
        s[1, 0] = value
        d[KV + "_scale_inv"] = s

    return edit


def _bf16(name, value):
    def edit(d):
        t = d[name].clone()
        t.view(-1)[7] = value
        d[name] = t

    return edit


CASES = {  # case: (tensor whose shard is edited, edit, message regex (after the shard name check))
    "fp8_nan_code": (KV, _set_fp8_code, re.escape(KV) + r" in .*: 1 FP8 NaN codes"),
    "inf_scale": (KV, _scale(float("inf")), re.escape(KV + "_scale_inv") + r" in .*: 1 \+Inf among 4 block scales"),
    "nan_scale": (KV, _scale(float("nan")), re.escape(KV + "_scale_inv") + r" in .*: 1 NaN among 4 block scales"),
    "zero_scale": (KV, _scale(0.0), re.escape(KV + "_scale_inv") + r" in .*: 1 zero among 4 block scales"),
    "negative_scale": (KV, _scale(-0.01), re.escape(KV + "_scale_inv") + r" in .*: 1 negative among 4 block scales"),
    "subnormal_scale": (
        KV,
        _scale(1e-40),
        re.escape(KV + "_scale_inv") + r" in .*: 1 subnormal \(< 1\.17549e-38\) among 4 block scales",
    ),
    "overflowing_scale": (
        KV,
        _scale(1e37),
        re.escape(KV + "_scale_inv") + r" in .*: block scale 1e\+37 would overflow",
    ),
    "nan_bf16_weight": (NORM, _bf16(NORM, float("nan")), re.escape(NORM) + r" in .*: 1 NaN among 64 values"),
    "neg_inf_bf16_eh_proj": (EMB, _bf16(EMB, float("-inf")), re.escape(EMB) + r" in .*: 1 -Inf among"),
    "inf_fp32_router_bias": (BIAS, _bf16(BIAS, float("inf")), re.escape(BIAS) + r" in .*: 1 \+Inf among"),
}


SCALE_VALUE_CASES = {"zero_scale", "negative_scale", "subnormal_scale"}  # finite, but not a quantizer's scale


def make_loadable_fp8_ckpt(path, shard_bytes=40_000, block=(32, 32)):
    """A sharded FP8 checkpoint `load_pretrained` accepts: the MTP block's embedding/head copies equal the
    main ones (values are a function of the canonical tensor name)."""
    cfg = tiny_hf_cfg()
    L = cfg["num_hidden_layers"]
    canon = {
        f"model.layers.{L}.embed_tokens.weight": "model.embed_tokens.weight",
        f"model.layers.{L}.shared_head.head.weight": "lm_head.weight",
    }

    def make(name, shape):
        g = torch.Generator().manual_seed(sum(map(ord, canon.get(name, name))))
        return torch.randn(shape, generator=g) * 0.05 + (1.0 if len(shape) == 1 else 0.0)

    write_released_checkpoint(str(path), cfg, make, shard_bytes=shard_bytes, block=block)
    return str(path)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = make_loadable_fp8_ckpt(tmp_path_factory.mktemp("nf") / "clean")
    load_pretrained(d)  # the undamaged checkpoint loads
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_non_finite_refused_everywhere_and_allowed_on_request(clean, tmp_path, capsys, case):
    name, edit, msg = CASES[case]
    d = str(tmp_path / "src")
    shutil.copytree(clean, d)
    fn = _shard_of(d, name)
    _rewrite(d, fn, edit)
    full = msg.replace(r" in .*:", r" in " + re.escape(os.path.join(d, fn)) + ":")  # tensor and shard
    where = full + r".*--allow-non-finite"

    with CheckpointReader(d) as r, pytest.raises(CheckpointError, match=full):
        r.get(name)
    with pytest.raises(CheckpointError, match=where):
        load_pretrained(d)
    dst = tmp_path / "out"
    assert cli_main(["convert", d, str(dst), "--to", "hf-bf16", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(full, err), err
    assert not dst.exists()
    assert cli_main(["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    assert re.search(where, capsys.readouterr().err)

    # the opt-out: the damaged value travels through (as NaN/Inf, or as the block the bad scale makes), nothing
    # else changes
    state = load_pretrained(d, allow_non_finite=True).state_dict()
    finite_result = case in SCALE_VALUE_CASES  # a zero / negative / subnormal scale dequantizes to finite values
    assert finite_result == all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
    assert cli_main(["convert", d, str(dst), "--to", "hf-bf16", "--no-progress", "--allow-non-finite"]) == 0
    with CheckpointReader(dst, allow_non_finite=True) as r:
        assert finite_result == bool(torch.isfinite(r.get(name).float()).all())
    if not finite_result:
        with CheckpointReader(dst) as r, pytest.raises(CheckpointError, match=re.escape(name)):
            r.get(name)
    capsys.readouterr()
    assert (
        cli_main(["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--allow-non-finite"]) == 0
    )


def test_megatron_layout_non_finite_refused_and_allowed(clean, tmp_path, capsys):
    meg = str(tmp_path / "meg")
    convert(clean, meg, "megatron", pp=2, ep=2, progress=False)
    from safetensors.torch import load_file, save_file

    fn = "mp_rank_pp000_ep000.safetensors"
    sd = load_file(os.path.join(meg, fn))
    key = "decoder.layers.0.input_layernorm.weight"
    sd[key] = sd[key].clone()
    sd[key][2] = float("nan")
    save_file(sd, os.path.join(meg, fn), metadata={"format": "pt"})
    assert cli_main(["convert", meg, str(tmp_path / "back"), "--to", "hf", "--no-progress"]) == 2
    assert re.search(re.escape(key) + r" .*" + re.escape(fn) + ": 1 NaN", capsys.readouterr().err)
    assert not (tmp_path / "back").exists()
    from dsv3_plugin.checkpoint.convert import load_megatron_rank

    with pytest.raises(CheckpointError, match=re.escape(key) + " in .*" + re.escape(fn)):
        load_megatron_rank(meg, 0, 0)
    assert torch.isnan(load_megatron_rank(meg, 0, 0, allow_non_finite=True)[key]).sum() == 1
    assert cli_main(["convert", meg, str(tmp_path / "back"), "--to", "hf", "--no-progress", "--allow-non-finite"]) == 0
