"""`python -m benchmarks megatron-fp8`: Megatron's step-time log read right, its refusals (exit 2, one line naming the
flag or the missing Megatron) on megatron-core 0.16.1 (no `megatron.training`) and 0.19. The measured run itself is two
`pretrain()` runs (docs/results.md); the FP8 run it times is the one tests/megatron/test_megatron_fp8.py checks."""

import importlib.util

import pytest

from benchmarks.__main__ import main
from benchmarks.megatron_fp8 import step_times

HAVE_TRAINING = importlib.util.find_spec("megatron") is not None and (
    importlib.util.find_spec("megatron.training") is not None
)

LOG = """\
 [2026-12-03 18:38:16.433736] iteration        1/       3 | consumed samples:            4 | elapsed time per \
iteration (ms): 842.7 | learning rate: 2.000000E-03 | global batch size:     4 | lm loss: 5.568884E+00 |
some other line with elapsed time per iteration (ms): 1.0 but no iteration counter
 [2026-12-03 18:38:17.273176] iteration        2/       3 | consumed samples:            8 | elapsed time per \
iteration (ms): 841.1 | learning rate: 1.000000E-03 |
 [2026-12-03 18:38:18.206621] iteration        3/       3 | consumed samples:           12 | elapsed time per \
iteration (ms): 933.4 | learning rate: 0.000000E+00 |
"""


def test_step_times_read_from_megatrons_log():
    assert step_times(LOG) == {1: 842.7 / 1000, 2: 841.1 / 1000, 3: 933.4 / 1000}  # ms in the log
    assert step_times("no training here") == {}


@pytest.mark.skipif(HAVE_TRAINING, reason="megatron-core >= 0.19 has megatron.training")
def test_refused_without_megatron_training(capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-fp8", "--json"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs megatron-core >= 0.19 (megatron.training" in err[0], err


@pytest.mark.skipif(not HAVE_TRAINING, reason="megatron-core < 0.19: refused before the flags are read")
def test_bad_warmup_names_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-fp8", "--json", "--iters", "2", "--warmup", "2"])
    assert e.value.code == 2
    assert "--warmup 2: must be >= 0 and < --iters 2" in capsys.readouterr().err


def test_bad_sizes_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["megatron-fp8", "--nproc", "0"])
    assert e.value.code == 2
    assert "argument --nproc" in capsys.readouterr().err
