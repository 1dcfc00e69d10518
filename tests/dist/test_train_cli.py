"""`dsv3 train` end to end: self-spawned (--nproc 2) from a released-format checkpoint (--init-from), then
resumed under torchrun; JSON lines on stdout, metrics.jsonl, PNG, checkpoint, summary; bad input exits 2."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tolerance import model_bound

from dsv3_plugin.cli import main
from dsv3_plugin.config import DSv3Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"step", "loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "tokens_per_s", "tokens_seen", "gamma", "lr"}


def _ds(**dsv3):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {"preset": "tiny", "train": {"seq_len": 16, "seed": 5}, **dsv3},
    }


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def _env():
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def test_example_config_is_the_default():
    from dsv3_plugin.deepspeed.run_config import DEFAULT_DS_CONFIG_PATH

    with (
        open(os.path.join(ROOT, "examples", "deepspeed", "ds_config.json"), "rb") as f,
        open(DEFAULT_DS_CONFIG_PATH, "rb") as g,
    ):
        assert f.read() == g.read()  # the user-facing copy of the packaged default
    assert main(["check-config", os.path.join(ROOT, "examples", "deepspeed", "ds_config.json")]) == 0


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d["dsv3"].update(moe={"top_k": 9}), "dsv3.moe.top_k"),
        (lambda d: d.update(zero_optimization={"stage": 3}), "zero_optimization.stage"),
        (lambda d: d.update(gradient_clipping=-1), "gradient_clipping"),
        (lambda d: d["dsv3"].update(parallel={"pp": 2, "schedule": "dualpipev"}), "gradient_accumulation_steps"),
        (
            lambda d: (
                d.update(gradient_accumulation_steps=4)
                or d["dsv3"].update(parallel={"pp": 2, "schedule": "dualpipev", "num_chunks": 8})
            ),
            "dsv3.parallel.num_chunks",
        ),
        (lambda d: d.pop("dsv3"), '"dsv3" block'),
        (lambda d: d["dsv3"]["train"].update(stepz=3), "dsv3.train.stepz"),
    ],
)
def test_bad_config_exits_2(tmp_path, capsys, mutate, needle):
    d = _ds()
    mutate(d)
    assert main(["train", "--config", _write(tmp_path / "c.json", d), "--out", str(tmp_path / "o")]) == 2
    assert needle in capsys.readouterr().err


def test_bad_paths_exit_2(tmp_path, capsys):
    cfg = _write(tmp_path / "c.json", _ds())
    assert main(["train", "--config", cfg, "--resume", str(tmp_path / "nothing")]) == 2
    assert "no DeepSpeed checkpoint" in capsys.readouterr().err
    assert main(["train", "--config", cfg, "--init-from", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["train", "--config", cfg, "--steps", "0"]) == 2
    assert "dsv3.train.steps" in capsys.readouterr().err


def _reference_first_lm_loss(ck, seq_len, seed, mbs):
    """Mean over both ranks of the loaded model's LM loss on each rank's first micro-batch."""
    from dsv3_plugin import load_pretrained
    from dsv3_plugin.data.synthetic import MarkovData

    model = load_pretrained(ck)
    data = MarkovData(model.cfg.model.vocab_size, seq_len, seed=seed)
    losses = []
    with torch.no_grad():
        for rank in range(2):
            ids, labels = data.batch(0, 0, rank, mbs)
            losses.append(float(model(ids, labels=labels).lm_loss))
    return sum(losses) / 2


def test_train_cli_spawned_then_resumed_under_torchrun(tmp_path):
    from helpers import dsv3_cli, make_tiny_hf_checkpoint

    ck = str(tmp_path / "hf")
    make_tiny_hf_checkpoint(ck, DSv3Config.from_block({"preset": "tiny"}), seed=1)
    cfg = _write(tmp_path / "c.json", _ds(moe={"bias_update_speed": 0.01}))
    out = str(tmp_path / "run")

    p = dsv3_cli(
        "train", "--config", cfg, "--nproc", "2", "--steps", "3", "--out", out, "--init-from", ck, "--json", env=_env()
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.strip().splitlines()]  # --json: stdout is JSON only
    rows, summary = lines[:-1], lines[-1]["summary"]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(KEYS <= set(r) for r in rows)
    assert summary["line"].startswith("dsv3 train: steps 1-3 on 2 rank(s)") and summary["last_loss"] == rows[-1]["loss"]
    assert "dsv3 train: steps 1-3 on 2 rank(s)" in p.stderr  # the human summary moves to stderr with --json
    assert "dsv3 train:" in p.stderr and "step/s" in p.stderr  # tqdm bar
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(x) for x in f] == rows
    assert os.path.getsize(os.path.join(out, "train.png")) > 1000
    assert os.path.getsize(os.path.join(out, "routing.png")) > 1000
    assert os.path.isfile(os.path.join(out, "ckpt", "latest"))
    # the weights really came from the checkpoint: step 1's LM loss is the loaded model's
    # (both run the loaded model's forward on the same micro-batches; the engine's forward may order its
    # reductions differently, so: what float32 allows through a forward, on the 2 x 2 x 16 tokens)
    ref = _reference_first_lm_loss(ck, 16, 5, 2)
    bound = float(model_bound(torch.tensor(ref), DSv3Config.from_block({"preset": "tiny"}), 2 * 2 * 16, passes=1))
    assert abs(rows[0]["lm_loss"] - ref) <= bound, (rows[0]["lm_loss"], ref, bound)
    assert rows[0]["gamma"] == 0.01 and rows[-1]["tokens_seen"] == 3 * 2 * 2 * 16

    # Resume under torchrun, with dsv3.train.log_every = 2: JSON lines for steps 4 and 6 (6 = the last) only.
    cfg2 = _write(
        tmp_path / "c2.json", _ds(moe={"bias_update_speed": 0.01}, train={"seq_len": 16, "seed": 5, "log_every": 2})
    )
    t = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "dsv3_plugin",
            "train",
            "--config",
            cfg2,
            "--steps",
            "6",
            "--out",
            out,
            "--resume",
            out,
            "--init-from",
            ck,
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=600,
    )
    assert t.returncode == 0, t.stderr[-3000:]
    more = [json.loads(x) for x in t.stdout.strip().splitlines()]
    assert [r["step"] for r in more[:-1]] == [4, 6] and more[0]["tokens_seen"] == 4 * 64
    assert more[-1]["summary"]["line"].startswith("dsv3 train: steps 4-6 on 2 rank(s)")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2, 3, 4, 6]


def test_terminal_output_is_a_bar_and_a_short_summary(tmp_path):
    """Without --json: stdout is a short human summary (no JSON), stderr the bar; the JSON lines are all in
    metrics.jsonl, and the summary's MaxVio_global figures are those of the loads in it; routing.png is written.
    The config is read once: the launcher opens the file and validates it, the ranks get its RunConfig (counted by
    tests/call_counter/sitecustomize.py in every process).
    The same run has DeepSpeed's monitor blocks on (TensorBoard, CSV, W&B offline): `_check_trackers`."""
    from dsv3_plugin.training.run_report import window_maxvio

    cfg = _write(tmp_path / "c.json", {**_ds(moe={"bias_update_speed": 0.01}), **_trackers(tmp_path)})
    out = str(tmp_path / "run")
    counts = tmp_path / "counts"
    counts.mkdir()
    env = _env()
    env.update(
        PYTHONPATH=os.path.join(ROOT, "tests", "call_counter") + os.pathsep + env["PYTHONPATH"],
        DSV3_COUNT_DIR=str(counts),
        DSV3_COUNT_FILE=cfg,
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path / "wandb"),
        WANDB_SILENT="true",
    )
    p = subprocess.run(
        [sys.executable, "-m", "dsv3_plugin", "train", "--config", cfg, "--nproc", "2", "--steps", "12", "--out", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    logs = [f.read_text().split() for f in counts.iterdir()]
    launcher = [x for x in logs if "start" in x and "validate_ds_config" in x]
    ranks = [x for x in logs if "init_distributed" in x]
    assert len(launcher) == 1 and len(ranks) == 2, logs
    assert [launcher[0].count(f) for f in ("open", "read_ds_json", "validate_ds_config")] == [1, 1, 1]
    assert sum(x.count("open") for x in logs) == 1  # the file: opened once, by the launcher
    for x in ranks:  # each rank took the launcher's RunConfig: no reading, no validating
        assert [x.count(f) for f in ("read_ds_json", "validate_ds_config", "load_config", "from_block")] == [0] * 4
    shown = p.stdout.splitlines()
    assert 3 <= len(shown) <= 10 and not any(x.lstrip().startswith("{") for x in shown), p.stdout
    assert len(p.stdout.splitlines()) + len(p.stderr.splitlines()) <= 40, p.stdout + p.stderr
    assert shown[0].startswith("dsv3 train: steps 1-12 on 2 rank(s)")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows] == list(range(1, 13))
    first, last = window_maxvio(rows[:6]), window_maxvio(rows[6:])
    assert f"MaxVio_global  {first:.3f} over steps 1-6 -> {last:.3f} over steps 7-12" in p.stdout
    # the run says what it trained on (the Markov chain, not a user's data)
    assert 'data           synthetic Markov chain (dsv3.train.data = "synthetic"' in p.stdout
    assert f"{rows[-1]['maxvio_global']:.3f} over the whole run" in p.stdout
    with open(os.path.join(out, "routing.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["check-config", os.path.join(ROOT, "examples", "deepspeed", "demo.json")]) == 0
    _check_trackers(tmp_path, rows, samples_per_step=2 * 2)  # micro-batch 2 x 2 data-parallel ranks


def _trackers(tmp_path):
    (tmp_path / "wandb").mkdir()
    return {
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "j"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"},
        "wandb": {"enabled": True, "project": "dsv3-test"},
    }


def _check_trackers(tmp_path, rows, samples_per_step):
    """Every number of every metrics.jsonl line reached TensorBoard, the CSV files and the W&B offline run once, at
    x = step x train_batch_size (DeepSpeed's global-samples axis), named as docs/deepspeed.md's table says; `lr` is
    DeepSpeed's own event at the same x. CSV and W&B keep the value exactly (repr / JSON); TensorBoard stores a
    float32, so its value is the metrics value rounded to float32 (the same single rounding on both sides)."""
    from tracker_files import csv_scalars, tensorboard_scalars, wandb_history

    from dsv3_plugin.deepspeed.monitor import metric_events

    want = {}
    for row in rows:
        x = row["step"] * samples_per_step
        for name, value, at in metric_events(row, samples_per_step) + [("Train/Samples/lr", row["lr"], x)]:
            assert at == x
            want.setdefault(name, {})[x] = value
    for name in (
        "loss",
        "lm_loss",
        "mtp_loss",
        "balance_loss",
        "maxvio",
        "maxvio_global",
        "maxvio_layers/0",
        "maxvio_global/layers.1.mlp",
        "tokens_per_s",
        "grad_norm",
        "tokens_dropped",
        "step",
        "gamma",
    ):
        assert want["Train/Samples/" + name] == {
            r["step"] * samples_per_step: (
                r[name]
                if "/" not in name
                else r["maxvio_layers"][0]
                if name.startswith("maxvio_layers")
                else r["moe_layers"]["layers.1.mlp"]["maxvio_global"]
            )
            for r in rows
        }, name
    wb = wandb_history(str(tmp_path / "wandb"))
    # the run's end-of-run figures (`summary_events`; pp = 1: the data wait only), once, at the last step
    last = rows[-1]["step"] * samples_per_step
    summary = {k: v for k, v in wb.items() if k.startswith("Train/Summary/")}
    assert set(summary) == {"Train/Summary/data_wait_s", "Train/Summary/data_wait_pct"}, sorted(summary)
    assert all(list(pts) == [last] and pts[last] >= 0 for pts in summary.values()), summary
    want.update(summary)
    tb = tensorboard_scalars(str(tmp_path / "tb" / "j"))
    assert tb == {
        k: {x: torch.tensor(v, dtype=torch.float32).item() for x, v in pts.items()} for k, pts in want.items()
    }
    assert csv_scalars(str(tmp_path / "csv" / "j")) == {k.replace("/", "_"): v for k, v in want.items()}
    assert {k: v for k, v in wb.items() if not k.startswith("_")} == want
