"""A released FP8 checkpoint (`--dsv3-init-from`) and real text (`--data-path`, prepared by `dsv3 prepare-data`)
under the two-chunk pipeline schedules of `pretrain()`, with the plugin's FP8 on (`--fp8-format e4m3 --fp8-recipe
blockwise`): each rank loads its own chunks' tensors by global layer name (the V: stages r and 2P-1-r; DualPipe:
stage r of copy A and stage P-1-r of copy B, both from the same tensors; the end ranks read the data), and the first
iteration's losses equal the PP = 1 run's bit for bit — the forward of every micro-batch runs
the same ops on the same weights and inputs at PP = 1 and PP = 2, and Megatron sums the micro-batches' loss dicts
in the same order.

1F1B's layout (stage r on rank r, the MTP block on the last) loads through the same per-stage rule as the V's
chunk 0 and DualPipe's copies; it is not run again here (CI time).

Needs megatron-core >= 0.19 (`megatron.training`); 0.16.1 has no `pretrain()` in its wheel (the chunk-level loading
is covered there by tests/megatron/test_dualpipev_chunks.py).
"""

import json
import os

import pytest
from helpers import config_builds, pretrain_gpt_counting_config_builds, run_entry_point

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")
pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, MBS, GBS = 32, 1, 4  # 4 micro-batches: DualPipeV and DualPipe at P = 2 need >= 2P (and an even count)


def _run(tmp, rel, name, nproc, extra):
    metrics = tmp / f"{name}.jsonl"
    flags = ["--micro-batch-size", str(MBS), "--global-batch-size", str(GBS), "--seq-length", str(SEQ)]
    flags += ["--train-iters", "1", "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "100"]
    flags += ["--eval-iters", "0", "--seed", "1234", "--tokenizer-type", "HuggingFaceTokenizer"]
    flags += ["--data-path", str(tmp / "text"), "--split", "100,0,0"]  # real text, prepared as a user prepares it
    flags += ["--tokenizer-model", str(rel), "--dsv3-init-from", str(rel)]
    flags += ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    # `python -m dsv3_plugin.megatron.pretrain_gpt`, each process reporting the run configs it built
    # (run in this process: its ranks are forks of the shared forkserver)
    argv = ["--nproc", str(nproc), "--dsv3-config", str(tmp / "ds.json"), "--dsv3-metrics", str(metrics)]
    argv += [*flags, *extra]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.path.join(ROOT, "tests"), "OMP_NUM_THREADS": "1"}
    p = run_entry_point(pretrain_gpt_counting_config_builds, argv, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {"rows": [json.loads(line) for line in metrics.read_text().splitlines()], "log": p.stdout}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import TINY_RELEASE, write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    tmp = tmp_path_factory.mktemp("init_from_schedules")
    # the tiny release with 4 layers (1 dense, 3 MoE): 4 stages of the V, 2 per copy for DualPipe and 1F1B
    block = {**TINY_RELEASE, "model": {**TINY_RELEASE["model"], "num_hidden_layers": 4}}
    rel = write_tiny_release(tmp / "rel", fp8=True, block=block)
    with open(tmp / "text.jsonl", "w") as f:
        f.writelines(json.dumps({"text": t[:2000]}) + "\n" for t in pydoc_texts()[:16])
    prepare([str(tmp / "text.jsonl")], rel, str(tmp / "text"), progress=False)  # `dsv3 prepare-data`
    fp8 = {"enabled": True, "recipe": "blockwise", "backend": "emulate"}
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {**block, "fp8": fp8}}))
    out = {"pp1": _run(tmp, rel, "pp1", 1, [])}
    for schedule in ("dualpipev", "dualpipe"):
        pp2 = ["--pipeline-model-parallel-size", "2", "--dsv3-pipeline-schedule", schedule]
        out[schedule] = _run(tmp, rel, schedule, 2, pp2)
    return out


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_first_iteration_equals_the_pp1_run(runs, schedule):
    ref, got = runs["pp1"]["rows"], runs[schedule]["rows"]
    assert len(ref) == len(got) == 1
    # the losses, and the routers' biases after Megatron's update from the iteration's expert loads
    for key in ("lm_loss", "mtp_1_loss", "router_bias_abs_sum"):
        assert got[0][key] == ref[0][key], (schedule, key, got[0][key], ref[0][key])
    log = runs[schedule]["log"]
    assert "dsv3_plugin: initial weights: --dsv3-init-from" in log and "dsv3_plugin: FP8 (" in log


@pytest.mark.parametrize("name", ["pp1", "dualpipev", "dualpipe"])
def test_each_process_reads_the_config_once(runs, name):
    """`--dsv3-config` is read and its block validated once per process, as Megatron parses its arguments once: by
    the launching process (the flags checked before any rank starts) and by each rank (`parse_megatron_args`); the
    model chunks (two per rank here), the FP8 install, `--dsv3-init-from` and the schedule take that object."""
    nproc = 1 if name == "pp1" else 2
    want = {"parent": 1} | {f"rank {r}": 1 for r in range(nproc)}
    assert config_builds(runs[name]["log"]) == want
