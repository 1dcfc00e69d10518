"""metrics.jsonl read strictly (dsv3_plugin.training.metrics_file.read_jsonl, telemetry.read_metrics): a line that is
JSON but not a metrics line (a list, no integer step, non-finite numbers, too deep, uneven expert loads, wrong
types) is one ConfigError "PATH:LINE: ...", in `dsv3 plot-routing` (exit 2, one line) and when `--resume` reads the
run directory; the writer's lines (`metrics_line`) are read back; plot-routing's output paths are refused by name."""

import json
import os

import pytest
import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.training import metrics_file as mf
from dsv3_plugin.training import run_dir as rd
from dsv3_plugin.training.telemetry import read_metrics


def _row(step, loads=(3, 5, 4, 4), **kw):
    return {
        "step": step,
        "loss": 3.0,
        "gamma": 0.001,
        "maxvio": 0.2,
        "maxvio_batch": 0.2,
        "maxvio_global": 0.1,
        "moe_layers": {"layers.1.mlp": {"loads": list(loads), "maxvio_batch": 0.2, "maxvio_global": 0.1}},
        **kw,
    }


GOOD = [json.dumps(_row(1)), json.dumps(_row(2))]


@pytest.mark.parametrize(
    "line, why",
    [
        ("[1, 2, 3]", "not a metrics line: a JSON list, not an object"),
        ('"step"', "not a metrics line: a JSON str, not an object"),
        ('{"loss": 1.0}', "not a metrics line: no 'step'"),
        ('{"step": "3"}', "'step' must be an integer >= 0 (got \"3\")"),
        ('{"step": true}', "'step' must be an integer >= 0 (got true)"),
        ('{"step": 3.0}', "'step' must be an integer >= 0 (got 3.0)"),
        ('{"step": 3, "loss": NaN}', "NaN is not a finite number"),
        ('{"step": 3, "loss": -Infinity}', "-Infinity is not a finite number"),
        ('{"step": 3, "loss": 1e400}', "1e400 is not a finite number"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"step": 3, "loss": "low"}', "'loss' must be a number or null (got \"low\")"),
        (json.dumps(_row(3, loads=(1, 2, 3))), "moe_layers['layers.1.mlp']['loads'] has 3 experts, the lines before"),
        (json.dumps(_row(3, loads=(1, "2", 3, 4))), "['loads'] must be a non-empty list of numbers >= 0"),
        (json.dumps({**_row(3), "moe_layers": [1, 2]}), "'moe_layers' must be an object of MoE layers"),
        (json.dumps({**_row(3), "moe_layers": {"layers.2.mlp": {"loads": [1]}}}), "names layers ['layers.2.mlp']"),
        (json.dumps({**_row(3), "moe_layers": {"layers.1.mlp": 7}}), "moe_layers['layers.1.mlp'] must be an object"),
    ],
)
@pytest.mark.parametrize("last", [False, True], ids=["middle", "last"])
def test_bad_lines_are_refused_with_path_and_line(tmp_path, line, why, last):
    p = tmp_path / "metrics.jsonl"
    lines = GOOD + [line] if last else [GOOD[0], line, GOOD[1]]
    p.write_text("\n".join(lines) + "\n")
    n = 3 if last else 2
    with pytest.raises(ConfigError) as e:
        mf.read_jsonl(str(p))
    assert str(e.value).startswith(f"{p}:{n}: ") and why in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match=f"{p}:{n}: "):
        read_metrics(str(tmp_path))


def test_the_writer_writes_what_the_reader_reads(tmp_path):
    rec = _row(1, loss=float("nan"), grad_norm=float("inf"))
    rec["moe_layers"]["layers.1.mlp"]["maxvio_global"] = float("-inf")
    line = mf.metrics_line(rec)
    assert "NaN" not in line and "Infinity" not in line
    p = tmp_path / "metrics.jsonl"
    p.write_text(line + "\n")
    (row,), _ = mf.read_jsonl(str(p))
    assert (
        row["loss"] is None and row["grad_norm"] is None and row["moe_layers"]["layers.1.mlp"]["maxvio_global"] is None
    )
    assert row["moe_layers"]["layers.1.mlp"]["loads"] == [3, 5, 4, 4]


def test_resume_reads_the_run_directory_strictly(tmp_path):
    """--resume into the same OUT reads its metrics.jsonl before any step: a bad line is one ConfigError."""
    cfg = DSv3Config.from_block({"preset": "tiny"})
    out = str(tmp_path / "run")
    r = rd.RunDir(out, None, cfg, rank=0, world=1, overwrite=False, save=True)

    def write():
        os.makedirs(os.path.join(r.ckpt, "step2"))
        with open(os.path.join(r.ckpt, "step2", "mp_rank_00_model_states.pt"), "wb") as f:
            f.write(b"x" * 10)

    r.save("step2", 2, write, torch.nn.Linear(2, 2))
    r.close()
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write(GOOD[0] + "\n" + '{"step": 2, "loss": Infinity}\n')
    with pytest.raises(ConfigError, match=rf"{out}/metrics.jsonl:2: Infinity is not a finite number"):
        rd.RunDir(out, out, cfg, rank=0, world=1, overwrite=False, save=True)


def _cli(argv, capsys):
    from dsv3_plugin.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    return code, [x for x in err.splitlines() if x.strip()]


def test_plot_routing_refuses_bad_lines_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(GOOD[0] + "\n" + json.dumps(_row(2, loads=(1, 2))) + "\n" + GOOD[1] + "\n")
    code, err = _cli(["plot-routing", str(run), "--out", str(tmp_path / "r.png")], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {run}/metrics.jsonl:2: not a metrics line: ") and "has 2 experts" in err[0]


@pytest.mark.parametrize(
    "out, why",
    [
        (lambda t: str(t), "is a directory; give the PNG's file name"),
        (lambda t: str(t / "file.txt" / "r.png"), "file.txt is a file, so no directory can be made under it"),
    ],
    ids=["directory", "below_a_file"],
)
def test_plot_routing_output_path_errors_name_the_path(tmp_path, capsys, out, why):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(GOOD) + "\n")
    (tmp_path / "file.txt").write_text("x")
    o = out(tmp_path)
    code, err = _cli(["plot-routing", str(run), "--out", o], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --out {o}: ") and why in err[0], err


def test_plot_routing_read_only_place_names_the_path(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(GOOD) + "\n")
    ro = str(tmp_path / "ro")
    os.makedirs(ro)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p == ro else real(p, mode))
    code, err = _cli(["plot-routing", str(run), "--out", f"{ro}/r.png"], capsys)
    assert code == 2 and err == [f"error: --out {ro}/r.png: cannot write into {ro} (read-only or not this user's)"]
    monkeypatch.setattr(os, "access", real)
    code, err = _cli(["plot-routing", str(run), "--out", f"{ro}/new/r.png"], capsys)  # a missing parent is made
    assert code == 0 and os.path.isfile(f"{ro}/new/r.png"), err
