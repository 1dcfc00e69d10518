"""`python -m benchmarks model`: argument errors, and a tiny run through the runner checking the JSON's structure, the
equal parameter counts and the breakdown's parts (no timing assertions)."""

import json
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.__main__ import main
from benchmarks._gemm_profile import GEMM_OPS, gemm_flops
from benchmarks.model import IMPLS, PARTS, _check_counts, titan_import_error

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
        main(["model", *argv])
    assert e.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_tiny_run_reports_every_implementation_with_equal_parameters_and_all_parts(tmp_path, capsys):
    png = tmp_path / "breakdown.png"
    assert main(["model", "--json", *TINY, "--png", str(png)]) == 0
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
    g = r["ours"]["gemm"]  # where ours stands against the machine's GEMM rate
    assert g["gflop"] > 0 and g["ms"] > 0 and g["calls"] > 0 and g["peak_gflops"] > 0 and g["rate_fraction"] > 0
    assert all("gemm" not in r[i] for i in expected if i != "ours")
    at_peak_ms = r["ours"]["wall_ms"] - g["ms"] + g["gflop"] / g["peak_gflops"] * 1e3
    assert d["ratio_if_gemm_at_peak"]["T=32 float32"] == r["ratio_if_gemm_at_peak"]
    for i in set(expected) - {"ours"}:
        assert r["ratio_if_gemm_at_peak"][i] == pytest.approx(r[i]["wall_ms"] / at_peak_ms)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torchtitan_absent_is_stated(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # what an environment without the `peers` extra sees
    args = ["model", "--json", *TINY, "--impls", "ours,titan", "--no-breakdown"]
    assert main(args) == 0
    cap = capsys.readouterr()
    d = json.loads(cap.out)
    assert d["impls"] == ["ours"] and "torchtitan not importable" in d["skipped"]["titan"]
    assert "[bench model] torchtitan skipped" in cap.err
    assert d["results"][0]["ratio"] == {} and "breakdown" not in d["results"][0]["ours"]
    assert "gemm" not in d["results"][0]["ours"] and d["ratio_if_gemm_at_peak"] == {}


def test_unequal_parameter_counts_fail_naming_the_part():
    same = {"attention": 10, "routed_experts": 20}
    _check_counts({"ours": {"total": 30, "by_part": same}, "hf": {"total": 30, "by_part": dict(same)}})
    with pytest.raises(RuntimeError, match=r"by part: attention: ours 10, hf 12$"):
        _check_counts(
            {"ours": {"total": 30, "by_part": same}, "hf": {"total": 32, "by_part": {**same, "attention": 12}}}
        )


def test_gemm_flops_count_every_matrix_product_including_in_place_ones():
    """2·M·K·N per call (times the batch for bmm), out= and in-place forms included: the profiler's own FLOP
    counter reports 0 for `addmm_` / `baddbmm_`, which the expert kernel uses."""
    a, b, c = torch.randn(6, 5), torch.randn(5, 3), torch.zeros(6, 3)
    A, B, C = torch.randn(4, 6, 5), torch.randn(4, 5, 3), torch.zeros(4, 6, 3)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.mm(a, b)
        torch.mm(a, b, out=c)
        c.addmm_(a, b)
        torch.addmm(c, a, b)
        torch.mm(b.t(), a.t())  # [3, 5]·[5, 6]
        torch.bmm(A, B)
        C.baddbmm_(A, B)
    got = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key in GEMM_OPS:
            got[e.key] = got.get(e.key, 0) + e.count * gemm_flops(e.key, e.input_shapes)
    mm = 2 * 6 * 5 * 3
    want = {"aten::mm": 3 * mm, "aten::addmm_": mm, "aten::addmm": mm, "aten::bmm": 4 * mm, "aten::baddbmm_": 4 * mm}
    assert got == want
