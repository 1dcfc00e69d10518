"""Megatron-LM's own `--exit-signal-handler` with the plugin's model and DualPipeV, through the entry point users run
(`torchrun ... -m dsv3_plugin.megatron.pretrain_gpt`, 2 gloo ranks, `--pipeline-model-parallel-size 2
--dsv3-pipeline-schedule dualpipev`).

A run receives SIGTERM at a random iteration, sent to every rank's process (what a scheduler such as Slurm does to
the tasks of a job): Megatron's handler notes it, all ranks agree at the next iteration boundary (its all-gather of
the flag), save a checkpoint to `--save` and exit 0. A new run `--load`ing it trains to the end. Checked against an
uninterrupted run of the same flags: every iteration's losses, router biases and embedding sums
(`--dsv3-metrics`, full precision) are equal bit for bit, before and after the interruption, and so are the
`lm loss` numbers Megatron logs (7 significant digits; Megatron logs the second iteration of a process as the mean
of its first two, so that line, of either run, is compared only where both runs started at the same iteration).

Before the fix in `dsv3_plugin/megatron/schedules.py` rank 0 never exited: the schedule's cached runtime held
Megatron's data iterator, so its DataLoader workers were still alive at interpreter exit, where multiprocessing
stops them with SIGTERM -- which Megatron's handler, installed in every worker, swallows.

Needs megatron-core >= 0.19 (`megatron.training` in the wheel).
"""

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import MEGATRON_SPEC, tiny_megatron_args

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training (Megatron's pretrain())")
# make test-long: four Megatron launches, minutes of CPU (make test keeps the DeepSpeed path's stop tests)
pytestmark = [pytest.mark.dist, pytest.mark.long]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = "dsv3_plugin.megatron.pretrain_gpt"
ITERS = 6
FLAGS = MEGATRON_SPEC + tiny_megatron_args(ITERS) + ["--pipeline-model-parallel-size", "2"]
FLAGS += ["--dsv3-pipeline-schedule", "dualpipev"]
LIMIT_S = 300  # one run; ~30 s each on 2 idle cores


def _cmd(tmp, name, extra, launcher="torchrun"):
    launch = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", ENTRY]
        if launcher == "torchrun"
        else ["-m", ENTRY, "--nproc", "2"]
    )
    return (
        [sys.executable]
        + launch
        + [
            "--dsv3-config",
            str(tmp / "ds.json"),
            "--dsv3-metrics",
            str(tmp / f"{name}.jsonl"),
        ]
        + FLAGS
        + extra
    )


def _env():
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def _logged_losses(log: str) -> dict[int, str]:
    """iteration -> the `lm loss` Megatron printed for it (as printed)."""
    out = {}
    for m in re.finditer(r"iteration +(\d+)/ *\d+ \|.*?lm loss: ([0-9.E+-]+)", log):
        out[int(m.group(1))] = m.group(2)
    return out


# what a run times (each pipeline rank's busy / idle / wait seconds in `pipeline_ranks`) differs between any two runs:
# dropped, so that the comparison is of what the runs compute (losses, biases, sums, the ranks' closure counts)
_TIMED = re.compile(r"(_s|_fraction)$")


def _metrics(tmp, name):
    rows = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()]
    for row in rows:
        for rank in row.get("pipeline_ranks", []):
            for key in [k for k in rank if _TIMED.search(k)]:
                del rank[key]
    return rows


def _run(tmp, name, extra):
    p = subprocess.run(_cmd(tmp, name, extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=LIMIT_S)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p.stdout


def _workers(agent_pid: int) -> list[int]:
    """The ranks torchrun started (its children running the entry point)."""
    with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
        kids = [int(x) for x in f.read().split()]
    out = []
    for pid in kids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"dsv3_plugin.megatron.pretrain_gpt" in f.read():
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def _run_interrupted(tmp, name, extra, at_iteration: int, launcher="torchrun"):
    """The run, with SIGTERM sent once Megatron has logged `at_iteration`: to each rank under torchrun, to the one
    process a user started with `--nproc`. Returns (rc, output, seconds from the signal to the end)."""
    p = subprocess.Popen(
        _cmd(tmp, name, extra, launcher),
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(ln) for ln in p.stdout] + [lines.put(None)], daemon=True)
    reader.start()
    out, signalled, ranks, deadline = [], None, [], time.monotonic() + LIMIT_S
    try:
        while True:
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            if line is None:
                break
            out.append(line)
            if signalled is None and re.search(rf"iteration +{at_iteration}/", line):
                if launcher == "torchrun":
                    ranks = _workers(p.pid)
                    assert len(ranks) == 2, ranks
                for pid in ranks if launcher == "torchrun" else [p.pid]:
                    os.kill(pid, signal.SIGTERM)
                signalled = time.monotonic()
        rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if p.poll() is None:  # out of time: a hung rank outlives a killed torchrun
            for pid in [p.pid] + ranks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        p.wait()
    assert signalled is not None, f"iteration {at_iteration} was never logged:\n" + "".join(out)[-5000:]
    return rc, "".join(out), time.monotonic() - signalled


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exit_signal")
    (tmp / "ds.json").write_text(json.dumps({"dsv3": {"preset": "tiny", "model": {"num_hidden_layers": 4}}}))
    ck = str(tmp / "ckpt")
    at = random.Random().randint(1, ITERS - 2)  # the save lands at `at` or `at + 1`: at least one iteration left
    straight = _run(tmp, "straight", [])
    handler = ["--exit-signal-handler", "--save", ck, "--save-interval", "1000"]
    rc, log, after_s = _run_interrupted(tmp, "interrupted", handler, at)
    tracker = tmp / "ckpt" / "latest_checkpointed_iteration.txt"
    saved = int(tracker.read_text()) if tracker.exists() else None
    resumed = _run(tmp, "resumed", handler + ["--load", ck])
    # the same with self-spawned ranks, the signal sent to the process the user started
    at_nproc = random.Random().randint(1, ITERS - 2)
    ck_nproc = tmp / "ckpt_nproc"
    nproc = _run_interrupted(
        tmp, "nproc", ["--exit-signal-handler", "--save", str(ck_nproc), "--save-interval", "1000"], at_nproc, "nproc"
    )
    tracker_nproc = ck_nproc / "latest_checkpointed_iteration.txt"
    return {
        "nproc": {
            "at": at_nproc,
            "rc": nproc[0],
            "log": nproc[1],
            "saved": int(tracker_nproc.read_text()) if tracker_nproc.exists() else None,
            "metrics": _metrics(tmp, "nproc"),
        },
        "at": at,
        "rc": rc,
        "saved": saved,
        "after_s": after_s,
        "logs": {"straight": straight, "interrupted": log, "resumed": resumed},
        "metrics": {k: _metrics(tmp, k) for k in ("straight", "interrupted", "resumed")},
    }


def test_sigterm_saves_and_exits_at_the_next_iteration_boundary(runs):
    log, at = runs["logs"]["interrupted"], runs["at"]
    assert runs["rc"] == 0, f"signal after iteration {at}: torchrun exit {runs['rc']}\n" + log[-5000:]
    assert "exiting program after receiving SIGTERM" in log, log[-3000:]
    # the ranks agree on one boundary: the one where the flag was first seen, the iteration logged or the next
    assert runs["saved"] in (at, at + 1), (at, runs["saved"])
    assert f"successfully saved checkpoint from iteration {runs['saved']:7d}" in log
    assert [r["iteration"] for r in runs["metrics"]["interrupted"]] == list(range(1, runs["saved"] + 1))
    assert runs["after_s"] < 120, f"{runs['after_s']:.0f} s from SIGTERM to exit"


def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs):
    m, n = runs["metrics"], runs["saved"]
    assert [r["iteration"] for r in m["straight"]] == list(range(1, ITERS + 1))
    assert "successfully loaded checkpoint from" in runs["logs"]["resumed"]
    assert m["interrupted"] == m["straight"][:n], f"signal after iteration {runs['at']}"
    assert m["resumed"] == m["straight"][n:], f"signal after iteration {runs['at']}, resumed from {n}"
    # what Megatron prints (7 significant digits), except the line it averages over a process's first two iterations
    logged = {k: _logged_losses(v) for k, v in runs["logs"].items()}
    assert sorted(logged["straight"]) == list(range(1, ITERS + 1))
    for name, first in (("interrupted", 1), ("resumed", n + 1)):
        for it, v in logged[name].items():
            # a process's second line is the mean of its first two: skip it unless both runs started at 1
            if first == 1 or it not in (first + 1, 2):
                assert v == logged["straight"][it], (name, it, v, logged["straight"][it])
    assert sorted(logged["interrupted"]) == list(range(1, n + 1))
    assert sorted(logged["resumed"]) == list(range(n + 1, ITERS + 1))


def test_nproc_parent_passes_the_signal_to_its_ranks(runs):
    r = runs["nproc"]
    assert r["rc"] == 0, f"SIGTERM after iteration {r['at']}: exit {r['rc']}\n" + r["log"][-5000:]
    assert "exiting program after receiving SIGTERM" in r["log"], r["log"][-3000:]
    assert r["saved"] in (r["at"], r["at"] + 1), (r["at"], r["saved"])
    assert r["metrics"] == runs["metrics"]["straight"][: r["saved"]]
