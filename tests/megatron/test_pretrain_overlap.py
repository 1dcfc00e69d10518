"""The FB-pair overlap of the EP all-to-all (paper §3.2.1, Fig. 4) under Megatron's own `pretrain()` (`python -m
dsv3_plugin.megatron.pretrain_gpt`, gloo on CPU): PP = 2 x EP = 2 (4 ranks, data parallel 2), DualPipeV and DualPipe
as Megatron's pipeline schedule, each with the overlap on (the default with EP > 1; DualPipe asks for it with
Megatron's own `--overlap-moe-expert-parallel-comm`) and off (`dsv3.parallel.overlap_ep_comm = false`). DualPipe's
pair runs the plugin's FP8 (blockwise, FP8 dispatch payload), as DeepSeek-V3 trains.

The overlap runs each FB op's forward chunk and backward chunk as two lanes taking turns at the plugin's EP
all-to-all waits (`parallel.overlap`); every op of each lane is the op the sequential FB runs, and the gradients
accumulate in the same micro-batch order: losses, MTP losses and router biases equal bit for bit at every
iteration. The figures `--dsv3-metrics` reports per pipeline rank: `fb_hook` (FB ops run overlapped) and
`a2a_wait_s` (the exposed all-to-all).

Needs megatron-core >= 0.19 (`megatron.training`).
"""

import json
import math
import os
import sys

import pytest
from helpers import MEGATRON_SPEC, needs_megatron_training, run_module, tiny_megatron_args

pytestmark = [pytest.mark.dist, needs_megatron_training]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DSV3 = {"preset": "tiny", "model": {"num_hidden_layers": 4}}
ITERS = 3
# micro-batch 2, 4 micro-batches per data-parallel rank (DualPipeV and DualPipe take >= 2 x PP)
FLAGS = MEGATRON_SPEC + tiny_megatron_args(ITERS, mbs=2, gbs=16, seq=16)
FLAGS += ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]


def _run(tmp, name, block, extra):
    cfg, metrics = tmp / f"{name}.json", tmp / f"{name}.jsonl"
    cfg.write_text(json.dumps({"dsv3": block}))
    cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", "--nproc", "4", "--dsv3-config", str(cfg)]
    cmd += ["--dsv3-metrics", str(metrics)] + FLAGS + extra
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    p = run_module(cmd, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return {"metrics": [json.loads(line) for line in metrics.read_text().splitlines()], "log": p.stdout + p.stderr}


def _pair(tmp_path_factory, schedule: str) -> dict:
    """The overlap on and off for one schedule (4 ranks each)."""
    tmp = tmp_path_factory.mktemp(f"overlap_{schedule}")
    off = {"parallel": {"overlap_ep_comm": False}}
    if schedule == "dualpipev":
        flags = ["--dsv3-pipeline-schedule", "dualpipev"]
        return {"on": _run(tmp, "v_on", DSV3, flags), "off": _run(tmp, "v_off", {**DSV3, **off}, flags)}
    fp8 = {"fp8": {"enabled": True, "dispatch": True}}  # DualPipe's pair: the plugin's FP8, FP8 dispatch payload
    flags = ["--dsv3-pipeline-schedule", "dualpipe"]
    return {
        "on": _run(tmp, "dp_on", {**DSV3, **fp8}, flags + ["--overlap-moe-expert-parallel-comm"]),
        "off": _run(tmp, "dp_off", {**DSV3, **fp8, **off}, flags),
    }


@pytest.fixture(scope="module")
def dualpipev_runs(tmp_path_factory):
    return _pair(tmp_path_factory, "dualpipev")


@pytest.fixture(scope="module")
def dualpipe_runs(tmp_path_factory):
    return _pair(tmp_path_factory, "dualpipe")


@pytest.fixture(params=["dualpipev", pytest.param("dualpipe", marks=pytest.mark.long)])
def pair(request):
    """Each schedule's on / off runs. DualPipe's pair (FP8, Megatron's own flag) is a `long` test (CI time:
    two 4-rank launches): `make test` checks the same overlapped FB pair (`stages.overlapped_pair`) under
    DualPipe in `dsv3 train` (tests/dist/test_overlap_ep.py) and under DualPipeV here."""
    return request.param, request.getfixturevalue(f"{request.param}_runs")


KEYS = ("lm_loss", "mtp_1_loss", "router_bias_abs_sum")


def test_overlapped_pairs_change_no_number(pair):
    schedule, runs = pair
    on, off = runs["on"]["metrics"], runs["off"]["metrics"]
    assert [r["iteration"] for r in on] == list(range(1, ITERS + 1)) == [r["iteration"] for r in off]
    for a, b in zip(on, off):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}, (schedule, a, b)  # equal, not close


def test_fb_ops_run_overlapped_and_the_exposed_all_to_all_is_reported(pair):
    schedule, runs = pair
    for state in ("on", "off"):
        for r in runs[state]["metrics"]:
            assert r["pipeline_schedule"] == schedule
            ranks = r["pipeline_ranks"]
            assert [e["pp"] for e in ranks] == [0, 1], r
            for e in ranks:
                # every rank of DualPipe(V) at PP = 2 with 4 micro-batches runs FB ops in its steady phase
                assert (e["fb_hook"] > 0) == (state == "on"), (schedule, state, e)
                assert math.isfinite(e["a2a_wait_s"]) and 0 <= e["a2a_wait_s"] <= e["busy_s"], e


def test_the_overlap_is_printed_and_megatrons_flag_is_mapped(pair):
    schedule, runs = pair
    for state, r in runs.items():
        line = f"EP all-to-all overlap (paper Fig. 4): {schedule}'s FB pairs run "
        want = "as two lanes" if state == "on" else "forward then backward (dsv3.parallel.overlap_ep_comm = false)"
        assert line + want in r["log"], (schedule, state)
    if schedule == "dualpipe":
        assert "--overlap-moe-expert-parallel-comm: the plugin's" in runs["on"]["log"]
        for state in ("on", "off"):  # the FP8 pair runs FP8
            assert any(x.startswith("dsv3_plugin: FP8 (") for x in runs[state]["log"].splitlines()), state


def _parse(tmp_path, block, argv, world_size=4):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dsv3": block}))
    return parse_megatron_args(
        FLAGS + ["--dsv3-config", str(p)] + argv, world_size=world_size, set_globals=False, on_cpu=True
    )


@pytest.mark.parametrize(
    "block_parallel, argv, world, message",
    [
        (
            {},
            ["--overlap-moe-expert-parallel-comm"],
            4,
            r"^--overlap-moe-expert-parallel-comm: the FB pairs it overlaps run in the plugin's dualpipe / dualpipev "
            r".*\(here: megatron, pipeline size 2, expert-parallel size 2\)",
        ),
        (
            {"overlap_ep_comm": False},
            ["--dsv3-pipeline-schedule", "dualpipev", "--overlap-moe-expert-parallel-comm"],
            4,
            r"^--overlap-moe-expert-parallel-comm: contradicts .*dsv3\.parallel\.overlap_ep_comm = false",
        ),
        (
            {"pp": 2, "ep": 2, "schedule": "dualpipev", "overlap_ep_comm": True},
            ["--dsv3-pipeline-schedule", "1f1b"],
            4,
            r"^--dsv3-pipeline-schedule 1f1b: contradicts .*dsv3\.parallel\.schedule = 'dualpipev'",
        ),
        (
            {"pp": 2, "ep": 2, "schedule": "dualpipev", "overlap_ep_comm": True},
            ["--dsv3-pipeline-schedule", "dualpipev", "--expert-model-parallel-size", "1"],
            4,
            r"^--expert-model-parallel-size 1: contradicts .*dsv3\.parallel\.ep = 2",
        ),
    ],
)
def test_an_overlap_where_no_fb_pair_runs_is_refused(tmp_path, block_parallel, argv, world, message):
    from dsv3_plugin.config import ConfigError

    block = {**DSV3, "parallel": block_parallel} if block_parallel else DSV3
    with pytest.raises(ConfigError, match=message):
        _parse(tmp_path, block, argv, world)
