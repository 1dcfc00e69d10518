"""A released FP8 checkpoint straight into Megatron-Core: `GPTModel` built from our spec, filled by
`dsv3_plugin.megatron.weights.load_hf_checkpoint` from the FP8 files (E4M3 weights + `weight_scale_inv`, made by
`checkpoint.synthetic`), against transformers on the same files (fp32).

What is compared, per case:
- main logits [B, T, V]: Megatron vs transformers' `DeepseekV3ForCausalLM` holding the same files' weights,
  FP8 ones dequantized by DeepSeek's formula written out index by index in the test (transformers' own FP8
  loader needs `accelerate` and a scale grid that divides the weight; these files have ragged grids);
- MTP logits of every depth [B, T-k, V]: Megatron's MTP block vs the paper's formulas (eqs. 21-23) evaluated
  with transformers' decoder layer and RMSNorm on the same dequantized MTP tensors (transformers has no MTP);
- that the weights really came from FP8 and were dequantized exactly: loaded parameters (an attention
  projection with a ragged grid, a stacked routed expert row, an MTP-block expert) equal the formula's values
  bit for bit and differ from the values before quantization.
Both sides hold identical fp32 weights, so the README's fp32 logits figure (1e-5) applies as is.

Runs on megatron-core 0.16.1 and 0.19.2 (`make test` runs the tests/*/test_megatron_*.py files on both).
"""

import os
import zlib

import pytest
import torch
from helpers import dequantize_by_formula, mtp_reference_logits, read_stored_tensors, run_ranks, transformers_on
from tolerance import LOGITS_FP32_ABS, assert_within

CASES = {
    # q latent + YaRN, 1 dense + 2 MoE layers, 4 groups, MTP depth 1; 32x32 blocks: kv_a's 40 rows end in a
    # ragged block; sharded files
    "tiny_block32": ({}, (32, 32), 60_000),
    # no q latent, no YaRN, MTP depth 2; 128x128 blocks: every grid is one ragged block; one file
    "no_q_latent_mtp2_block128": (
        {"model": {"q_lora_rank": None, "rope_scaling": None}, "mtp": {"depth": 2}},
        (128, 128),
        None,
    ),
}
KV = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


def _make(cfg):
    """Seeded value of every released tensor (by name): norms ~1, weights ~0.05, router bias ~0.1. The MTP copies of
    the embedding/head get the main tensors' values, as released files do."""
    from dsv3_plugin.checkpoint.names import parse_released

    L = cfg.model.num_hidden_layers

    def make(name, shape):
        name = parse_released(name, L).row.copy_of or name
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        x = torch.randn(shape, generator=g)
        if name.endswith("e_score_correction_bias"):
            return 0.1 * x
        return 0.05 * x if len(shape) > 1 else 1 + 0.1 * x

    return make


def _worker(root, names):
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.gpt import build_gpt_model, forward_logits
    from dsv3_plugin.megatron.runtime import init_megatron, shutdown_megatron
    from dsv3_plugin.megatron.spec import MCORE_VERSION, mtp_inner_layer_name
    from dsv3_plugin.megatron.weights import load_hf_checkpoint

    init_megatron()
    out = {"version": MCORE_VERSION}
    for name in names:
        cfg = DSv3Config.from_block({"preset": "tiny", **CASES[name][0]})
        model = build_gpt_model(cfg).eval()
        load_hf_checkpoint(model, os.path.join(root, name, "fp8"))
        ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits, mtp = forward_logits(model, ids)
        sd = model.state_dict()
        inner = mtp_inner_layer_name()
        out[name] = {
            "ids": ids,
            "logits": logits,
            "mtp": mtp,
            "params": {
                KV: sd["decoder.layers.0.self_attention.linear_kv_down_proj.weight"],
                "model.layers.1.mlp.experts.5.up_proj.weight": sd["decoder.layers.1.mlp.moe.experts.up_proj"][5],
                f"model.layers.{cfg.model.num_hidden_layers}.mlp.experts.2.down_proj.weight": sd[
                    f"mtp.layers.0.{inner}.mlp.moe.experts.down_proj"
                ][2],
            },
        }
    shutdown_megatron()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint
    from dsv3_plugin.config import DSv3Config

    root = tmp_path_factory.mktemp("mega_fp8")
    refs = {}
    for name, (over, block, shard) in CASES.items():
        cfg = DSv3Config.from_block({"preset": "tiny", **over})
        d = os.path.join(root, name)
        make = _make(cfg)
        write_released_checkpoint(
            os.path.join(d, "fp8"),
            cfg.to_hf(),
            make,
            fp8=True,
            block=block,
            **({"shard_bytes": shard} if shard else {}),
        )
        stored = read_stored_tensors(os.path.join(d, "fp8"))
        deq = dequantize_by_formula(stored, block)
        refs[name] = {
            "cfg": cfg,
            "stored": stored,
            "deq": deq,
            "make": make,
            "hf": transformers_on(deq, cfg, os.path.join(d, "dequantized")),
        }
    got = run_ranks(_worker, 1, str(root), list(CASES))[0]
    return got, refs


@pytest.mark.parametrize("name", sorted(CASES))
def test_weights_come_from_fp8_dequantized_exactly(results, name):
    got, refs = results
    ref = refs[name]
    n_fp8 = sum(t.dtype == torch.float8_e4m3fn for t in ref["stored"].values())
    assert n_fp8 > 0.8 * sum(not n.endswith("_scale_inv") and t.dim() == 2 for n, t in ref["stored"].items())
    for n, p in got[name]["params"].items():
        assert ref["stored"][n].dtype == torch.float8_e4m3fn, n
        assert torch.equal(p, ref["deq"][n]), n  # the formula, bit for bit
        assert not torch.equal(p, ref["make"](n, tuple(p.shape))), n  # quantization changed it


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers_on_the_same_files(results, name):
    got, refs = results
    r, ref = got[name], refs[name]
    with torch.no_grad():
        want = ref["hf"](r["ids"]).logits
    assert r["logits"].shape == want.shape
    assert want.abs().mean() > 0.05  # real logits, not a degenerate model
    assert_within(
        r["logits"],
        want,
        LOGITS_FP32_ABS,
        f"{name} (megatron-core {got['version']}): GPTModel from FP8 files vs transformers",
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_mtp_logits_match_the_formula_on_the_same_files(results, name):
    got, refs = results
    r, ref = got[name], refs[name]
    want = mtp_reference_logits(ref["cfg"], ref["deq"], ref["hf"], r["ids"])
    assert len(r["mtp"]) == len(want) == ref["cfg"].mtp.depth >= 1
    for k, (g, w) in enumerate(zip(r["mtp"], want), 1):
        assert g.shape == w.shape == (2, 24 - k, ref["cfg"].model.vocab_size)
        assert_within(
            g,
            w,
            LOGITS_FP32_ABS,
            f"{name} (megatron-core {got['version']}): Megatron MTP depth {k} vs eqs. 21-23 with transformers' block",
        )
