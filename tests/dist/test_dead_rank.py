"""A rank killed with SIGKILL (issue 27, point 2): the other ranks end within `parallel.p2p_timeout_s` plus the roll
call, the message names the dead rank (not a survivor's broken connection), and no process of the job is left
(checked here explicitly, and after every test in tests/dist by conftest's fixture).

- `spawn` of 3 ranks doing all-reduces, one of which SIGKILLs itself: the parent says "rank R was killed by
  SIGKILL (signal 9)"; each survivor's `PeerError` names rank R after the roll call (rank 0 killed: the store it
  served is gone with it, and the survivors say so); a lower layer's own `PeerError` (a pipeline receive's) gets
  the same answer; nothing of the call is left when it returns or raises (no rank, forkserver or resource
  tracker).
- `dsv3 train --nproc 2`, its rank 1 killed from outside with kill -9: exit 1 with that message, within the bound.
- `dsv3 train` under torchrun, rank 1 killed: the surviving rank's one `error:` line names rank 1.

The time bounds are bounds on a hang (`P2P_S` + the roll call + 60 s for start-up and teardown on a loaded
machine), not speed figures: without a peer timeout the survivors would wait 30 minutes per operation.
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
from helpers import subprocess_env
from process_leftovers import describe, live_new, snapshot, wait_gone

from dsv3_plugin.parallel.distributed import ROLL_CALL_S, free_port, spawn

P2P_S = 20
BOUND_S = P2P_S + ROLL_CALL_S + 60


def _all_reduce_until(victim: int, out_dir: str, kill_at: int = 20):
    """All-reduces in a loop; rank `victim` SIGKILLs itself at iteration `kill_at`. A survivor writes its
    `PeerError` to out_dir/rank{r}.txt and fails with it."""
    import torch
    import torch.distributed as dist

    from dsv3_plugin.errors import PeerError
    from dsv3_plugin.parallel.distributed import init_distributed, peer_failures, set_peer_timeout

    me, _ = init_distributed()
    set_peer_timeout(P2P_S)
    t = torch.ones(8)
    for i in range(kill_at if victim < 0 else 10**9):
        if i == kill_at and me == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            with peer_failures(f"all-reduce {i}", P2P_S):
                dist.all_reduce(t)
        except PeerError as e:
            with open(os.path.join(out_dir, f"rank{me}.txt"), "w") as f:
                f.write(str(e))
            raise
    return me


@pytest.mark.own_forkserver  # nothing of the call is left: its forkserver and resource tracker included
@pytest.mark.parametrize("victim", [1, 0])
def test_spawn_names_the_killed_rank(tmp_path, victim):
    before = snapshot()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        spawn(_all_reduce_until, 3, victim, str(tmp_path), timeout_s=BOUND_S)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert f"rank {victim} was killed by SIGKILL (signal 9)" in msg.splitlines()[1], msg
    assert took < BOUND_S, f"{took:.0f}s"
    survivors = [r for r in range(3) if r != victim]
    for r in survivors:
        said = (tmp_path / f"rank{r}.txt").read_text()
        assert said.startswith(f"global rank {r}: all-reduce "), said
        # rank 1 on this host: found gone at once by its pid; rank 0: the job's store went with it
        want = "rank 1 is gone (process " if victim == 1 else "rank 0 is gone (it served the job's store at "
        assert want in said, said
    left = live_new(before)
    assert not left, describe(left)


def _receive_from_rank_1(out_dir: str):
    """Rank 1 SIGKILLs itself; rank 0's receive from it fails in a lower layer that raises its own `PeerError`
    (as the pipeline's p2p waits do), inside `peer_failures`, which adds the roll call's answer."""
    import torch
    import torch.distributed as dist

    from dsv3_plugin.errors import PeerError
    from dsv3_plugin.parallel.distributed import init_distributed, peer_failures, set_peer_timeout

    me, _ = init_distributed()
    set_peer_timeout(P2P_S)
    if me == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with peer_failures("training step 1", P2P_S):
            try:
                dist.recv(torch.empty(4), src=1)
            except RuntimeError as e:
                raise PeerError(f"pipeline rank 0: waiting for a message from pipeline rank 1 failed: {e}") from e
    except PeerError as e:
        with open(os.path.join(out_dir, "rank0.txt"), "w") as f:
            f.write(str(e))
        raise


def test_lower_layers_peer_error_gets_the_dead_rank(tmp_path):
    with pytest.raises(RuntimeError, match=r"rank 1 was killed by SIGKILL \(signal 9\)"):
        spawn(_receive_from_rank_1, 2, str(tmp_path), timeout_s=BOUND_S)
    said = (tmp_path / "rank0.txt").read_text()
    assert said.startswith("pipeline rank 0: waiting for a message from pipeline rank 1 failed: "), said
    assert "; rank 1 is gone (process " in said, said


@pytest.mark.own_forkserver  # what the call itself starts: its forkserver and resource tracker
def test_spawn_leaves_no_process_when_it_returns():
    before = snapshot()
    assert spawn(_all_reduce_until, 2, -1, "", timeout_s=BOUND_S) == [0, 1]
    left = live_new(before)
    assert not left, describe(left)  # no forkserver, no resource tracker


def _config(tmp_path) -> str:
    """The tiny preset on 2 data-parallel ranks, running until it is killed."""
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "dsv3": {
            "preset": "tiny",
            "parallel": {"p2p_timeout_s": P2P_S},
            "train": {"seq_len": 16, "steps": 100000, "seed": 3, "save_every": 0},
        },
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(ds))
    return str(path)


def _kill_after_first_step(cmd, find_victim):
    """Start `cmd`, wait for its first JSON step line, SIGKILL the process `find_victim(launcher)` returns, wait
    for the job to end. Returns (exit code, stderr, seconds from the kill to the end, the job's processes at
    the kill)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    try:
        line = p.stdout.readline()
        while line and not line.startswith('{"step"'):  # torchrun logs to stdout too
            line = p.stdout.readline()
        assert line, f"no step line (exit {p.wait()}):\n{''.join(err)[-3000:]}"
        threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()  # keep the pipe drained
        launcher = psutil.Process(p.pid)
        job = [launcher, *launcher.children(recursive=True)]
        victim = find_victim(launcher)
        victim.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        rc = p.wait(timeout=BOUND_S)
        return rc, (reader.join(10), "".join(err))[1], time.monotonic() - t0, job
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _gone(job: list[psutil.Process]) -> None:
    """Every process of the job has ended (a short grace for the ones the launcher is still tearing down)."""
    _, alive = psutil.wait_procs(job, timeout=10)
    alive = [q for q in alive if q.status() != psutil.STATUS_ZOMBIE]
    assert not alive, describe(alive)


def test_cli_rank_killed_from_outside(tmp_path):
    def rank1(launcher):
        # the ranks are forks of multiprocessing's forkserver, a child of the launcher; forked in rank order
        servers = [c for c in launcher.children() if any("forkserver" in a for a in c.cmdline())]
        ranks = sorted((r for s in servers for r in s.children()), key=lambda q: q.pid)
        assert len(ranks) == 2, ranks
        return ranks[1]

    cmd = [
        sys.executable,
        "-m",
        "dsv3_plugin",
        "train",
        "--config",
        _config(tmp_path),
        "--nproc",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
        "--json",
    ]
    rc, err, took, job = _kill_after_first_step(cmd, rank1)
    assert rc == 1, err[-3000:]
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert "rank 1 was killed by SIGKILL (signal 9)" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < BOUND_S, f"{took:.0f}s"
    _gone(job)


@pytest.mark.long  # (make test-long)
def test_torchrun_survivor_names_the_killed_rank(tmp_path):
    def rank1(launcher):
        for c in launcher.children():  # torchrun's workers are its children, each with RANK in its environment
            if c.environ().get("RANK") == "1":
                return c
        raise AssertionError("rank 1 not found among torchrun's children")

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "dsv3_plugin",
        "train",
        "--config",
        _config(tmp_path),
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
        "--json",
    ]
    rc, err, took, job = _kill_after_first_step(cmd, rank1)
    assert rc != 0, err[-3000:]
    ours = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(ours) == 1 and "global rank 0: training step " in ours[0], err[-3000:]
    assert "rank 1 is gone (process " in ours[0], err[-3000:]
    assert took < BOUND_S, f"{took:.0f}s"
    _gone(job)


def test_fixture_sees_a_process_left_running():
    """What conftest's fixture relies on: a new descendant still running is listed, with its command line."""
    before = snapshot()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = wait_gone(before, 0.5)
        assert [q.pid for q in left] == [p.pid]
        assert "time.sleep(60)" in describe(left)
    finally:
        p.kill()
        p.wait()
    assert wait_gone(before, 5) == []
