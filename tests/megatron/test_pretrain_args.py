"""`python -m dsv3_plugin.megatron.pretrain_gpt`: Megatron-LM's own argument parsing + the "dsv3" block.

Megatron's model flags are filled from the dsv3 block or must agree with it (ConfigError naming both), flags that
would do nothing with our layers are refused, CUDA-only settings are refused on CPU, `--spec` really selects the
layer spec, and the vocabulary is Megatron's padded one. Needs `megatron.training` (megatron-core >= 0.19's
wheel): skipped on 0.16.1, run by the 0.19 environment of `make test`."""

import json
import os

import pytest
import torch
from helpers import run_ranks

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")
# These tests parse Megatron arguments in the pytest process, not in a launched rank: without torch.distributed or
# RANK, the print_rank_0 inside Megatron's validate_args warns that it assumes rank 0.
pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank from torch\\.distributed:UserWarning:megatron")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = [
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--seq-length",
    "16",
    "--train-iters",
    "2",
    "--lr",
    "1e-3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--eval-interval",
    "100",
    "--eval-iters",
    "0",
]


def dense_mlp_spec(config):
    """A different layer spec for `--spec test_pretrain_args dense_mlp_spec` (a callable, called with the config as
    Megatron-Core 0.19 does): ours with Megatron's own dense MLP in every layer (no experts)."""
    import dataclasses

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from dsv3_plugin.megatron.spec import get_layer_spec

    ours = get_layer_spec(False)
    mlp = ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    )
    return dataclasses.replace(ours, submodules=dataclasses.replace(ours.submodules, mlp=mlp))


@pytest.fixture()
def ds_json(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    return str(p)


def _parse(argv, **kw):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    return parse_megatron_args(argv, world_size=1, set_globals=False, **kw)


def test_model_flags_are_filled_from_the_dsv3_block(ds_json):
    from dsv3_plugin.config import load_config

    cfg = load_config(ds_json)
    args, notes = _parse(BASE + ["--dsv3-config", ds_json, "--num-layers", "3"], on_cpu=True)
    assert (args.num_layers, args.hidden_size, args.num_experts, args.moe_router_topk) == (
        3,
        cfg.model.hidden_size,
        cfg.moe.n_routed_experts,
        cfg.moe.top_k,
    )
    assert args.multi_latent_attention and args.moe_router_enable_expert_bias
    assert args.moe_router_score_function == "sigmoid" and args.mtp_num_layers == cfg.mtp.depth
    assert args.moe_layer_freq == [0] * cfg.model.first_k_dense_replace + [1] * (
        cfg.model.num_hidden_layers - cfg.model.first_k_dense_replace
    )
    assert args.vocab_size == cfg.model.vocab_size  # NullTokenizer sized from the block
    assert not any(n.startswith("--num-layers") for n in notes)  # given, agreeing: not a note
    assert "--swiglu (from dsv3.model (SwiGLU))" in notes
    assert "--distributed-backend gloo on CPU (NCCL needs CUDA)" in notes
    assert (args.distributed_backend, args.gradient_accumulation_fusion, args.transformer_impl) == (
        "gloo",
        False,
        "local",
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--moe-router-topk", "2"], r"^--moe-router-topk 2: contradicts .*ds\.json dsv3\.moe\.top_k = 4"),
        (["--num-layers", "4"], r"^--num-layers 4: contradicts .*dsv3\.model\.num_hidden_layers = 3"),
        (["--mtp-num-layers", "2"], r"^--mtp-num-layers 2: contradicts .*dsv3\.mtp\.depth = 1"),
        (["--moe-router-score-function", "softmax"], r"^--moe-router-score-function softmax: contradicts"),
        (["--vocab-size", "300"], r"^--vocab-size 300: contradicts .*dsv3\.model\.vocab_size = 256"),
        (["--moe-layer-freq", "1"], r"^--moe-layer-freq 1: contradicts .*dsv3\.model\.first_k_dense_replace"),
        (["--moe-expert-capacity-factor", "1.5"], r"^--moe-expert-capacity-factor 1\.5: token dropping changes"),
        (["--bf16"], r"^--bf16: not on CPU"),
        (["--distributed-backend", "nccl"], r"^--distributed-backend nccl: no CUDA on this machine"),
    ],
)
def test_contradictions_are_refused_naming_both(ds_json, flags, message):
    from dsv3_plugin.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        _parse(BASE + ["--dsv3-config", ds_json] + flags, on_cpu=True)


def test_megatron_moe_implementation_flags_say_what_runs_instead(ds_json):
    args, notes = _parse(BASE + ["--dsv3-config", ds_json, "--moe-token-dispatcher-type", "alltoall"], on_cpu=True)
    assert "--moe-token-dispatcher-type alltoall: EP = 1: every expert is local, no dispatch runs" in notes
    assert args.moe_token_dispatcher_type == "allgather"  # consumed: Megatron's default again


def test_megatron_moe_flags_allowed_with_a_megatron_spec(ds_json):
    args, _ = _parse(
        BASE
        + [
            "--dsv3-config",
            ds_json,
            "--moe-token-dispatcher-type",
            "alltoall",
            "--spec",
            "megatron.core.models.gpt.gpt_layer_specs",
            "get_gpt_layer_local_spec",
        ],
        on_cpu=False,
    )
    assert args.moe_token_dispatcher_type == "alltoall"


def test_cli_exit_code_2_names_the_flag(ds_json, capsys):
    from dsv3_plugin.megatron.pretrain_gpt import main

    assert main(BASE + ["--dsv3-config", ds_json, "--moe-router-topk", "2"]) == 2
    assert "error: --moe-router-topk 2: contradicts" in capsys.readouterr().err


def test_save_without_save_interval_is_one_line(ds_json, tmp_path, capsys):
    """Megatron-LM 0.19 refuses `--save` without `--save-interval` (a bare assertion in its validate_args): here one
    line naming both flags, exit 2."""
    from dsv3_plugin.megatron.pretrain_gpt import main

    ck = tmp_path / "ck"
    assert main(BASE + ["--dsv3-config", ds_json, "--save", str(ck)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --save {ck}: needs --save-interval N"), err
    assert not ck.exists()


def _build_worker(ds, extra):
    """One process: Megatron's parsing (+ tokenizer, padded vocab), then models built by the entry point's
    model_provider for several --spec values, from the same seed; logits on fixed tokens."""
    import dataclasses  # noqa: F401

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsv3_plugin.megatron.gpt import causal_inputs
    from dsv3_plugin.megatron.moe import DSv3FFN
    from dsv3_plugin.megatron.pretrain_gpt import model_provider, parse_megatron_args
    from dsv3_plugin.megatron.runtime import init_megatron, shutdown_megatron

    init_megatron()
    args, _ = parse_megatron_args(BASE + ["--dsv3-config", ds] + extra, on_cpu=True)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    out = {"padded_vocab_size": args.padded_vocab_size}
    for name, spec in [
        ("none", None),
        ("ours", ["dsv3_plugin.megatron", "layer_spec"]),
        ("dense_mlp", ["test_pretrain_args", "dense_mlp_spec"]),
    ]:
        args.spec = spec
        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        model = model_provider(True, True).eval()
        with torch.no_grad():
            logits = model(ids, *causal_inputs(ids))
        out[name] = {
            "logits": logits,
            "ffn": sum(isinstance(m, DSv3FFN) for m in model.modules()),
            "routers": sum(hasattr(m, "expert_bias") for m in model.modules()),
            "embedding_rows": model.embedding.word_embeddings.weight.shape[0],
            "output_rows": model.output_layer.weight.shape[0],
        }
    shutdown_megatron()
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    ds = d / "ds.json"
    ds.write_text(json.dumps({"dsv3": {"preset": "tiny"}}))
    return run_ranks(_build_worker, 1, str(ds), ["--make-vocab-size-divisible-by", "96"])[0]


def test_spec_flag_selects_the_layers(built):
    none, ours, dense = built["none"], built["ours"], built["dense_mlp"]
    assert none["ffn"] == ours["ffn"] == 4 and none["routers"] == 3  # 3 decoder layers + the MTP layer
    assert torch.equal(none["logits"], ours["logits"])  # the default is our spec
    assert dense["ffn"] == 0 and dense["routers"] == 0  # --spec really replaced the layers
    assert (dense["logits"] - ours["logits"]).abs().max() > 1e-3


def test_vocabulary_is_megatrons_padded_one(built):
    assert built["padded_vocab_size"] == 288  # 256 padded to a multiple of 96
    for run in ("none", "ours", "dense_mlp"):
        assert built[run]["embedding_rows"] == built[run]["output_rows"] == 288
        assert built[run]["logits"].shape[-1] == 288


# --- the pipeline schedule: --dsv3-pipeline-schedule and the block's parallel.schedule --------------------------

PP2 = ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]


def _ds(tmp_path, **parallel):
    p = tmp_path / "ds_pp.json"
    block = {"preset": "tiny", "model": {"num_hidden_layers": 4}}
    if parallel:
        block["parallel"] = parallel
    p.write_text(json.dumps({"dsv3": block}))
    return str(p)


@pytest.mark.parametrize(
    "parallel, flags, schedule, vpp",
    [
        ({}, [], "megatron", None),  # nothing asked: Megatron's own
        ({"schedule": "dualpipev"}, [], "dualpipev", 2),  # the block asks
        ({}, ["--dsv3-pipeline-schedule", "dualpipev"], "dualpipev", 2),  # the flag asks
        ({"schedule": "dualpipev"}, ["--dsv3-pipeline-schedule", "dualpipev"], "dualpipev", 2),
        ({}, ["--dsv3-pipeline-schedule", "1f1b"], "1f1b", None),  # our 1F1B, one chunk per rank
        ({"schedule": "1f1b"}, ["--dsv3-pipeline-schedule", "1f1b"], "1f1b", None),
        ({"schedule": "1f1b"}, [], "megatron", None),  # a block's 1f1b: Megatron's 1F1B will do
        ({"schedule": "dualpipe"}, [], "dualpipe", 2),  # the bidirectional DualPipe: two mirrored copies per rank
    ],
)
def test_pipeline_schedule_selection(tmp_path, parallel, flags, schedule, vpp):
    args, notes = parse_megatron_args_pp(BASE + PP2 + ["--dsv3-config", _ds(tmp_path, **parallel)] + flags)
    assert args.dsv3_pipeline_schedule == schedule
    assert args.virtual_pipeline_model_parallel_size == vpp  # the V: two model chunks per rank
    if schedule == "dualpipev":
        assert any("dualpipev over 2 pipeline ranks, 4 stages with [1, 1, 1, 1] decoder layers" in n for n in notes)


def parse_megatron_args_pp(argv):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    return parse_megatron_args(argv, world_size=2, set_globals=False, on_cpu=True)


@pytest.mark.parametrize(
    "parallel, flags, message",
    [
        (
            {"schedule": "dualpipev"},
            ["--dsv3-pipeline-schedule", "1f1b"],
            r"^--dsv3-pipeline-schedule 1f1b: contradicts .*ds_pp\.json dsv3\.parallel\.schedule = 'dualpipev'",
        ),
        (
            {"schedule": "1f1b"},
            ["--dsv3-pipeline-schedule", "dualpipev"],
            r"^--dsv3-pipeline-schedule dualpipev: contradicts .*dsv3\.parallel\.schedule = '1f1b'",
        ),
        (
            {},
            ["--dsv3-pipeline-schedule", "dualpipev", "--overlap-grad-reduce"],
            r"^--overlap-grad-reduce: needs DDP's no_sync hooks.*not with --dsv3-pipeline-schedule dualpipev",
        ),
        (
            {},
            ["--dsv3-pipeline-schedule", "dualpipev", "--num-layers-per-virtual-pipeline-stage", "1"],
            r"^--num-layers-per-virtual-pipeline-stage: sets Megatron's interleaved virtual pipeline",
        ),
        (
            {},
            ["--dsv3-pipeline-schedule", "1f1b", "--pipeline-model-parallel-layout", "Et|tttL"],
            r"^--pipeline-model-parallel-layout: sets Megatron's interleaved layout",
        ),
        (
            {},
            ["--dsv3-pipeline-schedule", "dualpipev", "--global-batch-size", "4"],
            r"^--global-batch-size 4: DualPipeV needs >= 2 x --pipeline-model-parallel-size = 4 micro-batches per "
            r"step \(has 2",
        ),
    ],
)
def test_pipeline_schedule_contradictions_refused(tmp_path, parallel, flags, message):
    from dsv3_plugin.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_megatron_args_pp(BASE + PP2 + ["--dsv3-config", _ds(tmp_path, **parallel)] + flags)


def test_dualpipev_stage_split_follows_first_last_flags(tmp_path):
    from dsv3_plugin.config import ConfigError

    p = tmp_path / "ds6.json"
    p.write_text(json.dumps({"dsv3": {"preset": "tiny", "model": {"num_hidden_layers": 6}}}))
    _, notes = parse_megatron_args_pp(
        BASE
        + PP2
        + [
            "--dsv3-config",
            str(p),
            "--dsv3-pipeline-schedule",
            "dualpipev",
            "--decoder-first-pipeline-num-layers",
            "1",
            "--decoder-last-pipeline-num-layers",
            "1",
        ]
    )
    assert any("4 stages with [1, 2, 2, 1] decoder layers" in n for n in notes), notes
    with pytest.raises(
        ConfigError,
        match=r"DualPipeV with --pipeline-model-parallel-size 2 cuts the model into 4 "
        r"stages: 6 decoder layers \(5 of them in the fixed first/last stages\)",
    ):
        parse_megatron_args_pp(
            BASE
            + PP2
            + [
                "--dsv3-config",
                str(p),
                "--dsv3-pipeline-schedule",
                "dualpipev",
                "--decoder-first-pipeline-num-layers",
                "1",
                "--decoder-last-pipeline-num-layers",
                "4",
            ]
        )


def test_pipeline_schedule_flag_without_pipeline_is_a_note(tmp_path):
    args, notes = parse_megatron_args_pp(
        BASE
        + [
            "--dsv3-config",
            _ds(tmp_path),
            "--dsv3-pipeline-schedule",
            "dualpipev",
            "--pipeline-model-parallel-size",
            "1",
        ]
    )
    assert args.virtual_pipeline_model_parallel_size is None
    assert "--dsv3-pipeline-schedule dualpipev: no pipeline at --pipeline-model-parallel-size 1" in notes


@pytest.mark.parametrize(
    "memory, message",
    [
        (
            {"recompute": "full"},
            r"^dsv3\.memory\.recompute = 'full' in .*ds\.json: not read by the Megatron path "
            r"\(Megatron's pretrain\(\) takes activation recompute from its flags",
        ),
        ({"ema": True}, r"^dsv3\.memory\.ema = True in .*: not read by the Megatron path"),
        ({"bf16_moments": True}, r"^dsv3\.memory\.bf16_moments = True in "),
        ({"flat_grads": False}, r"^dsv3\.memory\.flat_grads = False in .*a DeepSpeed ZeRO-1 setting"),
        ({"grad_norm": "fp32"}, r"^dsv3\.memory\.grad_norm = 'fp32' in .*a DeepSpeed ZeRO-1 setting"),
    ],
)
def test_deepspeed_only_memory_keys_are_refused(tmp_path, memory, message):
    """The "memory" section configures dsv3 train only: a Megatron run refuses it rather than ignore it."""
    from dsv3_plugin.config import ConfigError, MemoryConfig
    from dsv3_plugin.megatron.flags import _DEEPSPEED_ONLY_MEMORY

    assert set(_DEEPSPEED_ONLY_MEMORY) == set(MemoryConfig.model_fields)  # a new key needs its rule
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dsv3": {"preset": "tiny", "memory": memory}}))
    with pytest.raises(ConfigError, match=message):
        _parse(BASE + ["--dsv3-config", str(p)], on_cpu=True)
