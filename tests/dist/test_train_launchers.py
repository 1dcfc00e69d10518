"""`dsv3 train` under the launchers users already have, on 2 CPU ranks (gloo): the real `deepspeed` launcher,
which inserts `--local_rank=N` before the sub-command (`deepspeed --num_gpus 2 $(which dsv3) train ...`, as
README shows), and `torchrun` running the same `dsv3` script; a run started under one resumes under the other.
Bad input found by both ranks is reported once, exit code 2 through the deepspeed launcher."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from dsv3_plugin.parallel.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
DSV3, DEEPSPEED = shutil.which("dsv3", path=BIN), shutil.which("deepspeed", path=BIN)
pytestmark = pytest.mark.skipif(
    DSV3 is None or DEEPSPEED is None, reason="needs the installed `dsv3` and `deepspeed` scripts (make venv)"
)
DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {"preset": "tiny", "train": {"seq_len": 16, "seed": 5}},
}


def _env():
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def _launch(kind, *train_args):
    if kind == "deepspeed":
        cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), DSV3, "train", *train_args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            DSV3,
            "train",
            *train_args,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=900)


def _json_lines(stdout):
    return [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]  # the launcher logs to stdout too


def test_deepspeed_launcher_then_torchrun_resume(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(DS))
    out = str(tmp_path / "run")
    p = _launch("deepspeed", "--config", str(cfg), "--steps", "2", "--out", out, "--json", "--no-progress")
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    rows = _json_lines(p.stdout)
    assert [r["step"] for r in rows[:-1]] == [1, 2]
    assert rows[-1]["summary"]["line"].startswith("dsv3 train: steps 1-2 on 2 rank(s)")
    assert os.path.isfile(os.path.join(out, "ckpt", "step2", "dsv3_complete.json"))

    t = _launch(
        "torchrun", "--config", str(cfg), "--steps", "3", "--out", out, "--resume", out, "--json", "--no-progress"
    )
    assert t.returncode == 0, (t.stdout + t.stderr)[-4000:]
    more = _json_lines(t.stdout)
    assert [r["step"] for r in more[:-1]] == [3] and more[0]["tokens_seen"] == 3 * 2 * 2 * 16
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2, 3]


@pytest.mark.parametrize("kind", ["deepspeed", "torchrun"])
def test_launched_ranks_report_bad_input_once(tmp_path, kind):
    """Both ranks load the truncated shard; the first to fail reports it, the other exits quietly. The deepspeed
    launcher passes the rank's exit code 2 through; torchrun exits 1 after printing its own failure report
    (a traceback of torchrun's, not of ours)."""
    from helpers import make_truncated_checkpoint

    ck, shard = make_truncated_checkpoint(str(tmp_path / "hf"))
    p = _launch(kind, "--init-from", ck, "--out", str(tmp_path / "o"), "--steps", "1", "--no-progress")
    out = p.stdout + p.stderr
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and f"{shard}: data ends at byte" in errors[0], out[-4000:]
    assert os.path.join(ROOT, "dsv3_plugin") not in out and "TCPStore" not in out, out[-4000:]
    if kind == "deepspeed":
        assert p.returncode == 2 and "Traceback" not in out, out[-4000:]
    else:
        assert p.returncode == 1 and "ChildFailedError" in out
