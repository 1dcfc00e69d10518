import pytest

from dsv3_plugin.cli import main


@pytest.mark.parametrize("argv", [["bench", "moe", "--tokens", "-5"], ["bench", "dispatch", "--nodes", "0"],
                                  ["bench", "fp8", "--gemm", "1", "0", "2"], ["bench", "convert", "--shard-mb", "x"]])
def test_bad_bench_sizes_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "argument --" in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [(["bench", "pipeline", "--chunks", "3"], "--chunks: dualpipe"),
                                       (["bench", "pipeline", "--pp", "3", "--schedule", "dualpipe"],
                                        "--pp: dualpipe needs an even number of pipeline ranks"),
                                       (["bench", "pipeline", "--preset", "huge"], "dsv3.preset: unknown preset")])
def test_bad_pipeline_bench_counts_are_usage_errors_naming_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("argv, msg", [(["bench", "overlap", "--chunks", "3"], "--chunks: dualpipev"),
                                       (["bench", "overlap", "--ep", "1"], "--ep: must be >= 2"),
                                       (["bench", "overlap", "--preset", "huge"], "dsv3.preset: unknown preset")])
def test_bad_overlap_bench_arguments_are_usage_errors_naming_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err
