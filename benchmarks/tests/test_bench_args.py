import pytest

from benchmarks.__main__ import main


@pytest.mark.parametrize(
    "argv",
    [
        ["moe", "--tokens", "-5"],
        ["dispatch", "--nodes", "0"],
        ["fp8", "--gemm", "1", "0", "2"],
        ["convert", "--shard-mb", "x"],
    ],
)
def test_bad_bench_sizes_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert "argument --" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["pipeline", "--chunks", "3"], "--chunks: dualpipe"),
        (
            ["pipeline", "--pp", "3", "--schedule", "dualpipe"],
            "--pp: dualpipe needs an even number of pipeline ranks",
        ),
        (["pipeline", "--preset", "huge"], "dsv3.preset: unknown preset"),
        (["overlap", "--chunks", "3"], "--chunks: dualpipev"),
        (["overlap", "--ep", "1"], "--ep: must be >= 2"),
        (["overlap", "--preset", "huge"], "dsv3.preset: unknown preset"),
    ],
)
def test_bad_pipeline_and_overlap_bench_arguments_are_usage_errors_naming_the_flag(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_convert_bench_checkpoint_shape_knobs():
    """The synthetic checkpoint's layer shape follows n_experts / heads; the layer count fills the target size.
    FP8 bytes of one layer at 32 heads, 10 + 1 experts: MLA (1536·7168 + 32·192·1536 + 576·7168 + 32·256·512 +
    7168·32·128) + 11 · 3 · 2048 · 7168 = 542.1 MB, so 1.1 GB holds 2 layers."""
    from benchmarks.convert import _config

    d = _config(1.1e9, n_experts=10, heads=32)
    assert (d["n_routed_experts"], d["num_attention_heads"], d["num_key_value_heads"]) == (10, 32, 32)
    assert (
        d["num_hidden_layers"]
        == round(
            1.1e9
            / (1536 * 7168 + 32 * 192 * 1536 + 576 * 7168 + 32 * 256 * 512 + 7168 * 32 * 128 + 11 * 3 * 2048 * 7168)
        )
        == 2
    )
    default = _config(1.2e9)
    assert (default["n_routed_experts"], default["num_attention_heads"], default["num_hidden_layers"]) == (8, 128, 2)
