"""Preemption: stop a run on request at a step boundary, every rank at the same step, after a complete save.

Exit statuses: 128 + the signal number (SIGTERM 143, SIGINT 130, SIGUSR1 138), like a process killed by it, so
job scripts can tell a preempted run from a finished one (0) and from bad input (2); the budget stop exits 0
(Megatron-LM's `--exit-duration-in-mins` does the same) with a line saying how to continue.

Design notes: docs/design_notes.md#training-preemption
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

__all__ = ["SIGNALS", "REPEAT_WINDOW_S", "StopRequests", "exit_status", "process_age_s"]

# The signals a run treats as "save and stop". SIGHUP and SIGQUIT keep their default actions (a closed terminal,
# a core dump request): stopping on them would surprise more than it helps.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# A repeat of the first signal within this many seconds is the same request delivered twice (scheduler to every
# process + launcher forwarding); later, or a different signal, it is the "abort now" of an impatient operator.
REPEAT_WINDOW_S = 2.0


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by signal `signum`: 128 + signum (0 for the budget, signum 0)."""
    return 128 + signum if signum else 0


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time; elsewhere: since import)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of proc(5), counted after the command name's ')'
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


class StopRequests:
    """This rank's stop requests and the world's agreement on them (see the module docstring).

    Args:
        exit_after_minutes: the wall-clock budget of the process in minutes (None: none).
        device: where the agreement's small tensor lives (the backend's device: CUDA under NCCL; None: CPU).
    """

    def __init__(self, exit_after_minutes: float | None = None, device=None):
        self.budget_s = None if exit_after_minutes is None else float(exit_after_minutes) * 60.0
        self.device = device
        self.signum = 0  # the first signal received (0: none)
        self.first_at = 0.0
        self.saving = False  # set around the stop's own save: a second signal then aborts it
        self.longest_step_s = 0.0
        self.longest_save_s = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        """Handle SIGNALS on this rank (main thread only; elsewhere a no-op: Python delivers signals there)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        """Restore the handlers `install` replaced."""
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self.first_at = signum, now
            return
        if signum == self.signum and now - self.first_at < REPEAT_WINDOW_S:
            return  # the same request delivered twice
        # An operator insisting: abort now, without saving. os._exit: no interpreter teardown (a collective or a
        # half-written file would block it); the checkpoint being written is never marked complete.
        name = signal.Signals(signum).name
        what = "during the checkpoint save" if self.saving else "before the stop's save"
        print(
            f"dsv3 train: second signal ({name}) {what}: aborting without saving; the previous complete "
            "checkpoint is untouched and still the latest",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + signum)

    def note_step(self, step_s: float) -> None:
        self.longest_step_s = max(self.longest_step_s, step_s)

    def note_save(self, save_s: float) -> None:
        self.longest_save_s = max(self.longest_save_s, save_s)

    def _over_budget(self) -> bool:
        if self.budget_s is None:
            return False
        return process_age_s() + self.longest_step_s + self.longest_save_s >= self.budget_s

    def agree(self) -> int:
        """Collective (one all-reduce over the world, every rank at every step boundary): -1 to go on, else the
        stop's signal number (0: the wall-clock budget). The highest signal number wins when ranks got
        different ones (SIGTERM over SIGUSR1 over SIGINT)."""
        flags_2 = torch.tensor([self.signum, int(self._over_budget())], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if self.device is not None:
                flags_2 = flags_2.to(self.device)
            dist.all_reduce(flags_2, op=dist.ReduceOp.MAX)
            flags_2 = flags_2.cpu()
        signum, budget = int(flags_2[0]), bool(flags_2[1])
        if signum:
            if not self.signum:  # a peer was signalled: this rank stops for the same reason
                self.signum, self.first_at = signum, time.monotonic()
            return signum
        return 0 if budget else -1

    @staticmethod
    def reason(signum: int, budget_min: float | None) -> str:
        """What stopped the run, in words."""
        if signum:
            return f"{signal.Signals(signum).name} received"
        return f"dsv3.train.exit_after_minutes = {budget_min:g} would run out before another step and save"
