"""`python -m benchmarks data`: a bad worker count is a usage error naming the flag; a tiny run reports its corpus,
both sides' throughput and their ratio, each consistent with the seconds it reports (no timing assertions)."""

import json

import pytest

from benchmarks.__main__ import main


def test_bench_data_arguments_and_fields(capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "--workers", "0"])
    assert e.value.code == 2 and "argument --workers" in capsys.readouterr().err
    argv = ["data", "--json", "--workers", "1", "--repeat", "2", "--texts", "3", "--trials", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    tokens = out["corpus"]["tokens"]
    assert out["corpus"]["documents"] == 6 and tokens > 0 and out["workers"] == 1
    for side in ("ours", "baseline"):
        # tokens_per_s = tokens / t rounded to 0.1 (error <= 0.05); seconds = t to 6 significant digits (relative
        # error <= 5e-6, so tokens / seconds is off by at most ~5e-6 of itself); 2x that as the bound's margin
        want = tokens / out[side]["seconds"]
        assert abs(out[side]["tokens_per_s"] - want) <= 0.05 + 1e-5 * want, (out[side], want)
    # ratio to 6 significant digits, each seconds too: three roundings of <= 5e-6 each
    assert out["ratio"] == pytest.approx(out["baseline"]["seconds"] / out["ours"]["seconds"], rel=3e-5)
