"""`RunDir.save` in a world of one rank (dsv3_plugin.training.run_dir, checkpoint_tags): the free-space check before
anything is written, a write that fails midway (ENOSPC, torch's zip writer) leaves the previous checkpoint complete
and named by `latest` and no partial tag, the completion marker records a CRC-32 of every file and `latest` follows
it, `keep_last` prunes; `--resume` verifies the checksums (a file zeroed in place is refused by name, not skipped)
and never picks a partial tag; DeepSpeed's failed writes are raised after its collectives
(`deepspeed.save_errors`); a read-only --out is a ConfigError naming the path."""

import errno
import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.training import checkpoint_tags as ct
from dsv3_plugin.training import run_dir as rd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")


@pytest.fixture
def run(tmp_path):
    """A fresh RunDir (one rank) over tmp/run, and a module to estimate from."""
    cfg = DSv3Config.from_block({"preset": "tiny", "train": {"keep_last": 2}})
    out = str(tmp_path / "run")
    r = rd.RunDir(out, None, cfg, rank=0, world=1, overwrite=False, save=True)
    yield r, torch.nn.Linear(8, 8)
    r.close()


def _writer(r, tag, size=1000, fail_after=None, exc=None):
    """What an engine's save does: the tag's files, one after the other; `exc` raised after `fail_after` files."""

    def write():
        d = os.path.join(r.ckpt, tag)
        os.makedirs(d, exist_ok=True)
        for i, n in enumerate(FILES):
            if fail_after is not None and i == fail_after:
                with open(os.path.join(d, n), "wb") as f:
                    f.write(b"\1" * 10)  # half a file, as a full disk leaves it
                raise exc
            with open(os.path.join(d, n), "wb") as f:
                f.write(bytes([i + 1]) * (size + int(tag[4:])))

    return write


def _latest(r):
    with open(os.path.join(r.ckpt, "latest")) as f:
        return f.read()


def test_save_records_checksums_then_latest(run):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    m = ct.read_marker(r.ckpt, "step2")
    assert m["checksum_algorithm"] == "crc32" and sorted(m["checksums"]) == sorted(FILES)
    for n in FILES:
        with open(os.path.join(r.ckpt, "step2", n), "rb") as f:
            assert m["checksums"][n] == f"{zlib.crc32(f.read()):08x}"
    assert _latest(r) == "step2"
    assert not [n for n in os.listdir(r.ckpt) if ".tmp" in n]  # latest written through a renamed temporary
    assert ct.resolve_resume(r.ckpt, r.out) == ("step2", None)


def test_keep_last_prunes_old_and_incomplete_tags(run):
    r, mod = run
    for s in (2, 4):
        r.save(f"step{s}", s, _writer(r, f"step{s}"), mod)
    os.makedirs(os.path.join(r.ckpt, "step5"))  # a save that never finished (no marker)
    os.makedirs(os.path.join(r.ckpt, "other"))  # not ours: left alone
    r.save("step6", 6, _writer(r, "step6"), mod)
    assert sorted(n for n in os.listdir(r.ckpt) if n.startswith("step")) == ["step4", "step6"]  # keep_last = 2
    assert os.path.isdir(os.path.join(r.ckpt, "other")) and _latest(r) == "step6"
    # a complete tag newer than the one saved (the timeline a resume abandoned) is not the prune's to delete
    shutil.copytree(os.path.join(r.ckpt, "step6"), os.path.join(r.ckpt, "step20"))
    ct.mark_complete(r.ckpt, "step20", 20, 1, r.config_hash)
    r.save("step8", 8, _writer(r, "step8"), mod)
    assert sorted(n for n in os.listdir(r.ckpt) if n.startswith("step")) == ["step20", "step6", "step8"]


def test_keep_last_zero_keeps_every_complete_tag(tmp_path):
    cfg = DSv3Config.from_block({"preset": "tiny"})
    r = rd.RunDir(str(tmp_path / "o"), None, cfg, rank=0, world=1, overwrite=False, save=True)
    for s in (1, 2, 3):
        r.save(f"step{s}", s, _writer(r, f"step{s}"), torch.nn.Linear(2, 2))
    r.close()
    assert sorted(n for n in os.listdir(r.ckpt) if n.startswith("step")) == ["step1", "step2", "step3"]


def test_a_failed_write_leaves_the_previous_checkpoint_and_latest(run):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    before = {n: open(os.path.join(r.ckpt, "step2", n), "rb").read() for n in os.listdir(os.path.join(r.ckpt, "step2"))}
    path = os.path.join(r.ckpt, "step4", FILES[1])
    exc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    with pytest.raises(CheckpointError) as e:
        r.save("step4", 4, _writer(r, "step4", fail_after=1, exc=exc), mod)
    msg = str(e.value)
    assert f"saving checkpoint step4 into {r.ckpt} failed on rank 0: No space left on device ({path})" in msg
    need = sum(ct.read_marker(r.ckpt, "step2")["files"].values())
    assert f"it needed about {need} bytes" in msg and "were free" in msg
    assert "the previous checkpoint step2 is intact and still the latest" in msg
    assert not os.path.exists(os.path.join(r.ckpt, "step4"))  # no partial tag left
    assert _latest(r) == "step2"
    after = {n: open(os.path.join(r.ckpt, "step2", n), "rb").read() for n in os.listdir(os.path.join(r.ckpt, "step2"))}
    assert after == before
    assert ct.resolve_resume(r.ckpt, r.out) == ("step2", None)


def test_an_engine_that_wrote_latest_anyway_is_undone(run):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)

    def write():
        ct.write_latest(r.ckpt, "step4")  # what DeepSpeed does with save_latest=True
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), os.path.join(r.ckpt, "step4"))

    with pytest.raises(CheckpointError, match="Disk quota exceeded"):
        r.save("step4", 4, write, mod)
    assert _latest(r) == "step2"


def test_torch_zip_writer_failure_names_the_directory_and_free_bytes(run):
    r, mod = run
    exc = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5120 vs 5012")
    with pytest.raises(CheckpointError) as e:
        r.save("step2", 2, _writer(r, "step2", fail_after=0, exc=exc), mod)
    msg = str(e.value)
    assert "torch's checkpoint writer could not write a file (" in msg and "unexpected pos 5120 vs 5012" in msg
    assert f"are free in {r.ckpt} now" in msg and "there is no earlier checkpoint to resume from" in msg
    assert not os.path.exists(os.path.join(r.ckpt, "step2"))


def test_other_errors_are_not_taken_for_a_full_disk(run):
    r, mod = run

    def write():
        raise RuntimeError("a bug in the engine")

    with pytest.raises(RuntimeError, match="a bug in the engine"):
        r.save("step2", 2, write, mod)


def test_free_space_is_checked_before_anything_is_written(run, monkeypatch):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    need = sum(ct.read_marker(r.ckpt, "step2")["files"].values())
    monkeypatch.setattr(ct, "free_bytes", lambda path: need - 1)
    called = []
    with pytest.raises(CheckpointError) as e:
        r.save("step4", 4, lambda: called.append(1), mod)
    msg = str(e.value)
    assert not called and not os.path.exists(os.path.join(r.ckpt, "step4"))
    assert (
        f"saving checkpoint step4 into {r.ckpt}: it needs about {need} bytes (the size of step2), only "
        f"{need - 1} bytes are free there" in msg
    )
    assert "nothing was written, the previous checkpoint step2 is intact and still the latest" in msg
    monkeypatch.setattr(ct, "free_bytes", lambda path: need)
    r.save("step4", 4, _writer(r, "step4"), mod)
    assert _latest(r) == "step4"


def test_first_save_estimates_from_the_parameters(run, monkeypatch):
    r, _ = run
    mod = torch.nn.Linear(100, 10)  # 1010 FP32 parameters: 4 weight + 4 master + 8 moment bytes each
    monkeypatch.setattr(ct, "free_bytes", lambda path: 1010 * 16 - 1)
    with pytest.raises(CheckpointError, match=r"it needs about 16160 bytes \(estimated from the parameters\)"):
        r.save("step2", 2, _writer(r, "step2"), mod)


def test_estimate_counts_each_parameter_once_over_the_ranks():
    cfg = DSv3Config.from_block({"preset": "tiny", "parallel": {"ep": 2}, "memory": {"ema": True}})
    dense, expert = torch.nn.Linear(10, 10, bias=False), torch.nn.Linear(10, 10, bias=False)
    expert.weight.allreduce = False  # expert parameters: held by dp / ep ranks
    mod = torch.nn.ModuleList([dense, expert])
    # world 4, pp 1: dense held by 4 ranks, this rank's experts by 2; 4 + 12 + 4 (EMA) bytes per parameter
    assert ct._estimate_bytes(mod, cfg, 4) == 100 * 20 // 4 + 100 * 20 // 2


def test_stale_tag_of_the_same_name_is_replaced(run):
    r, mod = run
    d = os.path.join(r.ckpt, "step2")
    os.makedirs(d)
    with open(os.path.join(d, "ema_rank0.pt"), "wb") as f:
        f.write(b"left by an interrupted run")
    r.save("step2", 2, _writer(r, "step2"), mod)
    assert sorted(ct.read_marker(r.ckpt, "step2")["files"]) == sorted(FILES)


def test_zeroed_file_is_refused_on_resume_by_name(run):
    r, mod = run
    for s in (2, 4):
        r.save(f"step{s}", s, _writer(r, f"step{s}"), mod)
    p = os.path.join(r.ckpt, "step4", FILES[1])
    want = ct.read_marker(r.ckpt, "step4")["checksums"][FILES[1]]
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.write(b"\0" * size)  # zeroed in place: the size still matches
    got = f"{zlib.crc32(bytes(size)):08x}"
    assert ct.tag_problem(r.ckpt, "step4") is None  # sizes alone would resume it
    with pytest.raises(CheckpointError) as e:
        ct.resolve_resume(r.ckpt, r.out)
    msg = str(e.value)
    assert f"checkpoint step4 is corrupt: {FILES[1]} has crc32 {got}, but {want} was recorded" in msg
    assert f"delete the directory {os.path.join(r.ckpt, 'step4')} to resume from the previous complete " in msg
    assert "step2" in msg
    with pytest.raises(CheckpointError, match="is corrupt"):
        ct.resume_source(r.out, r.cfg, 1)
    shutil.rmtree(os.path.join(r.ckpt, "step4"))  # what the message says to do
    tag, note = ct.resolve_resume(r.ckpt, r.out)
    assert tag == "step2" and "'step4', which does not exist" in note


def test_marker_without_checksums_still_resumes(run):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    p = os.path.join(r.ckpt, "step2", ct.COMPLETE_MARKER)
    with open(p) as f:
        m = json.load(f)
    del m["checksums"], m["checksum_algorithm"]  # as written before checksums existed
    with open(p, "w") as f:
        json.dump(m, f)
    assert ct.resolve_resume(r.ckpt, r.out) == ("step2", None)


def test_resume_never_picks_a_partial_checkpoint(run):
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    r.save("step4", 4, _writer(r, "step4"), mod)
    os.remove(os.path.join(r.ckpt, "step4", ct.COMPLETE_MARKER))  # its save never finished ...
    assert _latest(r) == "step4"  # ... though `latest` names it
    tag, note = ct.resolve_resume(r.ckpt, r.out)
    assert tag == "step2" and "'latest' names tag 'step4', which is incomplete (no valid" in note


class _FakeCkptEngine:
    def __init__(self, fail_on):
        self.fail_on, self.calls = fail_on, []

    def save(self, state_dict, path):
        self.calls.append(path)
        if path == self.fail_on:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


class _FakeEngine:
    def __init__(self, fail_on):
        self.checkpoint_engine = _FakeCkptEngine(fail_on)


def test_deepspeed_write_errors_come_after_the_save():
    from dsv3_plugin.deepspeed.save_errors import deferred_write_errors

    eng = _FakeEngine("b")
    reached = []
    with pytest.raises(OSError, match="No space left on device") as e:
        with deferred_write_errors(eng):
            for p in ("a", "b", "c"):
                eng.checkpoint_engine.save({}, p)
            reached.append("the rest of the save (its collectives)")
    assert e.value.filename == "b" and reached
    assert eng.checkpoint_engine.calls == ["a", "b"]  # after the failure nothing more is written
    assert "save" not in vars(eng.checkpoint_engine)  # the engine's own method is back
    with pytest.raises(TypeError):  # not a write failure: raised at once
        with deferred_write_errors(eng):
            eng.checkpoint_engine.save({}, 1 + "x")


def test_read_only_out_is_refused_by_name(tmp_path, monkeypatch):
    out = str(tmp_path / "ro")
    os.makedirs(out)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if p in (out, str(tmp_path)) else real(p, mode))
    with pytest.raises(ConfigError, match=rf"--out {out}: cannot write into it: {out} is not writable"):
        rd.check_out_path(out)
    with pytest.raises(ConfigError, match=rf"--out {out}/new: cannot create it: {out} is not writable"):
        rd.probe_lock(out + "/new") or rd.RunLock(out + "/new").acquire()
    monkeypatch.setattr(os, "access", real)

    def no_open(path, *a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(os, "open", no_open)
    with pytest.raises(ConfigError, match=rf"--out {out}: cannot open its lock file {out}/.dsv3.lock \(Permission"):
        rd.probe_lock(out)


_RO = """
import sys
sys.path.insert(0, {root!r})
from dsv3_plugin.config import ConfigError
from dsv3_plugin.training import run_dir as rd
for p in ({d!r}, {d!r} + "/sub"):
    try:
        rd.check_out_path(p)  # what dsv3 train checks before any rank starts
        rd.probe_lock(p)
        print("accepted", p)
    except ConfigError as e:
        print(e)
"""


def test_read_only_file_system_is_refused_by_name(tmp_path):
    """A real read-only mount (a user namespace's tmpfs), where even root cannot write."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) here")
    d = str(tmp_path / "ro")
    os.makedirs(d)
    script = tmp_path / "probe.py"
    script.write_text(_RO.format(root=ROOT, d=d))
    cmd = f"mount -t tmpfs -o ro,size=64k tmpfs {d} && exec {sys.executable} {script}"
    p = subprocess.run(["unshare", "-Urm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "mount" in p.stderr + p.stdout:
        pytest.skip(f"mounting is not allowed here ({p.stderr.strip()[:200]})")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines == [
        f"--out {d}: cannot write into it: {d} is on a read-only file system",
        f"--out {d}/sub: cannot create it: {d} is on a read-only file system",
    ], p.stdout + p.stderr


def test_a_failure_while_completing_removes_the_tag(run, monkeypatch):
    """The disk fills with the marker or `latest` itself: the tag is removed, `latest` is the previous one."""
    r, mod = run
    r.save("step2", 2, _writer(r, "step2"), mod)
    real = ct.write_latest

    def full(ckpt, tag):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(ckpt, "latest.tmp1"))

    monkeypatch.setattr(ct, "write_latest", full)
    with pytest.raises(CheckpointError) as e:
        r.save("step4", 4, _writer(r, "step4"), mod)
    assert f"completing checkpoint step4 in {r.ckpt} failed: No space left on device" in str(e.value)
    assert "the previous checkpoint step2 is intact and still the latest" in str(e.value)
    assert not os.path.exists(os.path.join(r.ckpt, "step4")) and _latest(r) == "step2"
    monkeypatch.setattr(ct, "write_latest", real)
