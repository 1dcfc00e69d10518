"""`python -m benchmarks pipeline` measures `dsv3 train`'s pipelined step (PipelinedEngine on spawned gloo ranks)
with the W split on and off in the same run: its report has both variants per rank, and the split really ran
deferred W jobs only where it was on. No timed assertions: the idle fractions are whatever the machine gave."""

import json

import pytest

from benchmarks.__main__ import main


@pytest.mark.dist
def test_pipeline_bench_reports_split_and_baseline_per_rank(capsys):
    assert main(["pipeline", "--json", "--steps", "1", "--chunks", "4", "--seq-len", "8", "--micro-batch", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(out["schedules"]) == ["dualpipe", "dualpipev"] and out["pp"] == 2
    for name, s in out["schedules"].items():
        assert len(s["idle_fraction_split"]) == len(s["idle_fraction_no_split"]) == len(s["per_rank"]) == 2
        for r in s["per_rank"]:
            assert r["split"]["w_closures"] > 0 and r["no_split"]["w_closures"] == 0
            for v in (r["split"], r["no_split"]):
                assert v["busy_s"] > 0 and 0 <= v["idle_fraction"] < 1
                assert v["idle_fraction"] == pytest.approx(v["idle_s"] / (v["busy_s"] + v["idle_s"]), rel=1e-12)
                # DualPipe's mirror gradient exchange is counted apart from idle time, never twice: busy, idle
                # and the exchange are disjoint parts of the step's wall time
                assert (v["grad_sync_s"] > 0) is (name == "dualpipe")
                assert v["busy_s"] + v["idle_s"] + v["grad_sync_s"] <= v["wall_s"]
    s = out["schedules"]["dualpipe"]  # the first schedule measured: the headline figures
    mean = sum(s["idle_fraction_split"]) / 2
    assert out["ours"] == s["idle_fraction_split_mean"] == pytest.approx(mean, rel=1e-12)
    assert out["ratio"] == pytest.approx(s["idle_fraction_no_split_mean"] / s["idle_fraction_split_mean"], rel=1e-12)
