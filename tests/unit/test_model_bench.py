"""`dsv3 bench model`: argument errors, and a tiny run through the CLI checking the JSON's structure, the equal
parameter counts and the breakdown's parts (no timing assertions)."""

import json
import sys

import pytest

from dsv3_plugin.bench.model import IMPLS, PARTS, _check_counts, titan_import_error
from dsv3_plugin.cli import main

TINY = ["--preset", "tiny", "--seq-lens", "32", "--dtypes", "float32", "--batch", "2", "--rounds", "1"]
TINY += ["--steps", "1", "--warmup", "1", "--part-repeats", "1"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--seq-lens", "256,x"], "--seq-lens"),
        (["--seq-lens", "0"], "--seq-lens"),
        (["--seq-lens", ","], "--seq-lens"),
        (["--seq-lens", "256,256"], "--seq-lens"),
        (["--dtypes", "float16"], "--dtypes"),
        (["--impls", "hf,titan"], "--impls"),
        (["--impls", "ours,jax"], "--impls"),
        (["--batch", "0"], "--batch"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "model", *argv])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_tiny_run_reports_every_implementation_with_equal_parameters_and_all_parts(tmp_path, capsys):
    png = tmp_path / "breakdown.png"
    assert main(["bench", "model", "--json", *TINY, "--png", str(png)]) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    why = titan_import_error()
    expected = [i for i in IMPLS if i != "titan" or why is None]
    assert d["bench"] == "model" and d["impls"] == expected and "env" in d
    if why is not None:  # never a silent omission
        assert "titan" in d["skipped"] and "torchtitan" in d["skipped"]["titan"]
        assert "torchtitan skipped" in cap.err
    else:
        assert d["skipped"] == {}
    assert "mtp" in d["excluded"] and "ru_maxrss" in d["peak_memory"]
    (r,) = d["results"]
    assert (r["T"], r["dtype"], r["tokens_per_step"]) == (32, "float32", 64)
    assert set(r["ratio"]) == set(expected) - {"ours"} == set(d["ratio"]["T=32 float32"])
    totals = {r[i]["params"]["total"] for i in expected}
    assert len(totals) == 1 and totals.pop() > 0
    for i in expected:
        assert r[i]["params"]["by_part"] == r["ours"]["params"]["by_part"], i
        assert set(r[i]["params"]["by_part"]) <= set(PARTS)  # every parameter belongs to a named part
        assert r[i]["cpu_ms"] > 0 and r[i]["wall_ms"] > 0 and r[i]["peak_rss_mib"] >= r[i]["rss_after_build_mib"]
        bd = r[i]["breakdown"]
        assert set(bd["cpu_ms"]) == set(PARTS) == set(bd["calls"]), i
        assert all(n > 0 for n in bd["calls"].values()), (i, bd["calls"])
        assert bd["calls"]["attention"] == 3 and bd["calls"]["routed_experts"] == 2  # tiny: 3 layers, 1 dense
        assert bd["sum_cpu_ms"] == pytest.approx(sum(bd["cpu_ms"].values()))
        assert bd["other_cpu_ms"] == pytest.approx(bd["step_cpu_ms"] - bd["sum_cpu_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torchtitan_absent_is_stated(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # what an environment without the `peers` extra sees
    args = ["bench", "model", "--json", *TINY, "--impls", "ours,titan", "--no-breakdown"]
    assert main(args) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    assert d["impls"] == ["ours"] and "torchtitan not importable" in d["skipped"]["titan"]
    assert "[bench model] torchtitan skipped" in cap.err
    assert d["results"][0]["ratio"] == {} and "breakdown" not in d["results"][0]["ours"]


def test_unequal_parameter_counts_fail_naming_the_part():
    same = {"attention": 10, "routed_experts": 20}
    _check_counts({"ours": {"total": 30, "by_part": same}, "hf": {"total": 30, "by_part": dict(same)}})
    with pytest.raises(RuntimeError, match=r"by part: attention: ours 10, hf 12$"):
        _check_counts(
            {"ours": {"total": 30, "by_part": same}, "hf": {"total": 32, "by_part": {**same, "attention": 12}}}
        )
