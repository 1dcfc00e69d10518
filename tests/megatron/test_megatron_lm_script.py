"""Megatron-LM's own DeepSeek-V3 launch flags, with the plugin added as the one changed line: the model comes out
of the flags (no `--dsv3-config`), Megatron's MoE-implementation flags are mapped to what runs instead, flags that
would change the model are refused before any rank starts.

`SCRIPT` is the model / MoE / training part of Megatron-LM's `examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh`
(its `PRETRAIN_ARGS`, Megatron-FSDP off, no wandb / profiling), written as flag -> value with DeepSeek-V3's full
sizes. `scaled()` changes only sizes (layers, widths, experts, heads, batch, sequence, samples, intervals, vocabulary
padding, loader workers) and the paths (data, tokenizer: a tiny one trained here, no download); on CPU the switches
the plugin names in `flags.GPU_ONLY_FLAGS` come out. Everything else is the script's.

Needs megatron-core >= 0.19 for the parsing and the run (`megatron.training`); the round trip of the flag table
and the router's benchmark mode run on 0.16.1 too.
"""

import argparse
import functools
import json
import math
import os
import sys

import pytest
import torch
from helpers import HAVE_MEGATRON_TRAINING, needs_megatron_training, run_module

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_TRAINING, needs_training = HAVE_MEGATRON_TRAINING, needs_megatron_training

# flag -> value (None: a switch; a list: several values). DeepSeek-V3's sizes, as the script has them.
SCRIPT = {
    "--distributed-timeout-minutes": 60,
    "--tensor-model-parallel-size": 1,
    "--expert-model-parallel-size": 8,
    "--expert-tensor-parallel-size": 1,
    "--context-parallel-size": 1,
    "--use-distributed-optimizer": None,
    "--overlap-grad-reduce": None,
    "--overlap-param-gather": None,
    "--use-mcore-models": None,
    "--sequence-parallel": None,
    "--use-flash-attn": None,
    "--disable-bias-linear": None,
    "--micro-batch-size": 4,
    "--global-batch-size": 2048,
    "--train-samples": 585937500,
    "--exit-duration-in-mins": 220,
    "--no-check-for-nan-in-loss-and-grad": None,
    "--manual-gc": None,
    "--manual-gc-interval": 10,
    "--recompute-granularity": "selective",
    "--recompute-modules": ["mlp", "moe", "mla_up_proj", "layernorm"],
    "--transformer-impl": "transformer_engine",
    "--seq-length": 4096,
    "--data-cache-path": "OUT/cache",
    "--tokenizer-type": "HuggingFaceTokenizer",
    "--tokenizer-model": "TOKENIZER",
    "--data-path": "DATA",
    "--split": "99,1,0",
    "--no-mmap-bin-files": None,
    "--no-create-attention-mask-in-dataloader": None,
    "--num-workers": 6,
    "--num-layers": 61,
    "--hidden-size": 7168,
    "--ffn-hidden-size": 18432,
    "--num-attention-heads": 128,
    "--kv-channels": 128,
    "--max-position-embeddings": 4096,
    "--position-embedding-type": "rope",
    "--rotary-base": 10000,
    "--make-vocab-size-divisible-by": 3232,
    "--normalization": "RMSNorm",
    "--norm-epsilon": 1e-6,
    "--swiglu": None,
    "--untie-embeddings-and-output-weights": None,
    "--multi-latent-attention": None,
    "--attention-dropout": 0.0,
    "--hidden-dropout": 0.0,
    "--clip-grad": 1.0,
    "--weight-decay": 0.1,
    "--qk-layernorm": None,
    "--lr-decay-samples": 584765624,
    "--lr-warmup-samples": 1536000,
    "--lr-warmup-init": 3.9e-7,
    "--lr": 3.9e-6,
    "--min-lr": 3.9e-7,
    "--lr-decay-style": "cosine",
    "--adam-beta1": 0.9,
    "--adam-beta2": 0.95,
    "--num-experts": 256,
    "--moe-layer-freq": "[0]*3+[1]*58",
    "--moe-ffn-hidden-size": 2048,
    "--moe-shared-expert-intermediate-size": 2048,
    "--moe-router-load-balancing-type": "seq_aux_loss",
    "--moe-router-topk": 8,
    "--moe-token-dispatcher-type": "flex",
    "--moe-flex-dispatcher-backend": "hybridep",
    "--moe-router-pre-softmax": None,
    "--moe-grouped-gemm": None,
    "--moe-aux-loss-coeff": 1e-4,
    "--moe-router-group-topk": 4,
    "--moe-router-num-groups": 8,
    "--moe-router-topk-scaling-factor": 2.5,
    "--moe-router-score-function": "sigmoid",
    "--moe-router-enable-expert-bias": None,
    "--moe-router-bias-update-rate": 1e-3,
    "--moe-router-dtype": "fp32",
    "--moe-permute-fusion": None,
    "--moe-router-force-load-balancing": None,
    "--q-lora-rank": 1536,
    "--kv-lora-rank": 512,
    "--qk-head-dim": 128,
    "--qk-pos-emb-head-dim": 64,
    "--v-head-dim": 128,
    "--rotary-scaling-factor": 40,
    "--mscale": 1.0,
    "--mscale-all-dim": 1.0,
    "--mtp-num-layers": 1,
    "--mtp-loss-scaling-factor": 0.1,
    "--eval-iters": 32,
    "--eval-interval": 100,
    "--auto-detect-ckpt-format": None,
    "--load": "OUT/checkpoints",
    "--save": "OUT/checkpoints",
    "--save-interval": 100,
    "--dist-ckpt-strictness": "log_all",
    "--init-method-std": 0.02,
    "--log-timers-to-tensorboard": None,
    "--log-memory-to-tensorboard": None,
    "--log-num-zeros-in-grad": None,
    "--log-params-norm": None,
    "--log-validation-ppl-to-tensorboard": None,
    "--log-throughput": None,
    "--log-interval": 1,
    "--logging-level": 40,
    "--tensorboard-dir": "OUT/tensorboard",
    "--bf16": None,
    "--enable-experimental": None,
}

# Only sizes change (and the number of loader workers, and where things are).
SIZES = {
    "--expert-model-parallel-size": 2,
    "--micro-batch-size": 2,
    "--global-batch-size": 4,
    "--train-samples": 16,
    "--seq-length": 32,
    "--num-workers": 1,
    "--num-layers": 4,
    "--hidden-size": 64,
    "--ffn-hidden-size": 160,
    "--num-attention-heads": 4,
    "--kv-channels": 16,
    "--max-position-embeddings": 32,
    "--make-vocab-size-divisible-by": 64,
    "--lr-decay-samples": 16,
    "--lr-warmup-samples": 4,
    "--num-experts": 8,
    "--moe-layer-freq": "[0]*1+[1]*3",
    "--moe-ffn-hidden-size": 32,
    "--moe-shared-expert-intermediate-size": 32,
    "--moe-router-topk": 2,
    "--moe-router-group-topk": 2,
    "--moe-router-num-groups": 4,
    "--q-lora-rank": 48,
    "--kv-lora-rank": 32,
    "--qk-head-dim": 16,
    "--qk-pos-emb-head-dim": 8,
    "--v-head-dim": 16,
    "--eval-iters": 1,
    "--eval-interval": 2,
    "--save-interval": 2,
}


def argv(flags: dict, paths: dict, drop: tuple = ()) -> list[str]:
    out = []
    for flag, v in flags.items():
        if flag in drop:
            continue
        out.append(flag)
        if isinstance(v, list):
            out += [str(x) for x in v]
        elif v is not None:
            s = str(v)
            for k, p in paths.items():
                s = s.replace(k, str(p))
            out.append(s)
    return out


@functools.cache
def gpu_only_flags() -> tuple[str, ...]:
    """The script's flags whose dest the plugin names as GPU-only (`flags.GPU_ONLY_FLAGS`)."""
    from megatron.training import arguments as margs

    from dsv3_plugin.megatron.flags import GPU_ONLY_FLAGS

    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    by_flag = parser._option_string_actions
    return tuple(f for f in SCRIPT if f in by_flag and by_flag[f].dest in GPU_ONLY_FLAGS)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    tmp = tmp_path_factory.mktemp("megatron_lm_script")
    rel = write_tiny_release(tmp / "rel", fp8=False)  # its tokenizer (1024 entries) stands for DeepSeek-V3's
    with open(tmp / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t[:1500]}) + "\n" for t in pydoc_texts())
    prepare([str(tmp / "text.jsonl")], rel, str(tmp / "text"), progress=False)  # `dsv3 prepare-data`
    return {"tmp": tmp, "paths": {"OUT": tmp / "out", "TOKENIZER": rel, "DATA": tmp / "text"}, "rel": rel}


def _parse(args_list, world_size, on_cpu=True):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    return parse_megatron_args(args_list, world_size=world_size, on_cpu=on_cpu, set_globals=False)


# --- the flag table, both directions ----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "small", "v3-671b"])
def test_the_flags_a_block_sets_derive_the_same_block(preset, monkeypatch):
    """`dsv3_arg_values` (block -> flags) read back by `block_from_args` (flags -> block) gives the model it came
    from: one table, both directions."""
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.flags import block_from_args, dsv3_arg_values

    cfg = DSv3Config.from_block({"preset": preset})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cfg.moe.ranks_per_node))  # a node: the ranks started per host
    ns = argparse.Namespace(seq_length=cfg.model.max_position_embeddings, expert_model_parallel_size=1)
    ns.pipeline_model_parallel_size = 1
    for dest, _, value in dsv3_arg_values(cfg):
        setattr(ns, dest, value)
    block, _ = block_from_args(ns, argparse.ArgumentParser(), cfg.model.vocab_size)
    back = DSv3Config.from_block(block)
    _same_keys(back.model, cfg.model, "model")
    _same_keys(back.moe, cfg.moe, "moe")
    assert back.mtp.depth == cfg.mtp.depth and back.mtp.loss_weight == cfg.mtp.lam(0.0)


def _same_keys(a, b, sec):
    da, db = a.model_dump(), b.model_dump()
    # Megatron has one bias rate (the block's schedule starts at it)
    skip = {"bias_update_schedule", "bias_update_speed", "dedup_dispatch"}
    if sec == "model" and da["rope_scaling"] and db["rope_scaling"]:
        # no Megatron flag sets YaRN's original length / betas: Megatron's MLA config fixes 4096, 32, 1
        for k, v in {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}.items():
            assert da["rope_scaling"].pop(k) == v
            db["rope_scaling"].pop(k)
    diffs = {k: (da[k], db[k]) for k in da if k not in skip and da[k] != db[k]}
    assert not diffs, f"{sec}: {diffs}"
    if sec == "moe":
        assert a.bias_update_speed == b.gamma(0.0)


@needs_training
def test_megatron_lms_deepseek_v3_flags_describe_deepseek_v3(data):
    """The script at full size (as on its GPU cluster: on_cpu=False, 64 ranks) derives DeepSeek-V3's architecture:
    every model and MoE key equals the `v3-671b` preset's, except what the script itself sets otherwise
    (4096 positions, init std 0.02, λ = 0.1) and the vocabulary (this tokenizer's, padded as Megatron pads)."""
    from dsv3_plugin.config import DSv3Config

    args, notes = _parse(argv(SCRIPT, data["paths"]), world_size=64, on_cpu=False)
    assert args.dsv3_config is None
    got, want = DSv3Config.from_block(args.dsv3_block), DSv3Config.from_block({"preset": "v3-671b"})
    gm, wm = got.model.model_dump(), want.model.model_dump()
    assert gm.pop("vocab_size") == 3232 and gm.pop("max_position_embeddings") == 4096
    assert gm.pop("initializer_range") == 0.02
    for k in ("vocab_size", "max_position_embeddings", "initializer_range"):
        wm.pop(k)
    assert gm == wm
    _same_keys(got.moe, want.moe, "moe")
    assert got.mtp.depth == 1 and got.mtp.loss_weight == 0.1
    assert any("61 layers (3 dense, 58 MoE), hidden 7168, 256 routed experts top-8 in 8 groups" in n for n in notes)


# --- Megatron's MoE flags: mapped (one line each) or refused -------------------------------------------------------


@needs_training
def test_megatron_moe_flags_are_mapped_with_one_line_each(data):
    _, notes = _parse(argv(SCRIPT, data["paths"], drop=gpu_only_flags()), world_size=16)
    mapped = {n.split(":")[0] for n in notes}
    for flag in (
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type flex",
        "--moe-flex-dispatcher-backend hybridep",
        "--moe-permute-fusion",
        "--moe-router-pre-softmax",
        "--moe-router-force-load-balancing",
    ):
        assert flag in mapped, (flag, notes)
    assert any(n.startswith("--use-flash-attn: ") for n in notes)
    assert any(n.startswith("--recompute-modules moe: covered by mlp") for n in notes)
    assert any("all-to-all over EP = 8" in n for n in notes)


@needs_training
@pytest.mark.parametrize(
    "change, message",
    [
        ({"--moe-router-score-function": "softmax"}, r"^--moe-router-score-function softmax: contradicts the Megatron"),
        ({"--moe-layer-freq": "2"}, r"^--moe-layer-freq 2: the dsv3 layers need the first k layers dense"),
        ({"--moe-shared-expert-intermediate-size": 3000}, r"^--moe-shared-expert-intermediate-size 3000: not a mul"),
        ({"--moe-router-load-balancing-type": "aux_loss"}, r"^--moe-router-load-balancing-type aux_loss: DeepSeek"),
        ({"--moe-expert-capacity-factor": 1.0}, r"^--moe-expert-capacity-factor 1\.0: token dropping changes"),
        ({"--moe-z-loss-coeff": 1e-3}, r"^--moe-z-loss-coeff 0\.001: a router z-loss is not part"),
        ({"--position-embedding-type": "learned_absolute"}, r"^--position-embedding-type learned_absolute: contra"),
        ({"--moe-router-topk": 300}, r"^--moe-router-topk \(dsv3\.moe\.top_k"),
        ({"--use-distributed-optimizer": None}, r"^--use-distributed-optimizer: not on CPU"),
        ({"--recompute-modules": ["moe", "layernorm"]}, r"^--recompute-modules moe: recomputes parts of Megatron's"),
    ],
)
def test_flags_the_plugin_cannot_honour_are_refused_naming_them(data, change, message):
    from dsv3_plugin.config import ConfigError

    flags = {k: v for k, v in SCRIPT.items() if k not in gpu_only_flags()} | change
    with pytest.raises(ConfigError, match=message):
        _parse(argv(flags, data["paths"]), world_size=16)


@needs_training
def test_bad_flags_exit_2_with_one_line_before_any_rank_starts(data, capsys):
    from dsv3_plugin.megatron.pretrain_gpt import main

    flags = {k: v for k, v in SCRIPT.items() if k not in gpu_only_flags()} | {"--moe-layer-freq": "2"}
    flags |= {"--expert-model-parallel-size": 2}
    assert main(["--nproc", "2", *argv(flags, data["paths"])]) == 2  # the parent refuses: nothing is spawned
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --moe-layer-freq 2: the dsv3 layers need"), err


@needs_training
def test_init_from_a_checkpoint_the_flags_do_not_describe_is_refused(data, tmp_path):
    """Released weights whose shapes the flags contradict, and `--dsv3-init-from` beside a `--load` that is not
    the `--save` directory: one line naming the flags, before any model is built."""
    from dsv3_plugin.config import ConfigError

    base = {k: v for k, v in SCRIPT.items() if k not in gpu_only_flags()} | SIZES
    rel = str(data["rel"])  # the tiny release: hidden 64, 4 layers, 16 experts, ...
    with pytest.raises(ConfigError, match=r"^--dsv3-init-from .*: its config.json gives dsv3\.\w+\.\w+ = .* but --"):
        _parse(argv(base, data["paths"]) + ["--dsv3-init-from", rel], world_size=2)
    with pytest.raises(ConfigError, match=r"^--dsv3-init-from .* and --load .*: both give the starting weights"):
        _parse(argv(base | {"--load": str(tmp_path / "elsewhere")}, data["paths"]) + ["--dsv3-init-from", rel], 2)


# --- the run --------------------------------------------------------------------------------------------------


@needs_training
@pytest.mark.dist
def test_megatron_lms_script_trains_with_the_plugin_added(data):
    """`python pretrain_gpt.py` -> `python -m dsv3_plugin.megatron.pretrain_gpt` (+ `--nproc 2` for the
    self-spawned ranks): 4 iterations on real text, EP = 2, MTP, the script's selective recompute, save at 2 and 4.
    The plugin's layers ran (Megatron's `finalize_model_grads` moved their router biases), the losses are finite,
    the checkpoints are there."""
    tmp = data["tmp"]
    flags = {k: v for k, v in SCRIPT.items() if k not in gpu_only_flags()} | SIZES
    metrics = tmp / "metrics.jsonl"
    cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", "--nproc", "2", *argv(flags, data["paths"])]
    cmd += ["--dsv3-metrics", str(metrics), "--wandb-project", "x", "--wandb-save-dir", str(tmp / "wandb")]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
    }
    p = run_module(cmd, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    out = p.stdout
    assert "dsv3_plugin: no --dsv3-config: the model from the Megatron flags: 4 layers (1 dense, 3 MoE)" in out
    assert "dsv3_plugin: --moe-grouped-gemm: the plugin's grouped expert GEMM runs" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["lm_loss"]) and math.isfinite(r["mtp_1_loss"]) for r in rows)
    assert rows[0]["router_bias_abs_sum"] > 0  # γ = 1e-3 steps of the plugin's routers, by Megatron's update
    ck = data["paths"]["OUT"] / "checkpoints"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ck / "iter_0000002").is_dir() and (ck / "iter_0000004").is_dir()
    _check_trackers(data["paths"]["OUT"] / "tensorboard", tmp / "wandb", rows)


def _check_trackers(tb_dir, wandb_dir, rows):
    """The script's `--tensorboard-dir` (+ `--log-memory-to-tensorboard`, on CPU) and `--wandb-project` (offline):
    Megatron's own writers hold the plugin's figures at every iteration (`--log-interval 1`, Megatron's
    `--tensorboard-log-interval` 1) beside Megatron's own scalars, equal to the `--dsv3-metrics` record: TensorBoard
    stores float32, so each value is the record's rounded to float32 (exactly); W&B keeps the float64 (JSON)."""
    import glob

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    moe_layers = 4  # the 3 MoE decoder layers and the MTP layer's
    assert all(r["routers"] == moe_layers for r in rows)
    assert all(len(r["maxvio_per_layer"]) == moe_layers and min(r["maxvio_per_layer"]) >= 0 for r in rows)
    assert all(r["maxvio_batch"] == sum(r["maxvio_per_layer"]) / moe_layers for r in rows)
    want = {
        "dsv3/router-bias-abs-sum": [r["router_bias_abs_sum"] for r in rows],
        "dsv3/maxvio-batch": [r["maxvio_batch"] for r in rows],
        **{f"dsv3/maxvio/layer{i}": [r["maxvio_per_layer"][i] for r in rows] for i in range(moe_layers)},
    }
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "mtp_1 loss", "mem-reserved-bytes", "mem-max-allocated-bytes"} <= tags, sorted(tags)
    assert [e.step for e in acc.Scalars("lm loss")] == [1, 2, 3, 4]
    assert all(e.value > 0 for e in acc.Scalars("mem-reserved-bytes"))  # the CPU process's resident set
    for tag, values in want.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [1, 2, 3, 4], tag
        assert [e.value for e in events] == [float(np.float32(v)) for v in values], tag
    # W&B (offline): the run's own record file, read back
    (run,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = _wandb_history(run)
    assert sorted(history) == [1, 2, 3, 4] and all("lm loss" in history[i] for i in history)
    for tag, values in want.items():
        assert [history[i][tag] for i in (1, 2, 3, 4)] == values, tag


def _wandb_history(path):
    """{step: {key: value}} of the history records in an offline W&B run file: LevelDB's log format (32 KiB blocks
    of chunks: CRC, length, type FULL=1 / FIRST / MIDDLE / LAST=4) after a 7-byte ":W&B" header, each record a
    `wandb_internal_pb2.Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    block, pos, buf, rows = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: zero padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            rec, buf = pb.Record.FromString(buf), b""
            if rec.WhichOneof("record_type") == "history":
                row = rows.setdefault(rec.history.step.num, {})
                for it in rec.history.item:
                    row[it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
    return rows


# --- the router's benchmark mode (--moe-router-force-load-balancing) ----------------------------------------------


def test_force_load_balancing_routes_on_random_logits_with_a_straight_through_gradient(monkeypatch):
    import contextlib

    from megatron.core import tensor_parallel

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.moe import MegatronRouter

    class Tracker:  # the expert-parallel RNG stream, as Megatron's tracker forks it
        def fork(self, name=None):
            return contextlib.nullcontext()

    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: Tracker())
    cfg = DSv3Config.from_block({"preset": "tiny"}).moe
    routers = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        r = MegatronRouter(64, cfg)
        r.force_random_logits = True
        routers.append(r)
    x = torch.randn(16, 64)
    outs = []
    for r in routers:
        torch.manual_seed(0)
        outs.append(r.scores(x))
    # the scores do not depend on the weights: the same random draw gives the same scores for both routers
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], torch.sigmoid(x @ routers[0].weight.T))
    # straight through: d/dW sum(sigmoid(r)) = (sigmoid'(r))^T x, r the random logits
    torch.manual_seed(0)
    s = routers[0].scores(x)
    s.sum().backward()
    ds = (s * (1 - s)).detach()
    # the same products summed over the 16 tokens, possibly in another order: 16·eps·Σ|terms| bounds the difference
    bound = 16 * torch.finfo(torch.float32).eps * (ds.abs().T @ x.abs())
    assert ((routers[0].weight.grad - ds.T @ x).abs() <= bound).all()


@needs_training
def test_every_megatron_moe_flag_has_a_rule():
    """No Megatron `--moe-*` flag is silently ignored with the dsv3 layers: each is read from / checked against
    the block (`dsv3_arg_values`), mapped to what runs instead, or refused (`MEGATRON_MOE_FLAGS`)."""
    from megatron.training import arguments as margs

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.megatron.flags import MEGATRON_MOE_FLAGS, dsv3_arg_values

    parser = margs.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    moe = {a.dest for a in parser._actions if a.dest.startswith("moe_")}
    table = {dest for dest, _, _ in dsv3_arg_values(DSv3Config.from_block({"preset": "tiny"}))}
    assert sorted(moe - table - set(MEGATRON_MOE_FLAGS)) == []
    # and docs/megatron.md's table lists each of them
    doc = open(os.path.join(ROOT, "docs", "megatron.md")).read()
    names = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    missing = [names[d] for d in sorted(moe | set(MEGATRON_MOE_FLAGS)) if d in names and f"`{names[d]}`" not in doc]
    assert missing == []


# --- MLA without YaRN (a short-context run: no --rotary-scaling-factor) ------------------------------------------


@needs_training
def test_mla_without_yarn_takes_plain_rope_and_no_op_yarn_flags(data):
    """The script without `--rotary-scaling-factor` (Megatron-LM's MLA then takes YaRN at factor 1: plain RoPE),
    with its `--mscale 1.0 --mscale-all-dim 1.0` left in (no effect at factor 1): accepted (a note); the model
    is the block without YaRN — the plugin's layers with plain RoPE and scale 1/sqrt(d), the configuration
    tests/parity/test_megatron_parity.py's no-YaRN case checks against the plugin's own (DeepSpeed-path) model — and
    Megatron's own config of the flags builds (its fused-RoPE check used to raise for MLA without YaRN)."""
    from megatron.training.arguments import core_transformer_config_from_args

    from dsv3_plugin.config import ConfigError, DSv3Config
    from dsv3_plugin.megatron.config import to_transformer_config
    from dsv3_plugin.megatron.gpt import megatron_base_config, transformer_config_from_args

    drop = (*gpu_only_flags(), "--rotary-scaling-factor")
    args, notes = _parse(argv(SCRIPT | SIZES, data["paths"], drop=drop), world_size=2)
    assert args.dsv3_block["model"]["rope_scaling"] is None
    # (--mscale 1.0 is the value a model without YaRN has anyway: no note)
    assert (
        "--mscale-all-dim 1.0: no effect at --rotary-scaling-factor 1 (no YaRN: plain RoPE, attention scale 1/sqrt(d))"
        in notes
    )
    with pytest.raises(ValueError, match="apply_rope_fusion for MLA only works with YARN RoPE"):
        core_transformer_config_from_args(args)  # what Megatron's own check says of these flags
    got = transformer_config_from_args(args, megatron_base_config(args))
    want = to_transformer_config(DSv3Config.from_block(args.dsv3_block))
    keys = ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "apply_rope_fusion", "rotary_base")
    assert {k: getattr(got, k) for k in keys} == {k: getattr(want, k) for k in keys}
    assert (got.rope_type, got.rotary_scaling_factor, got.mscale_all_dim) == ("rope", 1.0, 0.0)
    # a factor other than 1 is YaRN: with a dsv3 block without YaRN it contradicts (it would change the numerics)
    ds = data["tmp"] / "no_yarn.json"
    ds.write_text(json.dumps({"dsv3": {"preset": "tiny", "model": {"rope_scaling": None}}}))
    base = ["--micro-batch-size", "1", "--global-batch-size", "2", "--seq-length", "16", "--train-iters", "1"]
    base += ["--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-interval", "1"]
    base += ["--dsv3-config", str(ds)]
    _, notes = _parse(base + ["--rope-type", "yarn", "--mscale-all-dim", "0.707"], world_size=2)
    assert "--mscale-all-dim 0.707: no effect at --rotary-scaling-factor 1" in " ".join(notes)
    with pytest.raises(ConfigError, match=r"^--rotary-scaling-factor 4\.0: contradicts .*rope_scaling"):
        _parse(base + ["--rotary-scaling-factor", "4", "--mscale-all-dim", "1.0"], world_size=2)
