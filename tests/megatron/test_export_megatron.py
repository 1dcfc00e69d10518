"""`dsv3 export` of a real Megatron-LM training checkpoint: `python -m dsv3_plugin.megatron.pretrain_gpt --save`
(2 ranks, torch_dist, the tiny model with MTP, 1 iteration) -> the released format. The exported tensors equal the
checkpoint's (read here with torch's own reader, names written out by hand) rounded to BF16, every released tensor is
there, our loader reads the result, and `--config` is required.

Needs megatron-core >= 0.19 (`megatron.training` in the wheel): skipped on 0.16.1, run by `make test`'s 0.19 run.
"""

import json
import os
import sys

import pytest
import torch
from helpers import run_module, tiny_megatron_args

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")
pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = tiny_megatron_args(1, gbs=4, seq=16, cosine=False) + ["--save-interval", "1"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlm")
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    cmd = [
        sys.executable,
        "-m",
        "dsv3_plugin.megatron.pretrain_gpt",
        "--nproc",
        "2",
        "--dsv3-config",
        str(tmp / "ds.json"),
        *FLAGS,
        "--save",
        str(tmp / "ck"),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = run_module(cmd, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return tmp


def _read(it_dir: str, keys: list[str]) -> dict:
    """The checkpoint's tensors through torch's own reader (our own test file: its pickle is trusted here)."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load

    md = FileSystemReader(it_dir).read_metadata().state_dict_metadata
    out = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        load(out, storage_reader=FileSystemReader(it_dir), no_dist=True)
    return out


def test_export_of_a_megatron_lm_checkpoint(saved, capsys):
    from safetensors.torch import load_file

    from dsv3_plugin.checkpoint.hf import load_pretrained
    from dsv3_plugin.cli import main as cli_main

    tmp = saved
    dst = tmp / "hf"
    assert cli_main(["export", str(tmp / "ck"), str(dst), "--to", "hf-bf16", "--no-progress"]) == 2
    assert "--config" in capsys.readouterr().err
    assert (
        cli_main(
            ["export", str(tmp / "ck"), str(dst), "--to", "hf-bf16", "--config", str(tmp / "ds.json"), "--no-progress"]
        )
        == 0
    )
    with open(dst / "model.safetensors.index.json") as f:
        files = set(json.load(f)["weight_map"].values())
    got = {k: v for fn in files for k, v in load_file(str(dst / fn)).items()}
    L = 3  # the tiny preset's decoder layers; the MTP block is released layer 3
    pairs = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "output_layer.weight": "lm_head.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "decoder.layers.0.mlp.dense.gate_proj.weight": "model.layers.0.mlp.gate_proj.weight",
        "decoder.layers.2.self_attention.linear_kv_up_proj.weight": "model.layers.2.self_attn.kv_b_proj.weight",
        "decoder.layers.1.mlp.moe.gate.e_score_correction_bias": "model.layers.1.mlp.gate.e_score_correction_bias",
        "mtp.layers.0.eh_proj.weight": f"model.layers.{L}.eh_proj.weight",
        "mtp.layers.0.final_layernorm.weight": f"model.layers.{L}.shared_head.norm.weight",
        "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight": (
            f"model.layers.{L}.self_attn.q_a_proj.weight"
        ),
    }
    stacked = {
        "decoder.layers.2.mlp.moe.experts.down_proj": "model.layers.2.mlp.experts.{e}.down_proj.weight",
        "mtp.layers.0.transformer_layer.mlp.moe.experts.gate_proj": (
            f"model.layers.{L}.mlp.experts.{{e}}.gate_proj.weight"
        ),
    }
    it_dir = str(tmp / "ck" / "iter_0000001")
    ref = _read(it_dir, [*pairs, *stacked])
    for m, r in pairs.items():
        want = ref[m] if r.endswith("bias") else ref[m].to(torch.bfloat16)
        assert got[r].dtype == want.dtype and torch.equal(got[r], want), (m, r)
    for m, pattern in stacked.items():
        for e in range(ref[m].shape[0]):
            assert torch.equal(got[pattern.format(e=e)], ref[m][e].to(torch.bfloat16)), (m, e)
    assert torch.equal(got[f"model.layers.{L}.embed_tokens.weight"], got["model.embed_tokens.weight"])
    model = load_pretrained(dst)  # every released tensor present, shapes and MTP copies as the loader wants
    assert model.cfg.mtp.depth == 1 and model.cfg.model.num_hidden_layers == L
