"""A stopped peer ends `dsv3 train` within `parallel.p2p_timeout_s`, with a message naming the limit.

`dsv3 train --nproc N` runs until its first step line is printed; then one rank is SIGSTOPped (alive but
silent: the case a dead connection does not reveal). The other ranks' next wait on it must fail, and the job
must exit non-zero. Two layouts:

- pp = 2 on 2 ranks: a pipeline receive, or a collective of the pipeline / data-parallel / world group;
- ep = 2 on 4 ranks: the stopped rank's EP partner waits in an expert-parallel all-to-all (EP groups
  [0, 1], [2, 3] are groups of their own, not the world group), the other EP group in DeepSpeed's ZeRO-1
  gradient reduction (a clone of the world group DeepSpeed creates). torch gives a group created without a
  timeout 30 minutes, so each of these groups must get the configured value.

The bound checked is a bound on a hang, not a speed figure: 4 x the timeout plus 60 s for the failure to
propagate on a loaded machine, against a run that would otherwise go on for hours (100 000 steps), or wait
30 minutes per operation on a group created with torch's default.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 8
LAYOUTS = {
    # name: (nproc, DeepSpeed JSON without the "dsv3" block's train section, the "dsv3" block)
    "pp2": (
        2,
        {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2},
        {"preset": "tiny", "parallel": {"pp": 2, "schedule": "1f1b", "p2p_timeout_s": TIMEOUT_S}},
    ),
    "ep2x2": (
        4,
        {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
        {"preset": "tiny", "parallel": {"ep": 2, "p2p_timeout_s": TIMEOUT_S}},
    ),
}

# an 8 s peer timeout: `make test` runs these alone, with the cores to themselves (pyproject's `serial` marker)
pytestmark = pytest.mark.serial


def config(path, layout: str, timeout_s: float = TIMEOUT_S) -> str:
    nproc, ds_batch, block = LAYOUTS[layout]
    block = json.loads(json.dumps(block))
    block["parallel"]["p2p_timeout_s"] = timeout_s
    ds = {
        **ds_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {**block, "train": {"seq_len": 16, "steps": 100000, "seed": 3, "save_every": 0}},
    }
    with open(path, "w") as f:
        json.dump(ds, f)
    return str(path)


def _ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The spawned rank processes (forks of multiprocessing's forkserver, a child of the launcher; not the
    forkserver itself nor the resource tracker), in rank order (forked in order, so pid order)."""
    out = []
    for c in launcher.children():
        try:
            if any("forkserver" in a for a in c.cmdline()):
                out.extend(c.children())
        except psutil.Error:
            pass
    return sorted(out, key=lambda p: p.pid)


def stop_a_rank(tmp_path, layout: str, victim: int, timeout_s: float = TIMEOUT_S, env: dict | None = None) -> dict:
    """Run `dsv3 train` in `layout`, SIGSTOP rank `victim` after the first step line, wait for the job to end.
    Returns {"rc", "stderr", "after_stop_s"} ("rc" None: still running at 4 x timeout + 60 s, then killed)."""
    nproc = LAYOUTS[layout][0]
    env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        **(env or {}),
    }
    cmd = [
        sys.executable,
        "-m",
        "dsv3_plugin",
        "train",
        "--config",
        config(os.path.join(tmp_path, "c.json"), layout, timeout_s),
        "--nproc",
        str(nproc),
        "--out",
        os.path.join(tmp_path, "run"),
        "--no-progress",
        "--json",
    ]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(p.stderr), daemon=True)
    reader.start()
    stopped = []
    rc, after = None, None
    try:
        # Wait for the first step line: every rank is past start-up and inside the training loop.
        first = p.stdout.readline()
        if not first.startswith("{"):
            p.wait()
            reader.join(5)
            raise AssertionError(f"no step line (rc {p.returncode}):\n{''.join(stderr)[-3000:]}")
        ranks = _ranks(psutil.Process(p.pid))
        assert len(ranks) == nproc, ranks
        ranks[victim].send_signal(signal.SIGSTOP)
        stopped.append(ranks[victim])
        t0 = time.monotonic()
        threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()  # keep the pipe drained
        try:
            rc = p.wait(timeout=4 * timeout_s + 60)
            after = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            pass
    finally:
        for r in stopped:  # the launcher kills its ranks; make sure nothing stays stopped or alive
            try:
                r.send_signal(signal.SIGCONT)
                r.kill()
            except psutil.Error:
                pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        reader.join(5)
    return {"rc": rc, "stderr": "".join(stderr), "after_stop_s": after}


@pytest.mark.dist
# One victim per layout: which pipeline rank is stopped changes only who waits on whom, not which group's
# timeout ends the wait (`python tests/probe_robustness.py` stops ranks 0 and 1 of pp2, 1 and 2 of ep2x2).
@pytest.mark.parametrize("layout, victim", [("pp2", 1), ("ep2x2", 1)])
def test_stopped_peer_fails_within_configured_timeout(tmp_path, layout, victim):
    r = stop_a_rank(str(tmp_path), layout, victim)
    err = r["stderr"]
    assert r["rc"] is not None, (
        f"still running {4 * TIMEOUT_S + 60}s after SIGSTOP of rank {victim} "
        f"(parallel.p2p_timeout_s = {TIMEOUT_S}):\n{err[-3000:]}"
    )
    assert r["rc"] != 0, err[-3000:]
    assert f"p2p_timeout_s = {TIMEOUT_S}s" in err, err[-3000:]
    assert "peer dead or stuck" in err or "peer dead, or silent" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]  # an environment failure, reported in one message
