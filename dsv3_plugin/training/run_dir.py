"""A `dsv3 train` run directory (`--out`): one run at a time (an fcntl lock), an `--out` that is checked before any
rank starts (a file, a read-only directory or file system), what a previous run left there (refused unless
`--overwrite` or `--resume` of that run), the run's tokenizer files, and `RunDir`: what one training call does
with all of this.

The pieces it uses live next to it: `run_record` (which config the run and its checkpoints belong to),
`checkpoint_tags` (complete checkpoints, the resume tag, saves a full disk cannot turn into a lost run),
`metrics_file` (metrics.jsonl written and read strictly). Layout and reasons: docs/design_notes.md
(#training-run-dir).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import sys
from collections.abc import Callable

import torch

from dsv3_plugin.data.tokenizer import TOKENIZER_FILES
from dsv3_plugin.errors import ConfigError, DataError
from dsv3_plugin.parallel.distributed import _input_error
from dsv3_plugin.safe_files import copy_regular
from dsv3_plugin.training.checkpoint_tags import COMPLETE_MARKER, TAG_PATTERN, resume_source, save_tag
from dsv3_plugin.training.metrics_file import metrics_line, read_jsonl
from dsv3_plugin.training.run_record import RUN_RECORD, config_identity, identity_hash, write_run_record
from dsv3_plugin.training.shared_dir import check_shared_dir

__all__ = [
    "RunDir",
    "RunLock",
    "check_out_path",
    "probe_lock",
    "previous_run",
    "clear_run",
    "keep_tokenizer",
    "LOCK_FILE",
    "TOKENIZER_DIR",
]

LOCK_FILE = ".dsv3.lock"
TOKENIZER_DIR = "tokenizer"  # RUN/tokenizer: the run's tokenizer files (what the export step ships with the model)
_OUR_FILES = (RUN_RECORD, "metrics.jsonl", "train.png", "routing.png")


def check_out_path(out: str) -> None:
    """`--out` must be a writable directory or creatable as one: ConfigError naming the path otherwise (a file, a
    file above it, a read-only directory or file system above it or at it)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: is a file, not a directory")
    if os.path.isdir(out):
        _check_writable(out, out, "cannot write into it")
        return
    head = os.path.abspath(out)
    while head != os.path.dirname(head):
        head = os.path.dirname(head)
        if os.path.exists(head):
            if not os.path.isdir(head):
                raise ConfigError(f"--out {out}: {head} is a file, so no directory can be made under it")
            _check_writable(out, head, "cannot create it")
            break


def _check_writable(out: str, d: str, what: str) -> None:
    # os.access asks the kernel with the real ids: a read-only mount (EROFS) is refused for root too
    if not os.access(d, os.W_OK | os.X_OK):
        ro = _read_only_fs(d)
        why = "is on a read-only file system" if ro else "is not writable by this user"
        raise ConfigError(f"--out {out}: {what}: {d} {why}")


def _read_only_fs(d: str) -> bool:
    try:
        return bool(os.statvfs(d).f_flag & os.ST_RDONLY)
    except OSError:
        return False


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
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only OUT (or file system), a lock file of another user
            raise ConfigError(f"--out {self.out}: cannot open its lock file {self.path} ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(f"--out {self.out}: cannot lock {self.path} ({e.strerror})") from None
            raise ConfigError(
                f"--out {self.out}: in use by another dsv3 train ({_holder(self.path)}); wait for it "
                "to finish or stop it, or pick another --out"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "started": datetime.datetime.now().isoformat(timespec="seconds"),
        }
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
        except OSError as e:  # a full disk: the lock holds, but say why the holder's pid is not recorded
            os.close(fd)
            raise ConfigError(f"--out {self.out}: cannot write {self.path} ({e.strerror})") from None
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


# --- what a previous run left ------------------------------------------------------------------------------


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
        tags = sorted(n for n in os.listdir(ck) if TAG_PATTERN.match(n))
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
    files = [f for f in TOKENIZER_FILES if os.path.lexists(os.path.join(src, f))]  # a FIFO / bad link: refused
    if not files:
        return None
    dst = os.path.join(out, TOKENIZER_DIR)
    tmp = f"{dst}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for f in files:
        copy_regular(os.path.join(src, f), os.path.join(tmp, f), DataError, src)  # the bytes, never a link out
    old = f"{dst}.old{os.getpid()}"
    if os.path.isdir(dst):
        os.replace(dst, old)  # (a directory cannot be renamed over a non-empty one)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
    return dst


# --- one run ---------------------------------------------------------------------------------------------------


class RunDir:
    """What one `dsv3_plugin.deepspeed.train.train()` call does with its run directory: the lock, the config record,
    the resume tag, metrics.jsonl, checkpoint saves (`save`: free space, completion marker, `latest`, keep_last).
    Rank 0 holds the lock and decides (which tag to resume, or which error to raise); every rank gets the same
    decision, so a refusal raises the same error on every rank."""

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
        try:  # several ranks write (and read) one checkpoint: its directory must be the same on every node
            if self.ckpt is not None:
                check_shared_dir(out, "--out")
            if d["resume_probe"] is not None and not self.same_dir:
                check_shared_dir(self.resume_ckpt, "--resume", probe=d["resume_probe"])
        except ConfigError:
            self.close()
            raise

    def _decide(self, out, resume, overwrite) -> dict:
        d = {"resume_ckpt": None, "resume_tag": None, "same_dir": False, "notes": [], "error": None}
        d["resume_probe"] = None  # a file of the resume tag every rank must see (its completion marker)
        try:
            if out:  # lock first: nothing below may read a run directory another process is writing
                self.lock = RunLock(out).acquire()
            if resume:
                d["resume_ckpt"], d["resume_tag"], note = resume_source(resume, self.cfg, self.world, self.data)
                if note:
                    d["notes"].append(note)
                probe = os.path.join(d["resume_tag"] or "", COMPLETE_MARKER)
                if d["resume_tag"] and os.path.isfile(os.path.join(d["resume_ckpt"], probe)):
                    d["resume_probe"] = probe
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
            f.writelines(metrics_line(r) + "\n" for r in rows)
        os.replace(tmp, self.metrics_path)

    def save(self, tag: str, step: int, write: Callable[[], None], module: torch.nn.Module) -> None:
        """Save checkpoint `tag` (step `step`) so that a full disk cannot cost the previous one: free space first,
        a failed write on any rank removes the partial tag and leaves `latest` on the previous checkpoint, then the
        completion marker, `latest`, keep_last (`checkpoint_tags.save_tag`). Collective: every rank calls it, with
        `write` writing this rank's files of the tag (the engine's `save_checkpoint`, which must not write
        `latest`, and its EMA shard).

        Args:
            tag: the tag ("step<N>"); step: the step it holds; write: this rank's writer; module: this rank's
                parameters (the size estimate; nothing is read from it otherwise).

        Raises:
            CheckpointError: on every rank, as `save_tag` says (exit status 2).
        """
        if self.ckpt is None:
            raise RuntimeError("RunDir.save: this run saves no checkpoints (no --out, or save disabled)")
        save_tag(
            self.ckpt,
            tag,
            step,
            write,
            module,
            cfg=self.cfg,
            rank=self.rank,
            world=self.world,
            config_hash=self.config_hash,
            data=self.data,
        )

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
