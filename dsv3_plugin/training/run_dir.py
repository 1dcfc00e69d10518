"""A `dsv3 train` run directory (`--out`): one run at a time (an fcntl lock), checkpoints that say whether they
are complete (`dsv3_complete.json`, written last, listing every file) and which config they belong to
(`run.json` and its hash), and a metrics file that survives a crash in the middle of a write.

`RunDir` is what one training call does with all of this; the functions are its pieces (and the CLI's checks
before any rank starts). Layout and reasons: docs/design_notes.md (#training-run-dir).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import re
import shutil
import sys

import torch

from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.packed import data_change
from dsv3_plugin.data.tokenizer import TOKENIZER_FILES
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.parallel.distributed import _input_error

__all__ = [
    "RunDir",
    "RunLock",
    "checkpoint_dir",
    "resume_source",
    "check_out_path",
    "probe_lock",
    "config_identity",
    "identity_hash",
    "write_run_record",
    "read_run_record",
    "check_identity",
    "previous_run",
    "clear_run",
    "mark_complete",
    "read_marker",
    "tag_problem",
    "resolve_resume",
    "read_jsonl",
    "keep_tokenizer",
    "LOCK_FILE",
    "RUN_RECORD",
    "COMPLETE_MARKER",
]

LOCK_FILE = ".dsv3.lock"
RUN_RECORD = "run.json"
COMPLETE_MARKER = "dsv3_complete.json"
TOKENIZER_DIR = "tokenizer"  # RUN/tokenizer: the run's tokenizer files (what the export step ships with the model)
_OUR_FILES = (RUN_RECORD, "metrics.jsonl", "train.png", "routing.png")
_TAG = re.compile(r"^step(\d+)$")


def check_out_path(out: str) -> None:
    """`--out` must be a directory or creatable as one (ConfigError naming the path otherwise)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: is a file, not a directory")
    head = os.path.abspath(out)
    while head != os.path.dirname(head):
        head = os.path.dirname(head)
        if os.path.exists(head):
            if not os.path.isdir(head):
                raise ConfigError(f"--out {out}: {head} is a file, so no directory can be made under it")
            break


def _mkdir(out: str) -> None:
    check_out_path(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the directory ({e.strerror})") from None


class RunLock:
    """Exclusive advisory lock on a run directory (`fcntl.flock` on OUT/.dsv3.lock), non-blocking.

    `acquire()` raises ConfigError naming the holder's pid when another process holds it. The kernel drops the
    lock when the holder's file descriptor closes: on `release()`, on exit, on kill -9.
    """

    def __init__(self, out: str):
        self.out = out
        self.path = os.path.join(out, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        _mkdir(self.out)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise ConfigError(
                f"--out {self.out}: in use by another dsv3 train ({_holder(self.path)}); wait for it "
                "to finish or stop it, or pick another --out"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(info) + "\n").encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closes the description: the lock goes with it
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            info = json.loads(f.read() or "{}")
        return f"pid {info['pid']} on {info.get('host', '?')}, started {info.get('started', '?')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown: the holder has not written it yet"


def probe_lock(out: str) -> None:
    """Fail at once (ConfigError naming the pid) if a run holds OUT; does not keep the lock. No-op if OUT does
    not exist yet."""
    if os.path.isdir(out):
        RunLock(out).acquire().release()


# --- config identity -------------------------------------------------------------------------------------------

# Keys that decide what a checkpoint holds (tensor shapes, which experts exist, how state is partitioned).
# Training knobs (γ / λ schedules, α, lr, steps, fp8, recompute, EMA decay, seed) may change on resume.
_MOE_SHAPE = (
    "n_routed_experts",
    "n_shared_experts",
    "intermediate_size",
    "top_k",
    "n_group",
    "topk_group",
    "score_func",
)


def config_identity(cfg) -> dict:
    """The sections of a DSv3Config a checkpoint belongs to."""
    d = cfg.to_dict()
    par = {k: v for k, v in d["parallel"].items() if k != "p2p_timeout_s"}  # a wait limit, not state
    return {
        "model": d["model"],
        "moe": {k: d["moe"][k] for k in _MOE_SHAPE},
        "mtp": {"depth": d["mtp"]["depth"]},
        "parallel": par,
    }


def identity_hash(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _atomic_json(obj, path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_run_record(out: str, cfg, world: int) -> dict:
    ident = config_identity(cfg)
    rec = {"config_hash": identity_hash(ident), "world_size": world, "identity": ident}
    _atomic_json(rec, os.path.join(out, RUN_RECORD))
    return rec


def read_run_record(run_root: str) -> dict | None:
    path = os.path.join(run_root, RUN_RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            rec = json.load(f)
        rec["config_hash"], rec["identity"]
        return rec
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a dsv3 run record ({e})") from None


def _first_difference(a, b, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{path}.{k}")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {json.dumps(a)} in the checkpoint's run, {json.dumps(b)} in this config"


def check_identity(saved_hash: str, saved_ident: dict | None, cfg, where: str) -> None:
    """CheckpointError unless the checkpoint at `where` was written for this config's model/parallel sections."""
    ident = config_identity(cfg)
    if saved_hash == identity_hash(ident):
        return
    diff = _first_difference(saved_ident, ident, "dsv3") if saved_ident else None
    raise CheckpointError(
        f"--resume {where}: this checkpoint belongs to another run's config "
        f"({diff or f'config hash {saved_hash} there, {identity_hash(ident)} here'}); "
        "resume with the config it was written with, or start a new run"
    )


def previous_run(out: str) -> str | None:
    """What a previous run left in OUT that a fresh run would destroy (None if nothing): metrics lines or
    checkpoints. A run that stopped before its first step leaves neither."""
    if not os.path.isdir(out):
        return None
    found = []
    m = os.path.join(out, "metrics.jsonl")
    if os.path.isfile(m) and os.path.getsize(m) > 0:
        with open(m, "rb") as f:
            found.append(f"metrics.jsonl with {sum(1 for x in f if x.strip())} line(s)")
    ck = os.path.join(out, "ckpt")
    if os.path.isdir(ck) and os.listdir(ck):
        tags = sorted(n for n in os.listdir(ck) if _TAG.match(n))
        found.append(f"checkpoints {', '.join(tags)}" if tags else "a ckpt/ directory")
    return ", ".join(found) or None


def clear_run(out: str) -> None:
    """Remove what a previous run wrote into OUT (only our files)."""
    for n in _OUR_FILES:
        p = os.path.join(out, n)
        if os.path.exists(p):
            os.remove(p)
    shutil.rmtree(os.path.join(out, "ckpt"), ignore_errors=True)
    shutil.rmtree(os.path.join(out, TOKENIZER_DIR), ignore_errors=True)


def keep_tokenizer(out: str, src: str) -> str | None:
    """Copy the tokenizer files (`TOKENIZER_FILES`) of directory `src` to OUT/tokenizer, atomically (a temporary
    directory renamed over the old one). Returns the directory, or None when `src` holds none of them."""
    files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    if not files:
        return None
    dst = os.path.join(out, TOKENIZER_DIR)
    tmp = f"{dst}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in files:
        shutil.copyfile(os.path.join(src, f), os.path.join(tmp, f))
    old = f"{dst}.old{os.getpid()}"
    if os.path.isdir(dst):
        os.replace(dst, old)  # (a directory cannot be renamed over a non-empty one)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst


# --- checkpoint completeness -----------------------------------------------------------------------------------


def mark_complete(ckpt: str, tag: str, step: int, world: int, config_hash: str, data: dict | None = None) -> None:
    """Rank 0, after a barrier that follows every rank's last file of `tag`: record the files and sizes, and the
    fingerprint of the data the run reads (`data`, see `dsv3_plugin.data.packed.data_change`)."""
    d = os.path.join(ckpt, tag)
    files = {}
    for root, _, names in os.walk(d):
        for n in names:
            if n == COMPLETE_MARKER or ".tmp" in n:
                continue
            p = os.path.join(root, n)
            files[os.path.relpath(p, d)] = os.path.getsize(p)
    rec = {"tag": tag, "step": step, "world_size": world, "config_hash": config_hash, "files": files}
    if data is not None:
        rec["data"] = data
    _atomic_json(rec, os.path.join(d, COMPLETE_MARKER))


def read_marker(ckpt: str, tag: str) -> dict | None:
    try:
        with open(os.path.join(ckpt, tag, COMPLETE_MARKER)) as f:
            m = json.load(f)
        m["files"].items(), m["step"], m["config_hash"]
        return m
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def tag_problem(ckpt: str, tag: str) -> str | None:
    """Why checkpoint `tag` cannot be resumed from (None: complete)."""
    d = os.path.join(ckpt, tag)
    if not os.path.isdir(d):
        return f"tag {tag!r}, which does not exist"
    m = read_marker(ckpt, tag)
    if m is None:
        return f"tag {tag!r}, which is incomplete (no valid {COMPLETE_MARKER}: the save did not finish)"
    for rel, size in m["files"].items():
        p = os.path.join(d, rel)
        if not os.path.isfile(p):
            return f"tag {tag!r}, which is incomplete ({rel} is missing)"
        if os.path.getsize(p) != size:
            return f"tag {tag!r}, which is incomplete ({rel} holds {os.path.getsize(p)} bytes, {size} were written)"
    return None


def _legacy_ok(ckpt: str, tag: str) -> bool:
    """A checkpoint written before completion markers existed: trust DeepSpeed's pointer if its files are there."""
    return bool(tag) and os.path.isfile(os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"))


def resolve_resume(ckpt: str, run_root: str | None) -> tuple[str, str | None]:
    """The tag to resume from and a note for stderr when it is not the one `latest` names.

    `latest` is used when it names a complete tag. If it is missing, empty, or names a missing or incomplete
    tag, the newest complete `step<N>` tag is used instead (with a note); none -> CheckpointError saying what to
    do. Runs without `run.json` (written before completion markers) keep DeepSpeed's rule: trust `latest`.
    """
    latest_path = os.path.join(ckpt, "latest")
    latest = None
    if os.path.isfile(latest_path):
        with open(latest_path, errors="replace") as f:
            latest = f.read().strip()
    if run_root is None or read_run_record(run_root) is None:
        if latest and _legacy_ok(ckpt, latest):
            return latest, None
    if latest:
        problem = tag_problem(ckpt, latest)
        if problem is None:
            return latest, None
        problem = f"'latest' names {problem}"
    else:
        problem = "'latest' is empty" if latest == "" else "there is no 'latest' file"
    tags = []
    if os.path.isdir(ckpt):
        for n in os.listdir(ckpt):
            m = _TAG.match(n)
            if m and tag_problem(ckpt, n) is None:
                tags.append((int(m.group(1)), n))
    if not tags:
        raise CheckpointError(
            f"--resume {ckpt}: no complete checkpoint to resume from ({problem}); start a new "
            "run (another --out, or --overwrite to replace this one) or resume another run"
        )
    tag = max(tags)[1]
    return tag, f"dsv3 train: {ckpt}: {problem}; resuming from {tag}, the newest complete checkpoint"


def checkpoint_dir(path: str | os.PathLike) -> str:
    """A run's OUT dir or its `ckpt/` dir -> the DeepSpeed checkpoint dir (the one with `latest` and the tags)."""
    path = os.fspath(path)
    sub = os.path.join(path, "ckpt")
    return sub if os.path.isdir(sub) else path


def resume_source(resume: str, cfg, world: int | None = None, data: dict | None = None) -> tuple[str, str, str | None]:
    """(checkpoint dir, tag, note) to resume from, after checking the checkpoint is complete, belongs to this
    config and (when `world` is given) was saved by as many ranks as this run has: ZeRO-1's optimizer partitions
    and the per-rank RNG states do not carry over to another count (CheckpointError saying what to do). With
    `data` (this run's data fingerprint): the checkpoint's data position means the same rows only on the same
    data, so other data is refused (DataError naming the key that differs)."""
    ck = checkpoint_dir(resume)
    if not os.path.isdir(ck):
        raise CheckpointError(f"--resume {resume}: no DeepSpeed checkpoint here (no ckpt/ dir, no 'latest')")
    root = os.path.dirname(os.path.abspath(ck)) if os.path.basename(os.path.normpath(ck)) == "ckpt" else ck
    tag, note = resolve_resume(ck, root)
    record = read_run_record(root)
    marker = read_marker(ck, tag)
    saved = marker["config_hash"] if marker else (record["config_hash"] if record else None)
    if saved is not None:
        check_identity(saved, record["identity"] if record else None, cfg, resume)
    saved_world = marker.get("world_size") if marker else (record.get("world_size") if record else None)
    if world is not None and isinstance(saved_world, int) and saved_world != world:
        raise CheckpointError(
            f"--resume {resume}: {tag} was saved by {saved_world} rank(s), this run has {world}; "
            "ZeRO-1's optimizer partitions and each rank's RNG state need the same number: resume "
            f"with --nproc {saved_world} (or that many ranks under torchrun / deepspeed)"
        )
    if data is not None:
        why = data_change(marker.get("data") if marker else None, data)
        if why:
            raise DataError(
                f"--resume {resume}: {tag} was trained on other data ({why}); its data position (step "
                f"{marker['step'] if marker else '?'}) means nothing on this data: resume with the data it was "
                "trained on, or start a new run"
            )
    return ck, tag, note


# --- metrics.jsonl ---------------------------------------------------------------------------------------------


def read_jsonl(path: str) -> tuple[list[dict], str | None]:
    """The JSON lines of `path` and, if its last line is torn (an interrupted write), a note saying it was
    dropped (the caller decides whether to rewrite the file). A bad line before the last -> ConfigError."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.split(b"\n")
    rows, torn = [], None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (ValueError, UnicodeDecodeError) as e:
            if any(x.strip() for x in lines[i + 1 :]):
                raise ConfigError(
                    f"{path}:{i + 1}: not a JSON line ({e}); only a torn last line is dropped "
                    "automatically — remove or fix this one"
                ) from None
            torn = f"dropped a torn last line of {path} ({len(line)} bytes; the write was interrupted)"
    return rows, torn


# --- one run ---------------------------------------------------------------------------------------------------


class RunDir:
    """What one `dsv3_plugin.deepspeed.train.train()` call does with its run directory: the lock, the config record, the
    resume tag, metrics.jsonl, completion markers after each save. Rank 0 holds the lock and decides
    (which tag to resume, or which error to raise); every rank gets the same decision, so a refusal raises the
    same error on every rank."""

    def __init__(
        self,
        out,
        resume,
        cfg,
        rank: int,
        world: int,
        overwrite: bool,
        save: bool,
        data: dict | None = None,
        tokenizer: str | None = None,
    ):
        """`data`: the data fingerprint checkpoints record and --resume compares; `tokenizer`: a directory whose
        tokenizer files rank 0 copies to OUT/tokenizer (None: the run has no tokenizer)."""
        self.out, self.rank, self.world, self.cfg, self.data = out, rank, world, cfg, data
        self.tokenizer = tokenizer
        self.lock = None
        self._kept_rows: list[dict] = []  # rank 0: metrics lines of the run being resumed in place
        self.ckpt = os.path.join(out, "ckpt") if out and save else None
        self.metrics_path = os.path.join(out, "metrics.jsonl") if out and rank == 0 else None
        self.config_hash = identity_hash(config_identity(cfg))
        d = self._decide(out, resume, overwrite) if rank == 0 else None
        if torch.distributed.is_initialized():
            box = [d]
            torch.distributed.broadcast_object_list(box, src=0)
            d = box[0]
        self.resume_ckpt, self.resume_tag, self.same_dir = d["resume_ckpt"], d["resume_tag"], d["same_dir"]
        self.notes: list[str] = d["notes"]
        if rank == 0:
            for n in self.notes:
                print(n, file=sys.stderr, flush=True)
        if d["error"] is not None:
            self.close()
            raise _input_error(*d["error"])

    def _decide(self, out, resume, overwrite) -> dict:
        d = {"resume_ckpt": None, "resume_tag": None, "same_dir": False, "notes": [], "error": None}
        try:
            if out:  # lock first: nothing below may read a run directory another process is writing
                self.lock = RunLock(out).acquire()
            if resume:
                d["resume_ckpt"], d["resume_tag"], note = resume_source(resume, self.cfg, self.world, self.data)
                if note:
                    d["notes"].append(note)
            if out:
                d["same_dir"] = bool(resume) and (
                    os.path.realpath(d["resume_ckpt"]) == os.path.realpath(os.path.join(out, "ckpt"))
                )
                prev = None if d["same_dir"] else previous_run(out)
                if prev and not overwrite:
                    raise ConfigError(
                        f"--out {out}: holds a previous run ({prev}); continue it with "
                        f"--resume {out}, replace it with --overwrite, or pick another --out"
                    )
                if prev:
                    clear_run(out)
                metrics = os.path.join(out, "metrics.jsonl")
                if d["same_dir"] and os.path.isfile(metrics):  # read now: a bad line refuses before any rank starts
                    self._kept_rows, torn = read_jsonl(metrics)
                    if torn:
                        d["notes"].append(f"dsv3 train: {torn}")
                write_run_record(out, self.cfg, self.world)
                if self.tokenizer:
                    keep_tokenizer(out, self.tokenizer)
        except ValueError as e:  # ConfigError / CheckpointError
            d["error"] = (type(e).__name__, str(e))
        except OSError as e:  # e.g. an --out without write permission
            d["error"] = ("ConfigError", f"--out {out}: {e.strerror or e} ({e.filename or out})")
        return d

    def start_metrics(self, start: int) -> None:
        """Rank 0: a fresh run starts an empty metrics.jsonl; a resume into the same OUT keeps the lines up to the
        checkpoint's step (dropping those of an interrupted run past it, and a torn last line)."""
        if self.metrics_path is None:
            return
        rows = [r for r in self._kept_rows if r.get("step", 0) <= start] if self.same_dir and start else []
        tmp = self.metrics_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, self.metrics_path)

    def saved(self, tag: str, step: int) -> None:
        """After every rank wrote its files of `tag`: rank 0 records the checkpoint as complete."""
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        if self.rank == 0:
            mark_complete(self.ckpt, tag, step, self.world, self.config_hash, self.data)

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
