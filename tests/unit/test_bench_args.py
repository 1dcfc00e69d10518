import pytest

from dsv3_plugin.cli import main


@pytest.mark.parametrize("argv", [["bench", "moe", "--tokens", "-5"], ["bench", "dispatch", "--nodes", "0"],
                                  ["bench", "fp8", "--gemm", "1", "0", "2"], ["bench", "convert", "--shard-mb", "x"]])
def test_bad_bench_sizes_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "argument --" in capsys.readouterr().err
