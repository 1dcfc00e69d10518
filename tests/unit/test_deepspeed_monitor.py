"""DeepSpeed's monitor blocks: refused (naming the key, or the missing package) when checked with the other
DeepSpeed keys, before any rank starts; and the events a metrics record becomes (`deepspeed.monitor`)."""

import json
import math
import sys

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError
from dsv3_plugin.deepspeed.monitor import metric_events
from dsv3_plugin.deepspeed.run_config import validate_ds_config


def _ds(**blocks):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {"preset": "tiny"},
        **blocks,
    }


@pytest.mark.parametrize(
    "blocks, message",
    [
        ({"tensorbord": {"enabled": True}}, "tensorbord: not a DeepSpeed key (DeepSpeed would ignore it"),
        ({"CSV_Monitor": {"enabled": True}}, "CSV_Monitor: not a DeepSpeed key"),
        ({"wandb_logging": {"enabled": True}}, "did you mean 'wandb'?"),
        ({"tensorboard": {"enabled": True, "outptu_path": "x"}}, "tensorboard.outptu_path: unknown key of DeepSpeed"),
        ({"comet": {"enabled": False, "apikey": "k"}}, "comet.apikey: unknown key"),
        ({"wandb": True}, "wandb: must be an object (got true"),
        ({"csv_monitor": {"enabled": "yes"}}, 'csv_monitor.enabled: must be true or false (got "yes"'),
        ({"csv_monitor": {"enabled": True, "output_path": 3}}, "csv_monitor.output_path: Input should be a valid"),
        ({"comet": {"enabled": True}}, "comet.enabled: DeepSpeed's comet monitor needs the 'comet_ml' package"),
    ],
)
def test_monitor_blocks_refused(blocks, message):
    with pytest.raises(ConfigError) as e:
        validate_ds_config(_ds(**blocks))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("block, package", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_enabled_block_without_its_package_is_refused(monkeypatch, block, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    with pytest.raises(ConfigError, match=rf"^{block}\.enabled: DeepSpeed's {block} monitor needs the '{package}'"):
        validate_ds_config(_ds(**{block: {"enabled": True}}))
    validate_ds_config(_ds(**{block: {"enabled": False}}))  # a disabled block needs nothing


def test_train_exits_2_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_ds(wandb={"enabled": True, "project": "p"})))
    assert main(["train", "--config", str(cfg), "--nproc", "2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "wandb.enabled" in err[0] and "'wandb' package" in err[0], err
    assert not (tmp_path / "o").exists()  # no rank ran


def test_known_blocks_accepted():
    run = validate_ds_config(
        _ds(
            tensorboard={"enabled": True, "output_path": "tb", "job_name": "j"},
            wandb={"enabled": True, "project": "p", "group": "g", "team": None},
            csv_monitor={"enabled": False},
            comet={"enabled": False, "samples_log_interval": 10},
        )
    )
    assert run.ds["tensorboard"]["output_path"] == "tb"  # handed to DeepSpeed as written


def test_metric_events_names_values_and_axis():
    rec = {
        "step": 3,
        "loss": 2.5,
        "lm_loss": float("nan"),  # a diverged value stays visible (metrics.jsonl writes null)
        "lr": 1e-3,  # DeepSpeed's engine writes Train/Samples/lr itself
        "grad_norm": None,  # not measured: no event
        "tokens_dropped": 0,
        "maxvio_layers": [0.5, 0.25],
        "moe_layers": {"layers.1.mlp": {"loads": [1, 3], "maxvio_global": 0.5, "cross_node_per_token": None}},
        "eval_loss": 2.0,
    }
    events = metric_events(rec, samples_per_step=8)
    assert all(x == 24 for _, _, x in events)
    got = {name: v for name, v, _ in events}
    assert math.isnan(got.pop("Train/Samples/lm_loss"))
    assert got == {
        "Train/Samples/step": 3,
        "Train/Samples/loss": 2.5,
        "Train/Samples/tokens_dropped": 0,
        "Train/Samples/maxvio_layers/0": 0.5,
        "Train/Samples/maxvio_layers/1": 0.25,
        "Train/Samples/maxvio_global/layers.1.mlp": 0.5,
        "Train/Samples/eval_loss": 2.0,
    }


def test_summary_events_once_at_the_last_step():
    from dsv3_plugin.deepspeed.monitor import summary_events

    summ = {
        "data_wait_s": 0.5,
        "data_wait_pct": None,  # not measured: no event
        "line": "dsv3 train: ...",
        "pipeline": {"ranks": [{"rank": 0, "idle_fraction": 0.25, "a2a_wait_s": 0.1}, {"rank": 1, "busy_s": 2.0}]},
    }
    assert summary_events(summ, step=6, samples_per_step=4) == [
        ("Train/Summary/data_wait_s", 0.5, 24),
        ("Train/Summary/pipeline/idle_fraction/rank0", 0.25, 24),
        ("Train/Summary/pipeline/a2a_wait_s/rank0", 0.1, 24),
        ("Train/Summary/pipeline/busy_s/rank1", 2.0, 24),
    ]
