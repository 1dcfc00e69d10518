"""`dsv3 check-config FILE --nproc N` and `dsv3 train --config FILE --nproc N` refuse the same files with the same
message, before any rank is spawned — one case for every refusal the train path can raise (the "dsv3" schema,
the DeepSpeed keys the engine reads, the world-size rules of the pipeline / expert-parallel groups, what dsv3
train itself does not support, the synthetic data's limits, the FP8 backend, the host-memory estimate, and the
file itself)."""

import json

import pytest
import torch

from dsv3_plugin.cli import main

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {"preset": "tiny", "train": {"seq_len": 16}},
}


def _with(ds=None, **dsv3):
    d = json.loads(json.dumps(BASE))
    d.update(ds or {})
    for sec, val in dsv3.items():
        d["dsv3"][sec] = val
    return json.dumps(d)


def _fp16_here() -> bool:
    """Whether DeepSpeed's accelerator accepts fp16 here: CUDA, or a CPU whose oneDNN has FP16 kernels (AVX512-FP16 /
    AMX-FP16; the test DeepSpeed's CPU accelerator makes)."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _te_missing():
    try:
        import transformer_engine  # noqa: F401

        return False
    except ImportError:
        return True


def _torch_fp8_unavailable():
    from dsv3_plugin.precision.fp8.linear import torch_blockwise_available

    return not torch_blockwise_available(torch.device("cuda" if torch.cuda.is_available() else "cpu"))[0]


# (id, file text, nproc, the key or file the message must start with, skip reason or None)
CASES = [
    ("cross-field", _with(moe={"top_k": 17}), 2, "dsv3.moe.top_k", None),
    ("string-for-int", _with(moe={"n_routed_experts": "4"}), 2, "dsv3.moe.n_routed_experts", None),
    ("bool-for-int", _with(model={"num_hidden_layers": True}), 2, "dsv3.model.num_hidden_layers", None),
    ("float-for-int", _with(model={"hidden_size": 1e30}), 2, "dsv3.model.hidden_size", None),
    ("overflowing-float", _with(moe={"route_scale": "LIT"}).replace('"LIT"', "1e400"), 2, "dsv3.moe.route_scale", None),
    (
        "infinity",
        _with(moe={"bias_update_speed": "LIT"}).replace('"LIT"', "Infinity"),
        2,
        "dsv3.moe.bias_update_speed",
        None,
    ),
    ("nan", _with(mtp={"loss_weight": "LIT"}).replace('"LIT"', "NaN"), 2, "dsv3.mtp.loss_weight", None),
    ("layers-1e30", _with(model={"num_hidden_layers": 10**30}), 2, "dsv3.model.num_hidden_layers", None),
    ("hidden-size-memory", _with(model={"hidden_size": 2**20}), 2, "dsv3.model.hidden_size", None),
    (
        "micro-batch-memory",
        _with({"train_micro_batch_size_per_gpu": 10**12}),
        2,
        "train_micro_batch_size_per_gpu",
        None,
    ),
    ("zero-stage-2", _with({"zero_optimization": {"stage": 2}}), 2, "zero_optimization.stage", None),
    ("zero-stage-bool", _with({"zero_optimization": {"stage": True}}), 2, "zero_optimization.stage", None),
    ("zero-unknown-key", _with({"zero_optimization": {"stage": 1, "bogus": 1}}), 2, "zero_optimization.bogus", None),
    ("clipping", _with({"gradient_clipping": -1}), 2, "gradient_clipping", None),
    ("micro-batch-string", _with({"train_micro_batch_size_per_gpu": "4"}), 2, "train_micro_batch_size_per_gpu", None),
    ("batch-triple", _with({"train_batch_size": 7}), 2, "train_batch_size", None),
    # no memory bound catches these: a step of 10^30 micro-batches never ends (and DeepSpeed's loss scaling
    # overflows int64 in the first backward)
    ("accumulation-1e30", _with({"gradient_accumulation_steps": 10**30}), 2, "gradient_accumulation_steps", None),
    ("accumulation-from-batch-size", _with({"train_batch_size": 4 * 10**30}), 2, "gradient_accumulation_steps", None),
    ("no-optimizer", json.dumps({k: v for k, v in BASE.items() if k != "optimizer"}), 2, "optimizer", None),
    (
        "optimizer-lr",
        _with({"optimizer": {"type": "AdamW", "params": {"lr": "fast", "torch_adam": True}}}),
        2,
        "optimizer.params.lr",
        None,
    ),
    ("optimizer-type", _with({"optimizer": {"type": "Adamm", "params": {}}}), 2, "optimizer.type", None),
    (
        "adam-jit-build",
        _with({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}),
        2,
        "optimizer.params.torch_adam",
        "a GPU is present" if torch.cuda.is_available() else None,
    ),
    (
        "scheduler-param",
        _with({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}}),
        2,
        "scheduler.params.warmup_steps",
        None,
    ),
    (
        "fp16-on-cpu",
        _with({"fp16": {"enabled": True}}),
        2,
        "fp16.enabled",
        "this accelerator has fp16" if _fp16_here() else None,
    ),
    ("pp-world", _with(parallel={"pp": 3, "schedule": "1f1b"}), 2, "dsv3.parallel.pp", None),
    ("ep-world", _with(parallel={"ep": 4}), 2, "dsv3.parallel.ep", None),
    # EP is carved from each stage's data-parallel group: 4 ranks / pp 2 = dp 2, which ep 4 does not divide
    (
        "ep-with-pp",
        _with({"gradient_accumulation_steps": 4}, parallel={"ep": 4, "pp": 2, "schedule": "1f1b"}),
        4,
        "dsv3.parallel.ep",
        None,
    ),
    (
        "bf16-moments-not-adamw",
        _with(
            {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}}},
            memory={"bf16_moments": True},
        ),
        2,
        "optimizer.type",
        None,
    ),
    (
        "bf16-moments-amsgrad",
        _with(
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "amsgrad": True}}},
            memory={"bf16_moments": True},
        ),
        2,
        "optimizer.params.amsgrad",
        None,
    ),
    (
        "dualpipe-micro-batches",
        _with({"gradient_accumulation_steps": 2}, parallel={"pp": 2, "schedule": "dualpipe"}),
        2,
        "gradient_accumulation_steps",
        None,
    ),
    (
        "dualpipev-micro-batches",
        _with(parallel={"pp": 2, "schedule": "dualpipev"}),
        2,
        "gradient_accumulation_steps",
        None,
    ),
    (
        "num-chunks",
        _with({"gradient_accumulation_steps": 4}, parallel={"pp": 2, "schedule": "dualpipev", "num_chunks": 8}),
        2,
        "dsv3.parallel.num_chunks",
        None,
    ),
    (
        "empty-pipeline-rank",
        _with(
            {"gradient_accumulation_steps": 4}, model={"num_hidden_layers": 2}, parallel={"pp": 4, "schedule": "1f1b"}
        ),
        4,
        "dsv3.model.num_hidden_layers",
        None,
    ),
    (
        "data-before-expert-parallel",
        _with({"use_data_before_expert_parallelism": True}, parallel={"ep": 2}),
        2,
        "use_data_before_expert_parallelism",
        None,
    ),
    ("node-limited-groups", _with(parallel={"ep": 4}, moe={"n_group": 2}), 4, "dsv3.moe.n_group", None),
    (
        "no-moe-layer",
        _with(model={"first_k_dense_replace": 3}, mtp={"depth": 0}),
        2,
        "dsv3.model.first_k_dense_replace",
        None,
    ),
    (
        "fp8-te",
        _with(fp8={"enabled": True, "backend": "te"}),
        2,
        "dsv3.fp8.backend",
        None if _te_missing() else "Transformer Engine is installed",
    ),
    (
        "fp8-torch",
        _with(fp8={"enabled": True, "backend": "torch"}),
        2,
        "dsv3.fp8.backend",
        None if _torch_fp8_unavailable() else "torch blockwise FP8 runs here",
    ),
    ("synthetic-vocab", _with(model={"vocab_size": 4}), 2, "dsv3.model.vocab_size", None),
    ("seq-len", _with(train={"seq_len": 512}), 2, "dsv3.train.seq_len", None),
    ("p2p-timeout", _with(parallel={"p2p_timeout_s": 1e300}), 2, "dsv3.parallel.p2p_timeout_s", None),
    ("seed", _with(train={"seed": 2**64}), 2, "dsv3.train.seed", None),
    ("unknown-key", _with(train={"stepz": 3}), 2, "dsv3.train.stepz", None),
    ("no-dsv3-block", json.dumps({k: v for k, v in BASE.items() if k != "dsv3"}), 2, "FILE", None),
    (
        "duplicate-key",
        _with().replace('"gradient_clipping": 1.0', '"gradient_clipping": 1.0, "gradient_clipping": 0'),
        2,
        "FILE",
        None,
    ),
    ("deep-nesting", "[" * 10000 + "]" * 10000, 2, "FILE", None),
]


@pytest.mark.parametrize("text, nproc, key, skip", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_config_and_train_refuse_with_the_same_message(tmp_path, capsys, monkeypatch, text, nproc, key, skip):
    if skip:
        pytest.skip(skip)
    import dsv3_plugin.parallel.distributed as distributed

    def no_spawn(*a, **k):
        raise AssertionError("dsv3 train spawned ranks: the refusal was not caught by its pre-spawn check")

    monkeypatch.setattr(distributed, "spawn", no_spawn)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "c.json"
    path.write_text(text)
    assert main(["check-config", str(path), "--nproc", str(nproc)]) == 2
    checked = capsys.readouterr().err
    assert (
        main(["train", "--config", str(path), "--nproc", str(nproc), "--steps", "1", "--out", str(tmp_path / "out")])
        == 2
    )
    trained = capsys.readouterr().err
    assert checked == trained
    want = str(path) if key == "FILE" else key
    assert checked.startswith(f"error: {want}"), checked
    assert checked.count("\n") == 1 and "Traceback" not in checked


def test_encodings_refused_the_same_way(tmp_path, capsys):
    """Non-UTF-8 files name the file and the encoding, in check-config and in train (pre-spawn)."""
    text = _with()
    for name, data in [
        ("utf16.json", text.encode("utf-16")),
        ("utf16le.json", text.encode("utf-16-le")),
        ("utf32.json", text.encode("utf-32")),
        ("latin1.json", text.replace('"tiny"', '"tiny", "comment": "caf\u00e9"').encode("latin-1")),
    ]:
        path = tmp_path / name
        path.write_bytes(data)
        assert main(["check-config", str(path)]) == 2
        checked = capsys.readouterr().err
        assert main(["train", "--config", str(path), "--steps", "1", "--out", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err == checked
        assert checked.startswith(f"error: {path}: ") and (
            "UTF-16" in checked or "UTF-32" in checked or "not valid UTF-8" in checked
        ), checked
