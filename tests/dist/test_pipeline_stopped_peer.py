"""A stopped pipeline peer ends `dsv3 train` within `parallel.p2p_timeout_s`, with a message naming the limit.

`dsv3 train --nproc 2` with pp = 2 runs until its first step line is printed; then one rank is SIGSTOPped
(alive but silent: the case a dead connection does not reveal). The other rank's next wait on it (a pipeline
receive, or a collective of the pipeline or world group, all created with the configured timeout) must fail,
and the job must exit non-zero. The bound checked is a bound on a hang, not a speed figure: 4 x the timeout
plus 60 s for the failure to propagate on a loaded machine, against a run that would otherwise go on for
hours (100 000 steps), or wait 300 s per operation as it did before the timeout was plumbed through.
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


def _config(path):
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "dsv3": {"preset": "tiny", "parallel": {"pp": 2, "schedule": "1f1b", "p2p_timeout_s": TIMEOUT_S},
                   "train": {"seq_len": 16, "steps": 100000, "seed": 3, "save_every": 0}}}
    with open(path, "w") as f:
        json.dump(ds, f)
    return str(path)


def _ranks(launcher: psutil.Process) -> list[psutil.Process]:
    """The spawned rank processes (multiprocessing's spawn children; not its resource tracker)."""
    out = []
    for c in launcher.children(recursive=True):
        try:
            if any("spawn_main" in a for a in c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return sorted(out, key=lambda p: p.pid)


@pytest.mark.dist
@pytest.mark.parametrize("victim", [0, 1])
def test_stopped_peer_fails_within_configured_timeout(tmp_path, victim):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "dsv3_plugin", "train", "--config", _config(tmp_path / "c.json"), "--nproc", "2",
           "--out", str(tmp_path / "run"), "--no-progress", "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(p.stderr), daemon=True).start()
    stopped = []
    try:
        # Wait for the first step line: both ranks are past start-up and inside the training loop.
        first = p.stdout.readline()
        assert first.startswith("{"), f"no step line (rc {p.poll()}):\n{''.join(stderr)[-3000:]}"
        ranks = _ranks(psutil.Process(p.pid))
        assert len(ranks) == 2, ranks
        ranks[victim].send_signal(signal.SIGSTOP)
        stopped.append(ranks[victim])
        t0 = time.monotonic()
        threading.Thread(target=lambda: p.stdout.read(), daemon=True).start()  # keep the pipe drained
        try:
            rc = p.wait(timeout=4 * TIMEOUT_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {time.monotonic() - t0:.0f}s after SIGSTOP of a rank "
                        f"(parallel.p2p_timeout_s = {TIMEOUT_S})")
        time.sleep(0.5)  # let the reader thread take the last lines
        err = "".join(stderr)
        assert rc != 0, err[-3000:]
        assert f"p2p_timeout_s = {TIMEOUT_S}s" in err, err[-3000:]
        assert "peer dead or stuck" in err or "peer dead, or silent" in err, err[-3000:]
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
