"""`python -m benchmarks export`'s input: its synthetic run is a run `dsv3 export` reads."""

from benchmarks.export import bench_block, make_synthetic_run
from dsv3_plugin.checkpoint import export as ex


def test_bench_run_is_exportable(tmp_path):
    """`python -m benchmarks export`'s synthetic run (here at the tiny preset) is a run `dsv3 export` reads; its
    V3-shaped block is ~1 GB of FP32 weights per MoE layer."""
    nbytes = make_synthetic_run(str(tmp_path / "r"), {"preset": "tiny"})
    out = ex.export(tmp_path / "r", tmp_path / "x", "hf", progress=False)
    assert out["input_bytes"] == nbytes and out["tensors"] > 0
    assert bench_block(2.1e9)["model"]["num_hidden_layers"] == 2
