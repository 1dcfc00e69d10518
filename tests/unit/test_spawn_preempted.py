"""`spawn` and a run stopped on request (issue 27, point 1 with the self-spawning launcher): a rank that raises
`Preempted` exits with its exit code, and `spawn` raises `Preempted` once (rank 0's message), after every rank
has exited; it is not a failure, but a real failure on another rank wins over it. With `forward_signals`, the
spawning process outlives a SIGTERM (to itself only, or to its whole process group: then the forkserver must
survive it too, or every rank's exit status is lost) and passes it on to the ranks; a second one kills the
ranks and exits 128 + the signal at once.

The signal cases run `spawn` in a child process (`_parent`, started with a session of its own so that the test
can signal its process group); the ranks wait for a signal and then raise `Preempted` as the training loop does.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from dsv3_plugin.errors import Preempted
from dsv3_plugin.parallel.distributed import spawn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _stop(kill_rank: int = -1):
    """Every rank stops on request, except `kill_rank`, which dies by SIGKILL after the others reported."""
    r = int(os.environ["RANK"])
    if r == kill_rank:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    raise Preempted(f"rank {r}: stopped after step 3 (SIGTERM received)", 143)


def test_preempted_ranks_raise_preempted_once_with_rank_0s_message():
    with pytest.raises(Preempted) as info:
        spawn(_stop, 3, timeout_s=120)
    assert str(info.value) == "rank 0: stopped after step 3 (SIGTERM received)"
    assert info.value.exit_code == 143


def test_a_rank_killed_meanwhile_wins_over_preempted():
    with pytest.raises(RuntimeError, match=r"rank 1 was killed by SIGKILL \(signal 9\)"):
        spawn(_stop, 2, 1, timeout_s=120)


def _interrupted():
    raise KeyboardInterrupt


def test_ranks_interrupted_before_they_handle_sigint_raise_keyboardinterrupt():
    """A Ctrl-C that reaches the ranks before they handle SIGINT (start-up) is an interruption, as in the
    spawning process itself (the CLI's "dsv3: interrupted", exit 130), not a bug with a traceback."""
    with pytest.raises(KeyboardInterrupt):
        spawn(_interrupted, 2, timeout_s=120)


def _wait_for_signal(ready_dir: str, save_s: float, die_rank: int):
    """A rank: handle SIGTERM / SIGINT / SIGUSR1 (first one only, like `training.preemption`), say it is ready,
    wait for a signal, "save" for `save_s`, raise Preempted with the signal's status; rank `die_rank` is killed
    by SIGKILL during its save instead."""
    got = []
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, lambda signum, frame: got.append(signum))
    r = int(os.environ["RANK"])
    with open(os.path.join(ready_dir, f"rank{r}"), "w") as f:
        f.write(str(os.getpid()))
    while not got:
        time.sleep(0.01)
    time.sleep(save_s)
    if r == die_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    name = signal.Signals(got[0]).name
    raise Preempted(f"rank {r}: stopped ({name} received, {len(got)} delivered)", 128 + got[0])


def _parent(ready_dir: str, save_s: float, die_rank: int) -> int:
    """The spawning process of the signal tests (what `dsv3 train` does with what `spawn` raises)."""
    try:
        spawn(
            _wait_for_signal,
            2,
            ready_dir,
            save_s,
            die_rank,
            timeout_s=300,
            forward_signals=(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1),
            repeat_window_s=2.0,
        )
    except Preempted as e:
        print(e, file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _start(tmp_path, save_s: float, die_rank: int = -1):
    """Start `_parent` in a session of its own; returns it once both ranks handle signals, and the ranks' pids."""
    code = f"import sys; sys.path[:0] = [{HERE!r}, {ROOT!r}]; import test_spawn_preempted as t; "
    code += f"sys.exit(t._parent({str(tmp_path)!r}, {save_s!r}, {die_rank}))"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    p = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.iterdir())) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(0.2)  # the files are written: let them be complete
    return p, [int((tmp_path / f"rank{r}").read_text()) for r in range(2)]


def _end(p) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, err


def _all_gone(pids: list[int]) -> None:
    _, alive = psutil.wait_procs([psutil.Process(q) for q in pids if psutil.pid_exists(q)], timeout=10)
    assert not [q for q in alive if q.status() != psutil.STATUS_ZOMBIE], alive


@pytest.mark.parametrize("whom", ["parent", "group"])
def test_sigterm_reaches_the_ranks_and_the_parent_waits(tmp_path, whom):
    """SIGTERM to the spawning process only (the parent forwards it) or to its whole process group (each rank gets
    it directly and forwarded: one request, within the repeat window): every rank "saves" for 1 s and stops;
    the parent exits 143 with rank 0's message."""
    p, ranks = _start(tmp_path, save_s=1.0)
    if whom == "parent":
        os.kill(p.pid, signal.SIGTERM)
    else:
        os.killpg(p.pid, signal.SIGTERM)
    rc, err = _end(p)
    assert rc == 143, err[-3000:]
    assert "rank 0: stopped (SIGTERM received, " in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    _all_gone(ranks)


def test_second_sigterm_kills_the_ranks_and_exits_at_once(tmp_path):
    """The ranks "save" for 10 minutes; a second SIGTERM, after the repeat window, ends everything at once."""
    p, ranks = _start(tmp_path, save_s=600.0)
    os.kill(p.pid, signal.SIGTERM)
    time.sleep(3.0)  # past the 2 s repeat window
    assert p.poll() is None
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGTERM)
    rc, err = _end(p)
    assert rc == 143, err[-3000:]
    assert time.monotonic() - t0 < 30, "not at once"
    _all_gone(ranks)


def test_rank_killed_during_the_save_after_a_group_sigterm_is_named(tmp_path):
    """SIGTERM to the whole process group, then rank 1 dies by SIGKILL while it saves: the parent still learns
    how it died, from the forkserver, which the group's SIGTERM must not have killed (a dead forkserver reports
    exit 255 for every rank)."""
    p, ranks = _start(tmp_path, save_s=1.0, die_rank=1)
    os.killpg(p.pid, signal.SIGTERM)
    rc, err = _end(p)
    assert rc == 1, err[-3000:]
    assert "rank 1 was killed by SIGKILL (signal 9)" in err, err[-3000:]
    _all_gone(ranks)
