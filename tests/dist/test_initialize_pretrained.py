"""README's Python route: `initialize(load_pretrained(DIR), ds_json)` with a JSON that gives training knobs only.

The model's shape comes from the checkpoint's config.json (through the model's `cfg`); a shape key the JSON does
set must agree with the model, else a ConfigError names it.
"""

from __future__ import annotations

import math

import pytest

from tests.helpers import run_ranks

DS = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "zero_optimization": {"stage": 1},
    "dsv3": {"moe": {"bias_update_speed": 0.001}},  # no shape at all: the tiny release has vocab 1088, not 256
}


def _rank(ckpt: str) -> dict:
    import torch

    import dsv3_plugin.deepspeed as dsv3_ds
    from dsv3_plugin import load_pretrained
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    model = load_pretrained(ckpt)
    engine, *_ = dsv3_ds.initialize(model, DS)
    ids = torch.randint(0, 1024, (1, 17), generator=torch.Generator().manual_seed(0))
    out = engine(ids[:, :-1], labels=ids[:, 1:])
    engine.backward(out.loss)
    engine.step()
    bad = {**DS, "dsv3": {"model": {"hidden_size": 32}}}
    try:
        dsv3_ds.initialize(load_pretrained(ckpt), bad)
        err = None
    except ConfigError as e:
        err = str(e)
    return {
        "vocab": engine.module.cfg.model.vocab_size,
        "loss": float(out.loss),
        "err": err,
        "steps": engine.dsv3.state.optimizer_steps,
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    return write_tiny_release(tmp_path_factory.mktemp("release") / "ckpt")


def test_initialize_takes_the_shape_from_the_loaded_model(release):
    (r,) = run_ranks(_rank, 1, str(release))
    assert r["vocab"] == 1088 and r["steps"] == 1
    assert math.isfinite(r["loss"])  # a step ran on the released weights
    assert r["err"].startswith("dsv3.model.hidden_size: the model was built with 64 but the config says 32")
