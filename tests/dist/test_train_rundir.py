"""`dsv3 train` and its run directory on 2 gloo ranks: a resumed run's metrics equal the uninterrupted run's in
every key but wall-clock speed (running routing totals included); resume survives the debris of a crash (torn
last metrics line, empty `latest`, `latest` naming a missing or incomplete tag) or refuses with exit 2; a
checkpoint of another config, or of another number of ranks, is refused; two runs into one --out cannot mix."""

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WALL_CLOCK = {"tokens_per_s"}  # the only metric that depends on the machine's speed

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
        "train": {"seq_len": 16, "seed": 7, "save_every": 2},
    },
}


def _first_leg(tmp):
    from dsv3_plugin.deepspeed.train import train

    train(copy.deepcopy(DS), steps=10, out=f"{tmp}/straight", progress=False)
    train(copy.deepcopy(DS), steps=5, out=f"{tmp}/half", progress=False)  # tags step2, step4, step5


def _resume_all(dirs):
    from dsv3_plugin.deepspeed.train import train

    return {d: train(copy.deepcopy(DS), steps=10, out=d, resume=d, progress=False)["notes"] for d in dirs}


def _damage(tmp):
    """Copies of the 5-step run, each with one kind of crash debris."""
    cases = {
        "clean": lambda d: None,
        "torn": lambda d: open(f"{d}/metrics.jsonl", "a").write('{"step": 6, "loss": 3.1'),
        "empty_latest": lambda d: open(f"{d}/ckpt/latest", "w").close(),
        "missing_tag": lambda d: open(f"{d}/ckpt/latest", "w").write("step6"),
        "incomplete_tag": lambda d: os.remove(f"{d}/ckpt/step5/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    }
    dirs = {}
    for name, damage in cases.items():
        d = f"{tmp}/{name}"
        shutil.copytree(f"{tmp}/half", d)
        damage(d)
        dirs[name] = d
    return dirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("rundir"))
    run_ranks(_first_leg, 2, tmp)
    dirs = _damage(tmp)
    notes = run_ranks(_resume_all, 2, list(dirs.values()))[0]  # fresh processes
    return tmp, dirs, {name: notes[d] for name, d in dirs.items()}


def _rows(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def _strip(row):
    return {k: v for k, v in row.items() if k not in WALL_CLOCK}


@pytest.mark.parametrize("case", ["clean", "torn", "empty_latest", "missing_tag", "incomplete_tag"])
def test_resumed_metrics_equal_the_uninterrupted_run(runs, case):
    tmp, dirs, notes = runs
    want = _rows(f"{tmp}/straight/metrics.jsonl")
    got = _rows(f"{dirs[case]}/metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 11))
    keys = set(want[0]) - WALL_CLOCK
    assert {"maxvio_global", "moe_layers", "maxvio_batch", "lr", "gamma", "tokens_seen"} <= keys
    for g, w in zip(got, want):
        assert _strip(g) == _strip(w), f"{case}: step {w['step']} differs in " + str(
            sorted(k for k in keys if g.get(k) != w.get(k))
        )


def test_resume_says_what_it_repaired(runs):
    _, _, notes = runs
    assert notes["clean"] == []
    assert len(notes["torn"]) == 1 and "dropped a torn last line" in notes["torn"][0]
    assert "'latest' is empty; resuming from step5" in notes["empty_latest"][0]
    assert "'latest' names tag 'step6', which does not exist; resuming from step5" in notes["missing_tag"][0]
    assert (
        "'latest' names tag 'step5', which is incomplete (zero_pp_rank_1_mp_rank_00_optim_states.pt is "
        "missing); resuming from step4"
    ) in notes["incomplete_tag"][0]


def _env():
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def _write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)
    return str(path)


def _one_error(p, needle):
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout


def _dsv3(*args):
    from helpers import dsv3_cli

    return dsv3_cli(*args, env=_env())


def test_resume_refuses_without_a_complete_checkpoint(runs, tmp_path):
    tmp, _, _ = runs
    d = str(tmp_path / "broken")
    shutil.copytree(f"{tmp}/half", d)
    for t in ("step2", "step4", "step5"):
        os.remove(f"{d}/ckpt/{t}/dsv3_complete.json")
    p = _dsv3("train", "--config", _write(tmp_path / "c.json", DS), "--out", d, "--resume", d, "--steps", "10")
    _one_error(p, "no complete checkpoint to resume from ('latest' names tag 'step5', which is incomplete")
    assert "start a new run" in p.stderr


def test_resume_refuses_a_checkpoint_of_another_config(runs, tmp_path):
    tmp, _, _ = runs
    other = copy.deepcopy(DS)
    other["dsv3"]["model"] = {"hidden_size": 96}
    p = _dsv3(
        "train",
        "--config",
        _write(tmp_path / "c.json", other),
        "--out",
        str(tmp_path / "o"),
        "--resume",
        f"{tmp}/half",
        "--steps",
        "10",
    )
    _one_error(
        p,
        "this checkpoint belongs to another run's config (dsv3.model.hidden_size: 64 in the "
        "checkpoint's run, 96 in this config)",
    )
    # training knobs may change: a different γ resumes (pre-check passes; the run itself is not started here)
    from dsv3_plugin.deepspeed.train import TrainRequest, prepare_run
    from dsv3_plugin.training.checkpoint_tags import resume_source

    knob = copy.deepcopy(DS)
    knob["dsv3"]["moe"]["bias_update_speed"] = 0.001
    knob_cfg = prepare_run(TrainRequest(config=knob, steps=10), None, open_files=False)[0].cfg
    assert resume_source(f"{tmp}/half", knob_cfg)[1] == "step5"


def test_resume_refuses_another_number_of_ranks(runs, tmp_path):
    tmp, _, _ = runs
    d = str(tmp_path / "fewer")
    shutil.copytree(f"{tmp}/half", d)
    p = _dsv3(
        "train", "--config", _write(tmp_path / "c.json", DS), "--nproc", "1", "--out", d, "--resume", d, "--steps", "10"
    )
    _one_error(p, f"--resume {d}: step5 was saved by 2 rank(s), this run has 1")


def test_fresh_run_refuses_an_out_holding_a_previous_run(runs, tmp_path):
    tmp, _, _ = runs
    d = str(tmp_path / "again")
    shutil.copytree(f"{tmp}/half", d)
    p = _dsv3("train", "--config", _write(tmp_path / "c.json", DS), "--out", d, "--steps", "2")
    _one_error(p, f"--out {d}: holds a previous run (metrics.jsonl with 5 line(s), checkpoints step2, step4, step5)")
    assert "--resume" in p.stderr and "--overwrite" in p.stderr
    assert os.path.isfile(f"{d}/ckpt/step5/dsv3_complete.json")  # nothing was touched


def test_second_run_into_the_same_out_fails_at_once(tmp_path):
    out = str(tmp_path / "shared")
    cfg = _write(tmp_path / "c.json", {**DS, "dsv3": {**DS["dsv3"], "train": {"seq_len": 16, "seed": 7}}})
    first = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv3_plugin",
            "train",
            "--config",
            cfg,
            "--out",
            out,
            "--steps",
            "100000",
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    lock = os.path.join(out, ".dsv3.lock")
    try:
        deadline = time.monotonic() + 300  # a wait for the first run to train, not a timing assertion
        holder = None
        while holder is None and time.monotonic() < deadline and first.poll() is None:
            try:
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    assert f.readline().endswith("\n")  # a first step is logged
                with open(lock) as f:
                    holder = json.load(f)["pid"]
            except (OSError, ValueError, KeyError, AssertionError):
                time.sleep(0.2)
        assert holder is not None, first.stderr.read()[-3000:] if first.poll() is not None else "not started"
        second = _dsv3("train", "--config", cfg, "--out", out, "--steps", "3", "--no-progress")
        _one_error(second, f"--out {out}: in use by another dsv3 train (pid {holder} ")
        resumed = _dsv3("train", "--config", cfg, "--out", out, "--resume", out, "--steps", "3", "--no-progress")
        _one_error(resumed, f"pid {holder}")
    finally:
        first.send_signal(signal.SIGKILL)  # kill -9 of the launching process: its ranks die with it
        first.wait()
    from dsv3_plugin.training.run_dir import RunLock

    deadline = time.monotonic() + 120
    while True:  # the lock goes with the killed holder (rank 0), with no clean-up by anyone
        try:
            RunLock(out).acquire().release()
            break
        except ValueError:
            assert time.monotonic() < deadline, "lock still held after the run was killed"
            time.sleep(0.2)
    with open(os.path.join(out, "metrics.jsonl")) as f:  # one run's lines only, in order
        steps = [json.loads(x)["step"] for x in f if x.endswith("\n")]
    assert steps and steps == list(range(1, len(steps) + 1))


class _Payload:
    """Unpickling this runs a shell command: what a crafted checkpoint file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_refuses_a_crafted_checkpoint_and_runs_nothing(runs, tmp_path):
    """Every DeepSpeed .pt file of the tag replaced by a pickle payload, and dsv3_complete.json updated to the new
    sizes (anyone can): --resume refuses with one line naming a file, exit 2, and the payload never ran."""
    import torch

    from dsv3_plugin.training.checkpoint_tags import file_checksum

    tmp, _, _ = runs
    d = str(tmp_path / "crafted")
    shutil.copytree(f"{tmp}/half", d)
    marker = tmp_path / "pwned"
    tag = f"{d}/ckpt/step5"
    with open(f"{tag}/dsv3_complete.json") as f:
        m = json.load(f)
    for rel in m["files"]:
        if rel.endswith(".pt") and not os.path.basename(rel).startswith("ema_"):
            torch.save({"module": {}, "x": _Payload(str(marker))}, f"{tag}/{rel}")
            m["files"][rel] = os.path.getsize(f"{tag}/{rel}")
            m["checksums"][rel] = file_checksum(f"{tag}/{rel}")  # the marker's checksums: anyone can recompute
    with open(f"{tag}/dsv3_complete.json", "w") as f:
        json.dump(m, f)
    p = _dsv3("train", "--config", _write(tmp_path / "c.json", DS), "--out", d, "--resume", d, "--steps", "10")
    _one_error(p, "refused to unpickle")
    assert ".pt: refused to unpickle" in p.stderr and "system" in p.stderr
    assert not marker.exists()
