"""`training.preemption.StopRequests` (issue 27 point 1) in one process: the first signal is recorded (not acted
on inside the handler), the same signal repeated within REPEAT_WINDOW_S is the same request, a second different
signal aborts at once with 128 + its number and one line; `agree()` without a process group returns the signal,
-1 to go on, 0 when the wall-clock budget (longest step + longest save) would run out; statuses are 128 + signal."""

import os
import signal
import subprocess
import sys
import textwrap

from dsv3_plugin.training.preemption import REPEAT_WINDOW_S, StopRequests, exit_status, process_age_s


def test_exit_status():
    assert exit_status(signal.SIGTERM) == 143 and exit_status(signal.SIGINT) == 130
    assert exit_status(signal.SIGUSR1) == 138 and exit_status(0) == 0


def test_first_signal_is_recorded_and_agreed_alone():
    s = StopRequests().install()
    try:
        assert s.agree() == -1
        os.kill(os.getpid(), signal.SIGUSR1)  # delivered to the main thread before the next bytecode
        assert s.signum == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)  # the same request twice (launcher forwarding): no abort
        assert s.agree() == signal.SIGUSR1
        assert "SIGUSR1 received" in s.reason(s.agree(), None)
    finally:
        s.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_budget():
    s = StopRequests(exit_after_minutes=10**6)
    s.note_step(1.0)
    assert s.agree() == -1
    age = process_age_s()
    assert 0 < age < 10**5
    s = StopRequests(exit_after_minutes=(age + 3600) / 60)
    assert s.agree() == -1
    s.note_save(1800.0), s.note_step(1801.0)  # the next step and a save would end past the budget: stop now
    assert s.agree() == 0
    assert "exit_after_minutes" in s.reason(0, 1.5)


def _child(code: str):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_second_signal_aborts_with_its_status():
    # a different signal after the first: abort at once, 128 + its number, one line, nothing after it runs
    p = _child(
        """
        import os, signal
        from dsv3_plugin.training.preemption import StopRequests
        s = StopRequests().install()
        os.kill(os.getpid(), signal.SIGUSR1)
        s.saving = True
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
        """
    )
    assert p.returncode == 143 and "not reached" not in p.stdout, p
    assert "second signal (SIGTERM) during the checkpoint save: aborting without saving" in p.stderr


def test_same_signal_after_the_window_aborts():
    p = _child(
        f"""
        import os, signal, time
        from dsv3_plugin.training.preemption import StopRequests
        s = StopRequests().install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep({REPEAT_WINDOW_S} + 0.2)
        os.kill(os.getpid(), signal.SIGTERM)
        print("not reached")
        """
    )
    assert p.returncode == 143 and "not reached" not in p.stdout, p
    assert "second signal (SIGTERM) before the stop's save" in p.stderr
