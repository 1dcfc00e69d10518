"""The run directory of `dsv3 train` (dsv3_plugin.training.run_dir, checkpoint_tags, run_record, metrics_file): the OS
lock, checkpoint completeness and the choice of the tag to resume, config identity, torn metrics lines; and the
launcher arguments `dsv3` accepts."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.training import checkpoint_tags as ct
from dsv3_plugin.training import metrics_file as mf
from dsv3_plugin.training import run_dir as rd
from dsv3_plugin.training import run_record as rr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HOLD = """
import sys, time
sys.path.insert(0, {root!r})
from dsv3_plugin.training.run_dir import RunLock
RunLock({out!r}).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_lock_names_holder_and_goes_with_a_killed_holder(tmp_path):
    out = str(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(root=ROOT, out=out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=rf"--out {out}: in use by another dsv3 train \(pid {p.pid} "):
            rd.RunLock(out).acquire()
        with pytest.raises(ConfigError, match=f"pid {p.pid}"):
            rd.probe_lock(out)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
    lock = rd.RunLock(out).acquire()  # the kernel released it with the killed process
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        rd.RunLock(out).acquire()  # a second descriptor in the same process is refused too
    lock.release()
    rd.probe_lock(out)


def test_out_path_checks(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        rd.check_out_path(str(f))
    with pytest.raises(ConfigError, match=f"{f} is a file, so no directory"):
        rd.check_out_path(str(f / "a" / "b"))
    rd.check_out_path(str(tmp_path / "new" / "dir"))  # creatable: fine


def _fake_tag(
    ck, step, h="h0", world=2, files=("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
):
    d = os.path.join(ck, f"step{step}")
    os.makedirs(d)
    for n in files:
        with open(os.path.join(d, n), "wb") as f:
            f.write(b"x" * (10 + step))
    ct.mark_complete(ck, f"step{step}", step, world, h)
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write(f"step{step}")


@pytest.fixture
def run(tmp_path):
    cfg = DSv3Config.from_block({"preset": "tiny"})
    out = str(tmp_path / "run")
    os.makedirs(out)
    rr.write_run_record(out, cfg, 2)
    ck = os.path.join(out, "ckpt")
    for s in (2, 4, 6):
        _fake_tag(ck, s)
    return out, ck


def test_resume_follows_a_valid_latest(run):
    out, ck = run
    assert ct.resolve_resume(ck, out) == ("step6", None)


def _append(path, data: bytes):
    with open(path, "ab") as f:
        f.write(data)


@pytest.mark.parametrize(
    "damage, problem, tag",
    [
        (lambda ck: open(os.path.join(ck, "latest"), "w").close(), "'latest' is empty", "step6"),
        (lambda ck: os.remove(os.path.join(ck, "latest")), "there is no 'latest' file", "step6"),
        (lambda ck: Path(ck, "latest").write_text("step9"), "'step9', which does not exist", "step6"),
        (
            lambda ck: os.remove(os.path.join(ck, "step6", ct.COMPLETE_MARKER)),
            "'step6', which is incomplete (no valid",
            "step4",
        ),
        (
            lambda ck: os.remove(os.path.join(ck, "step6", "zero_pp_rank_0_mp_rank_00_optim_states.pt")),
            "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing",
            "step4",
        ),
        (
            lambda ck: _append(os.path.join(ck, "step6", "mp_rank_00_model_states.pt"), b"!"),
            "mp_rank_00_model_states.pt holds 17 bytes, 16 were written",
            "step4",
        ),
        (lambda ck: Path(ck, "step6", ct.COMPLETE_MARKER).write_text('{"tag": "st'), "no valid", "step4"),
    ],
)
def test_resume_falls_back_to_the_newest_complete_tag(run, damage, problem, tag):
    out, ck = run
    damage(ck)
    got, note = ct.resolve_resume(ck, out)
    assert got == tag
    assert problem in note and f"resuming from {tag}, the newest complete checkpoint" in note


def test_resume_refuses_without_a_complete_tag(run):
    out, ck = run
    for s in (2, 4, 6):
        os.remove(os.path.join(ck, f"step{s}", ct.COMPLETE_MARKER))
    with pytest.raises(
        CheckpointError,
        match=r"no complete checkpoint to resume from \('latest' names tag 'step6', "
        r"which is incomplete.*start a new run",
    ):
        ct.resolve_resume(ck, out)


def test_legacy_checkpoint_without_run_record_trusts_latest(tmp_path):
    ck = str(tmp_path / "ckpt")
    os.makedirs(os.path.join(ck, "step3"))
    open(os.path.join(ck, "step3", "mp_rank_00_model_states.pt"), "wb").close()
    Path(ck, "latest").write_text("step3")
    assert ct.resolve_resume(ck, str(tmp_path)) == ("step3", None)


def test_identity_names_the_key_that_differs():
    a = DSv3Config.from_block({"preset": "tiny"})
    b = DSv3Config.from_block({"preset": "tiny", "model": {"hidden_size": 128}})
    c = DSv3Config.from_block(
        {"preset": "tiny", "moe": {"bias_update_speed": 0.5}, "train": {"steps": 7}, "parallel": {"p2p_timeout_s": 5.0}}
    )
    ia = rr.config_identity(a)
    rr.check_identity(rr.identity_hash(ia), ia, c, "runs/x")  # training knobs may change on resume
    with pytest.raises(
        CheckpointError,
        match=r"--resume runs/x: this checkpoint belongs to another run's config "
        r"\(dsv3\.model\.hidden_size: 64 in the checkpoint's run, 128 in",
    ):
        rr.check_identity(rr.identity_hash(ia), ia, b, "runs/x")
    with pytest.raises(CheckpointError, match="config hash"):
        rr.check_identity(rr.identity_hash(ia), None, b, "runs/x")


def test_torn_last_line_is_dropped_and_a_bad_middle_line_refused(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo')
    rows, torn = mf.read_jsonl(str(p))
    assert [r["step"] for r in rows] == [1, 2] and "torn last line" in torn and "15 bytes" in torn
    p.write_text(json.dumps({"step": 1}) + "\n")
    assert mf.read_jsonl(str(p)) == ([{"step": 1}], None)
    p.write_text(json.dumps({"step": 1}) + "\n{oops\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a JSON line"):
        mf.read_jsonl(str(p))


def test_previous_run_and_clear(tmp_path):
    out = str(tmp_path / "o")
    assert rd.previous_run(out) is None
    os.makedirs(os.path.join(out, "ckpt"))
    (tmp_path / "o" / "metrics.jsonl").write_text("")
    (tmp_path / "o" / "run.json").write_text("{}")
    (tmp_path / "o" / "mine.txt").write_text("keep")
    assert rd.previous_run(out) is None  # a run that failed before its first step: nothing to lose
    (tmp_path / "o" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    os.makedirs(os.path.join(out, "ckpt", "step2"))
    assert rd.previous_run(out) == "metrics.jsonl with 2 line(s), checkpoints step2"
    rd.clear_run(out)
    assert sorted(os.listdir(out)) == ["mine.txt"]


@pytest.mark.parametrize(
    "argv, rest, local",
    [
        (["--local_rank=1", "train", "--steps", "2"], ["train", "--steps", "2"], "1"),
        (["train", "--local-rank", "0", "--steps", "2"], ["train", "--steps", "2"], "0"),
        (["train", "--steps", "2", "--local_rank=3"], ["train", "--steps", "2"], "3"),
        (["check-config", "a.json"], ["check-config", "a.json"], None),
    ],
)
def test_launcher_local_rank_accepted_anywhere(monkeypatch, argv, rest, local):
    from dsv3_plugin.cli import build_parser, strip_launcher_args

    monkeypatch.setenv("LOCAL_RANK", "")  # recorded, so the value set below is undone after the test
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_launcher_args(argv) == rest
    assert os.environ.get("LOCAL_RANK") == local
    build_parser().parse_args(rest)


def test_local_rank_before_subcommand_parses(monkeypatch, capsys):
    """What the deepspeed launcher runs: `dsv3 --local_rank=0 train ...` (argparse refused it before)."""
    from dsv3_plugin.cli import main

    monkeypatch.setenv("LOCAL_RANK", "")
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["--local_rank=0", "train", "--nproc", "0"]) == 2
    assert "--nproc: must be >= 1" in capsys.readouterr().err  # got past argparse to train's own checks


def test_resume_refuses_another_world_size(tmp_path):
    """ZeRO-1 partitions the optimizer state per rank and each rank has its own RNG state: a checkpoint resumes
    only on as many ranks as saved it (DeepSpeed would raise ZeRORuntimeException inside the ranks)."""
    cfg = DSv3Config.from_block({"preset": "tiny"})
    out = str(tmp_path / "run")
    os.makedirs(out)
    rr.write_run_record(out, cfg, 2)
    ck = os.path.join(out, "ckpt")
    _fake_tag(ck, 4, h=rr.identity_hash(rr.config_identity(cfg)), world=2)
    assert ct.resume_source(out, cfg, world=2)[1] == "step4"
    assert ct.resume_source(out, cfg)[1] == "step4"  # world unknown: not checked
    with pytest.raises(
        CheckpointError,
        match=rf"--resume {out}: step4 was saved by 2 rank\(s\), this run has 1; "
        r".*--nproc 2",
    ):
        ct.resume_source(out, cfg, world=1)
