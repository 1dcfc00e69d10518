"""`dsv3 train` (2 gloo ranks) when the disk fills during a save: exit 2 with one `error:` line naming the checkpoint
directory and the bytes, the previous checkpoint intact and still named by `latest`, no partial tag left, and
`--resume` (with space back) continues bit-exactly (every metric but wall-clock speed equals an uninterrupted run's).

Two ways the disk fills:
- a write fails midway: a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored, so writes fail with EFBIG, which torch's
  zip writer reports as "unexpected pos ...") below the size of the checkpoint's files, set for the resumed run
  that writes the second checkpoint;
- too little space left for the next checkpoint: a small tmpfs in a user namespace (skipped with the reason where
  mounting is not allowed), refused before anything is written.
"""

import copy
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import dsv3_cli, subprocess_env

WALL_CLOCK = {"tokens_per_s"}
STEPS = 6

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 6}},
    "dsv3": {
        "preset": "tiny",
        "moe": {"bias_update_speed": 0.01},
        "memory": {"ema": True, "ema_decay": 0.9},
        "train": {"seq_len": 16, "seed": 11, "save_every": 2},
    },
}


def _train(cfg, out, *extra, preexec=None, prefix=()):
    if preexec is None and not prefix:  # a limit on the process itself needs a process of its own
        return dsv3_cli("train", "--config", cfg, "--out", out, "--no-progress", *extra)
    cmd = [*prefix, sys.executable, "-m", "dsv3_plugin", "train", "--config", cfg, "--out", out, "--no-progress"]
    return subprocess.run(
        [*cmd, *extra], capture_output=True, text=True, env=subprocess_env(), timeout=900, preexec_fn=preexec
    )


def _rows(path):
    with open(path) as f:
        return [{k: v for k, v in json.loads(x).items() if k not in WALL_CLOCK} for x in f]


def _one_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, p.stderr[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])
    assert "Traceback" not in p.stderr + p.stdout
    return errors[0]


def _tag_files(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _latest(ckpt):
    with open(os.path.join(ckpt, "latest")) as f:
        return f.read().strip()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The config, an uninterrupted run of STEPS steps (its metrics), and the size of its first checkpoint."""
    tmp = tmp_path_factory.mktemp("diskfull")
    cfg = str(tmp / "c.json")
    with open(cfg, "w") as f:
        json.dump(copy.deepcopy(DS), f)
    straight = str(tmp / "straight")
    p = _train(cfg, straight, "--steps", str(STEPS))
    assert p.returncode == 0, p.stderr[-3000:]
    with open(f"{straight}/ckpt/step2/dsv3_complete.json") as f:
        files = json.load(f)["files"]
    return tmp, cfg, _rows(f"{straight}/metrics.jsonl"), files


def _check_resumes_bit_exactly(cfg, d, want):
    p = _train(cfg, d, "--resume", d, "--steps", str(STEPS))
    assert p.returncode == 0, p.stderr[-3000:]
    got = _rows(f"{d}/metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g == w, f"step {w['step']} differs in {sorted(k for k in w if g.get(k) != w.get(k))}"


def _file_size_limit(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint(base):
    tmp, cfg, want, files = base
    d = str(tmp / "efbig")
    ckpt = f"{d}/ckpt"
    p = _train(cfg, d, "--steps", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    before = _tag_files(f"{ckpt}/step2")
    limit = max(files.values()) // 2  # every rank's optimizer partition is larger: each rank's save fails
    p = _train(cfg, d, "--resume", d, "--steps", str(STEPS), preexec=_file_size_limit(limit))
    err = _one_error(p, f"saving checkpoint step4 into {ckpt} failed on rank ", "bytes")
    assert "the previous checkpoint step2 is intact and still the latest" in err, err
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("step")) == ["step2"]  # no partial step4
    assert _latest(ckpt) == "step2" and _tag_files(f"{ckpt}/step2") == before
    _check_resumes_bit_exactly(cfg, d, want)


_IN_TMPFS = """set -e
mount -t tmpfs -o size={size} tmpfs {mnt}
set +e
"$@" > {mnt_out}/stdout 2> {mnt_out}/stderr
echo $? > {mnt_out}/rc
cp -a {mnt}/run {copy}
"""


@pytest.mark.long  # (make test-long; tests/unit/test_run_dir_saves.py checks the refusal in make test)
def test_too_little_space_for_the_next_checkpoint_is_refused_before_writing(base):
    tmp, cfg, want, files = base
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) here: cannot mount a small tmpfs")
    mnt, copy_to, logs = str(tmp / "mnt"), str(tmp / "tmpfs_run"), str(tmp / "logs")
    os.makedirs(mnt), os.makedirs(logs)
    ckpt_bytes = sum(files.values())
    # room for the first checkpoint (and the run's small files), not for a second one next to it
    size = (ckpt_bytes * 3 // 2 // 4096 + 64) * 4096
    script = _IN_TMPFS.format(size=size, mnt=mnt, mnt_out=logs, copy=copy_to)
    cmd = [sys.executable, "-m", "dsv3_plugin", "train", "--config", cfg, "--out", f"{mnt}/run", "--no-progress"]
    p = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", script, "sh", *cmd, "--steps", str(STEPS)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=900,
    )
    if p.returncode != 0 and "mount" in p.stderr:
        pytest.skip(f"mounting a tmpfs is not allowed here ({p.stderr.strip()[:200]})")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(f"{logs}/rc") as f, open(f"{logs}/stderr") as e, open(f"{logs}/stdout") as o:
        run = subprocess.CompletedProcess([], int(f.read()), o.read(), e.read())
    ckpt = f"{mnt}/run/ckpt"
    err = _one_error(run, f"saving checkpoint step4 into {ckpt}: it needs about ", "(the size of step2), only ")
    assert "bytes are free there" in err and "nothing was written" in err, err
    assert "the previous checkpoint step2 is intact and still the latest" in err, err
    here = f"{copy_to}/ckpt"
    assert sorted(n for n in os.listdir(here) if n.startswith("step")) == ["step2"]
    assert _latest(here) == "step2"
    _check_resumes_bit_exactly(cfg, copy_to, want)
