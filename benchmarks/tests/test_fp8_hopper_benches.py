"""`python -m benchmarks fp8-accum` and `python -m benchmarks fp8-hopper-train` at small sizes: JSON conventions
(ours, baseline, ratio, env), the PNGs, bounds honoured, and usage errors. Needs the pinned mmaemu (`make venv`)."""

import json

import pytest

from benchmarks.__main__ import main
from dsv3_plugin.precision.fp8.hopper import mmaemu_status


@pytest.fixture(autouse=True)
def _need_mmaemu():
    ok, why = mmaemu_status()
    if not ok:
        pytest.fail(f"{why}. Run `make venv` (it installs the pinned mmaemu) and use .venv/bin/python")


def test_fp8_accum_bench(tmp_path, capsys):
    png = tmp_path / "accum.png"
    assert (
        main(
            [
                "fp8-accum",
                "--json",
                "--m",
                "4",
                "--n",
                "16",
                "--ks",
                "512",
                "4096",
                "--nc",
                "64",
                "128",
                "none",
                "--png",
                str(png),
                "--no-progress",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {"ours", "baseline", "ratio", "env", "errors", "paper", "seconds"} <= set(out)
    assert out["ratio"] == pytest.approx(out["baseline"] / out["ours"])
    assert out["errors"]["positive"]["none"]["4096"]["max_rel"] > out["errors"]["positive"]["128"]["4096"]["max_rel"]
    for dist in ("activation", "positive"):
        for key in ("emulate", "64", "128", "none"):
            for cell in out["errors"][dist][key].values():
                assert cell["within_bound"] and 0 <= cell["mean_rel"] <= cell["max_rel"] <= cell["bound_rel"]
    assert png.stat().st_size > 10_000 and out["png"] == str(png)


@pytest.mark.parametrize("argv", [["--nc", "48"], ["--nc", "0"], ["--ks", "-1"], ["--dists", "uniform"]])
def test_fp8_accum_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fp8-accum", *argv])
    assert e.value.code == 2 and "argument --" in capsys.readouterr().err


def test_fp8_hopper_train_bench(tmp_path, capsys):
    png = tmp_path / "train.png"
    assert (
        main(
            [
                "fp8-hopper-train",
                "--json",
                "--steps",
                "3",
                "--batch",
                "2",
                "--seq-len",
                "16",
                "--runs",
                "emulate",
                "hopper-128",
                "hopper-none",
                "--png",
                str(png),
                "--no-progress",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {"ours", "baseline", "ratio", "env", "no_promotion", "runs", "setup"} <= set(out)
    runs = out["runs"]
    assert [len(runs[r]["loss"]) for r in runs] == [3, 3, 3]
    assert runs["emulate"]["backend"] == "emulate" and runs["hopper-128"]["backend"] == "hopper-emulated"
    assert runs["hopper-128"]["loss"] != runs["emulate"]["loss"]  # the modeled accumulation really ran
    assert out["ratio"] == pytest.approx(runs["hopper-128"]["final_loss"] / runs["emulate"]["final_loss"])
    assert png.stat().st_size > 10_000


def test_fp8_hopper_train_refuses_no_promotion_with_blockwise():
    with pytest.raises(SystemExit, match="tensorwise"):
        main(["fp8-hopper-train", "--recipe", "blockwise", "--runs", "hopper-none", "--png", ""])
