"""Every multi-process test leaves no process behind (issue 27, point 2): after each test in tests/dist, the
processes it started — ranks, forkservers, resource trackers, launchers and their workers, also those in a
session or process group of their own — must be gone within `GRACE_S`; the test fails (an error at teardown)
listing the pids and command lines of those still running, which are then killed so that the next test starts
clean. See `process_leftovers` for how "started by the test" is told apart from pytest's own processes."""

import pytest
from process_leftovers import describe, kill, snapshot, subreaper, wait_gone

# Time for a launcher to finish tearing down after the test's own wait returned: torchrun's agent stops its
# workers with SIGTERM and waits for them; a forkserver ends when its client closes the pipe. A clean exit takes
# well under a second; this is the bound on a loaded machine, not a target.
GRACE_S = 10.0


@pytest.fixture(autouse=True)
def no_process_left_behind(shared_rank_server):
    # (the forkserver the tests share, `shared_rank_server`, runs before the snapshot: only what the test started
    # counts)
    with subreaper():
        before = snapshot()
        yield
        left = wait_gone(before, GRACE_S)
        if left:
            listing = describe(left)
            kill(left, before)
            pytest.fail(f"{len(left)} process(es) the test started still run {GRACE_S:g}s after it:\n{listing}")
