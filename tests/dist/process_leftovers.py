"""What a multi-process test left running (issue 27, point 2: no process of a job outlives it — no orphaned rank,
forkserver or resource tracker): the test process's descendants that were not there before the test.

A launcher's workers orphaned when the launcher ends (torchrun, the deepspeed launcher, `dsv3 train`'s
forkserver) would be re-parented to init and drop out of the tree; `subreaper()` makes the test process their
new parent instead (Linux: PR_SET_CHILD_SUBREAPER), so everything a test started, in whatever session or
process group, stays its descendant. Processes that existed before the test (pytest-xdist workers, a module
fixture's server) are in the snapshot and never count.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def snapshot() -> set[tuple[int, float]]:
    """(pid, start time) of every descendant of this process: a pid reused later is a different process."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            out.add((p.pid, p.create_time()))
    return out


def live_new(before: set[tuple[int, float]]) -> list[psutil.Process]:
    """Descendants not in `before` that still run (zombies, ended but not yet collected, do not count)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (p.pid, p.create_time()) not in before and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def reap(before: set[tuple[int, float]]) -> None:
    """Collect the exit status of new zombie children: orphans re-parented to this process by `subreaper`, whose
    status nobody else will ask for."""
    for p in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ChildProcessError):
            if (p.pid, p.create_time()) not in before and p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)


def describe(procs: list[psutil.Process]) -> str:
    lines = []
    for p in procs:
        try:
            lines.append(f"pid {p.pid} (parent {p.ppid()}): {' '.join(p.cmdline())[:300]}")
        except psutil.Error:
            lines.append(f"pid {p.pid}: (ended while listed)")
    return "\n".join(lines)


def wait_gone(before: set[tuple[int, float]], grace_s: float) -> list[psutil.Process]:
    """New live descendants still there after up to `grace_s` (a launcher tearing down its workers)."""
    deadline = time.monotonic() + grace_s
    while True:
        reap(before)
        left = live_new(before)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def kill(procs: list[psutil.Process], before: set[tuple[int, float]]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=10)
    reap(before)


@contextlib.contextmanager
def subreaper():
    """Inside the block, orphaned descendants are re-parented to this process (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        on = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        on = False
    try:
        yield on
    finally:
        if on:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
