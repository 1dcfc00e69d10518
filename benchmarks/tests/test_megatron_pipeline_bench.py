"""`python -m benchmarks megatron-pipeline`: its arithmetic on `--dsv3-metrics` lines, its refusals (exit 2, one line
naming the flag or the missing Megatron), on megatron-core 0.16.1 (no `megatron.training`) and 0.19. The measured run
itself is two `pretrain()` runs (docs/results.md); its per-rank figures are checked on the real runs of
test_pretrain_dualpipev.py (`test_idle_per_rank_reported_in_the_metrics`)."""

import importlib.util

import pytest

from benchmarks.__main__ import main
from benchmarks.megatron_pipeline import summarize


def _row(it, figures):
    return {
        "iteration": it,
        "pipeline_schedule": "dualpipev",
        "pipeline_ranks": [
            {"pp": pp, "busy_s": b, "idle_s": i, "a2a_wait_s": a, "wall_s": w}
            for pp, (b, i, a, w) in enumerate(figures)
        ],
    }


def test_summarize_sums_per_rank_after_the_warmup():
    rows = [
        _row(1, [(9.0, 9.0, 9.0, 99.0), (9.0, 9.0, 9.0, 99.0)]),  # warm-up: left out
        _row(2, [(1.0, 0.5, 0.25, 2.0), (1.5, 0.0, 0.0, 3.0)]),
        _row(3, [(2.0, 0.5, 0.0, 4.0), (0.5, 1.0, 0.5, 1.0)]),
        _row(4, [(1.0, 1.0, 0.0, 2.5), (1.0, 1.0, 0.0, 2.5)]),
    ]
    s = summarize(rows, warmup=1)
    assert s["iterations"] == [2, 3, 4]
    assert s["busy_s"] == [4.0, 3.0] and s["idle_s"] == [2.0, 2.0] and s["a2a_wait_s"] == [0.25, 0.5]
    assert s["idle_fraction"] == [2.0 / 6.0, 2.0 / 5.0]
    assert s["idle_fraction_mean"] == (2.0 / 6.0 + 2.0 / 5.0) / 2
    assert s["step_s"] == 3.0  # slowest rank per iteration: 3.0, 4.0, 2.5 -> median 3.0
    with pytest.raises(ValueError, match="--iters must exceed --warmup"):
        summarize(rows, warmup=4)


HAVE_TRAINING = importlib.util.find_spec("megatron.training") is not None


@pytest.mark.skipif(HAVE_TRAINING, reason="megatron-core >= 0.19 has megatron.training")
def test_refused_without_megatron_training(capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-pipeline", "--json"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs megatron-core >= 0.19 (megatron.training" in err[0], err


@pytest.mark.skipif(not HAVE_TRAINING, reason="megatron-core < 0.19: refused before the flags are read")
@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--chunks", "3"], "--chunks 3: DualPipeV needs >= 2 x --pp = 4"),
        (["--iters", "2", "--warmup", "2"], "--warmup 2: must be >= 0 and < --iters 2"),
        (["--chunks", "5"], "--pp 2 --chunks 5: DualPipe needs both even"),
    ],
)
def test_bad_arguments_name_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-pipeline", "--json", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_bad_sizes_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-pipeline", "--pp", "0"])
    assert e.value.code == 2
    assert "argument --pp" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["megatron-pipeline", "--ep", "0"])
    assert e.value.code == 2
    assert "argument --ep" in capsys.readouterr().err
