"""A `dsv3 train` run directory (`--out`): one run at a time (an fcntl lock), checkpoints that say whether they
are complete (`dsv3_complete.json`, written last, listing every file with its size and CRC-32) and which config
they belong to (`run.json` and its hash), saves that check the free space first and leave the previous checkpoint
intact and `latest` when a write fails (a full disk, a quota, a read-only file system), `dsv3.train.keep_last`,
and a metrics file that survives a crash in the middle of a write and is read strictly.

`RunDir` is what one training call does with all of this; the functions are its pieces (and the CLI's checks
before any rank starts). Layout and reasons: docs/design_notes.md (#training-run-dir).
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import math
import os
import re
import shutil
import sys
import zlib
from collections.abc import Callable

import torch

from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.packed import data_change
from dsv3_plugin.data.tokenizer import TOKENIZER_FILES
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.parallel.distributed import _input_error
from dsv3_plugin.safe_files import copy_regular

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
    "verify_checksums",
    "file_checksum",
    "write_latest",
    "prune_checkpoints",
    "free_bytes",
    "write_failure",
    "read_jsonl",
    "metrics_line",
    "keep_tokenizer",
    "LOCK_FILE",
    "RUN_RECORD",
    "COMPLETE_MARKER",
    "CHECKSUM_ALGORITHM",
]

LOCK_FILE = ".dsv3.lock"
RUN_RECORD = "run.json"
COMPLETE_MARKER = "dsv3_complete.json"
CHECKSUM_ALGORITHM = "crc32"  # zlib's CRC-32: detects changed bytes at disk speed (not a defence against forgery)
_CHECKSUM_CHUNK = 8 << 20  # bytes read per step: large enough to run at disk speed, small enough to hold anywhere
TOKENIZER_DIR = "tokenizer"  # RUN/tokenizer: the run's tokenizer files (what the export step ships with the model)
_OUR_FILES = (RUN_RECORD, "metrics.jsonl", "train.png", "routing.png")
_TAG = re.compile(r"^step(\d+)$")


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


# --- checkpoint completeness -----------------------------------------------------------------------------------


def file_checksum(path: str) -> str:
    """The CRC-32 (`CHECKSUM_ALGORITHM`) of the file at `path` as 8 hex digits, read in 8 MiB chunks.

    Args:
        path: a regular file.

    Returns:
        e.g. "1c291ca3".
    """
    crc = 0
    buf = bytearray(_CHECKSUM_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _tag_files(d: str) -> list[str]:
    """The files of a tag directory (relative paths, sorted), without the marker and temporary files."""
    out = []
    for root, _, names in os.walk(d):
        for n in names:
            if n == COMPLETE_MARKER or ".tmp" in n:
                continue
            out.append(os.path.relpath(os.path.join(root, n), d))
    return sorted(out)


def mark_complete(
    ckpt: str,
    tag: str,
    step: int,
    world: int,
    config_hash: str,
    data: dict | None = None,
    checksums: dict[str, str] | None = None,
) -> None:
    """Rank 0, after a barrier that follows every rank's last file of `tag`: record every file with its size and
    CRC-32, and the fingerprint of the data the run reads (`data`, see `dsv3_plugin.data.packed.data_change`);
    written atomically.

    Args:
        ckpt, tag: the checkpoint directory and the tag whose files are recorded.
        step, world, config_hash: the step saved, the ranks that saved it, the run's config identity hash.
        data: the data fingerprint (None: not recorded).
        checksums: {relative path: CRC-32 hex} already computed (e.g. by every rank for a share of the files);
            files it does not cover are read here.
    """
    d = os.path.join(ckpt, tag)
    rels = _tag_files(d)
    files = {rel: os.path.getsize(os.path.join(d, rel)) for rel in rels}
    given = checksums or {}
    sums = {rel: given[rel] if rel in given else file_checksum(os.path.join(d, rel)) for rel in rels}
    rec = {
        "tag": tag,
        "step": step,
        "world_size": world,
        "config_hash": config_hash,
        "files": files,
        "checksum_algorithm": CHECKSUM_ALGORITHM,
        "checksums": sums,
    }
    if data is not None:
        rec["data"] = data
    _atomic_json(rec, os.path.join(d, COMPLETE_MARKER))


def read_marker(ckpt: str, tag: str) -> dict | None:
    """The completion marker of `tag`, or None when it is missing or not a valid one. Markers written before
    checksums existed have no "checksums" (their files are checked by size only)."""
    try:
        with open(os.path.join(ckpt, tag, COMPLETE_MARKER)) as f:
            m = json.load(f)
        files, _, _ = m["files"], m["step"], m["config_hash"]
        if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in files.items()):
            return None
        if "checksums" in m:
            sums = m["checksums"]
            if m.get("checksum_algorithm") != CHECKSUM_ALGORITHM or set(sums) != set(files):
                return None
            if not all(isinstance(v, str) for v in sums.values()):
                return None
        return m
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
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


def _complete_tags(ckpt: str, exclude: str | None = None) -> list[tuple[int, str]]:
    """(step, tag) of every complete `step<N>` tag (marker valid, sizes as recorded), oldest first."""
    tags = []
    if os.path.isdir(ckpt):
        for n in os.listdir(ckpt):
            m = _TAG.match(n)
            if m and n != exclude and tag_problem(ckpt, n) is None:
                tags.append((int(m.group(1)), n))
    return sorted(tags)


def verify_checksums(ckpt: str, tag: str) -> None:
    """CheckpointError unless every file of complete checkpoint `tag` still has the CRC-32 its completion marker
    recorded (a file changed in place after the save: bit rot, a copy gone wrong, a zeroed optimizer file). Not a
    fallback case: the error names the tag, the file and both checksums, and says to delete the tag to resume
    from the previous complete checkpoint. Markers without checksums (older saves) pass: sizes were checked."""
    m = read_marker(ckpt, tag)
    if m is None or "checksums" not in m:
        return
    d = os.path.join(ckpt, tag)
    for rel in sorted(m["checksums"]):
        want = m["checksums"][rel]
        try:
            got = file_checksum(os.path.join(d, rel))
        except OSError as e:
            raise CheckpointError(f"{d}: cannot read {rel} to check it ({e.strerror})") from None
        if got != want:
            older = [t for s, t in _complete_tags(ckpt, exclude=tag) if s < _step_of(tag)]
            prev = f"the previous complete checkpoint, {older[-1]}" if older else "an earlier checkpoint (none is left)"
            raise CheckpointError(
                f"{d}: checkpoint {tag} is corrupt: {rel} has {CHECKSUM_ALGORITHM} {got}, but {want} was recorded "
                f"when it was saved (the file changed since); delete the directory {d} to resume from {prev}"
            )


def _step_of(tag: str) -> int:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else -1


def _legacy_ok(ckpt: str, tag: str) -> bool:
    """A checkpoint written before completion markers existed: trust DeepSpeed's pointer if its files are there."""
    return bool(tag) and os.path.isfile(os.path.join(ckpt, tag, "mp_rank_00_model_states.pt"))


def resolve_resume(ckpt: str, run_root: str | None, verify: bool = True) -> tuple[str, str | None]:
    """The tag to resume from and a note for stderr when it is not the one `latest` names.

    `latest` is used when it names a complete tag. If it is missing, empty, or names a missing or incomplete
    tag, the newest complete `step<N>` tag is used instead (with a note); none -> CheckpointError saying what to
    do. The tag chosen must pass `verify_checksums` (a corrupt file is a CheckpointError, never a silent fallback;
    `verify=False` skips that read of the whole checkpoint, for a precheck whose run verifies it again).
    Runs without `run.json` (written before completion markers) keep DeepSpeed's rule: trust `latest`.
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
            if verify:
                verify_checksums(ckpt, latest)
            return latest, None
        problem = f"'latest' names {problem}"
    else:
        problem = "'latest' is empty" if latest == "" else "there is no 'latest' file"
    tags = _complete_tags(ckpt)
    if not tags:
        raise CheckpointError(
            f"--resume {ckpt}: no complete checkpoint to resume from ({problem}); start a new "
            "run (another --out, or --overwrite to replace this one) or resume another run"
        )
    tag = max(tags)[1]
    if verify:
        verify_checksums(ckpt, tag)
    return tag, f"dsv3 train: {ckpt}: {problem}; resuming from {tag}, the newest complete checkpoint"


# --- saving: free space, failed writes, `latest`, keep_last ---------------------------------------------------


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system holding `path` (its nearest existing
    ancestor when `path` does not exist yet)."""
    head = os.path.abspath(path)
    while not os.path.exists(head) and head != os.path.dirname(head):
        head = os.path.dirname(head)
    return shutil.disk_usage(head).free


# What torch's zip writer (PytorchStreamWriter) raises when the bytes did not reach the file: it drops the errno
# (e.g. ENOSPC gives "unexpected pos 5120 vs 5012").
_ZIP_WRITE_FAILED = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")


def write_failure(e: BaseException) -> str | None:
    """What failed, if `e` (or an exception it was raised from or during) is a failed file write: an OSError
    (ENOSPC, EDQUOT, EROFS, EFBIG, EACCES, ...) -> "<strerror> (<filename>)"; torch's zip writer's RuntimeError
    -> a sentence saying so. None for anything else (a bug, not the disk).

    Args:
        e: the exception a save raised.

    Returns:
        The description, or None.
    """
    seen = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        if isinstance(x, OSError):
            what = x.strerror or str(x) or type(x).__name__
            return f"{what} ({x.filename})" if x.filename else what
        if isinstance(x, RuntimeError):
            msg = str(x)
            hit = next((ln for ln in msg.splitlines() if any(k in ln for k in _ZIP_WRITE_FAILED)), None)
            if hit is not None:
                return f"torch's checkpoint writer could not write a file ({hit.strip()})"
        x = x.__cause__ or x.__context__
    return None


def write_latest(ckpt: str, tag: str) -> None:
    """`ckpt/latest` := `tag`, atomically (a temporary file renamed over it): a failure leaves the old pointer."""
    path = os.path.join(ckpt, "latest")
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink(tmp)
        raise


def _read_latest(ckpt: str) -> str | None:
    try:
        with open(os.path.join(ckpt, "latest"), errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _remove_tag(d: str) -> None:
    """Delete tag directory `d`: its marker first, so that a crash in the middle leaves an incomplete tag (never
    resumed), not a marker naming files that are gone."""
    if not os.path.isdir(d):
        return
    _unlink(os.path.join(d, COMPLETE_MARKER))
    shutil.rmtree(d)


def prune_checkpoints(ckpt: str, keep_last: int, current: str) -> list[str]:
    """`dsv3.train.keep_last` after checkpoint `current` was completed: delete every `step<N>` tag directory
    without a valid completion (a save that never finished: never resumable) and, with keep_last = N > 0, the
    complete tags older than `current` beyond the newest N (`current` included in the N). Never `current`, never
    a tag newer than it (another timeline's, left to be overwritten), never anything but `step<N>` directories.

    Args:
        ckpt: the checkpoint directory; keep_last: N (0 = keep every complete tag); current: the tag just saved.

    Returns:
        The tags deleted, oldest first.
    """
    cur = _step_of(current)
    gone, complete = [], []
    for n in sorted(os.listdir(ckpt), key=_step_of):
        if not _TAG.match(n) or n == current or not os.path.isdir(os.path.join(ckpt, n)):
            continue
        if tag_problem(ckpt, n) is not None:
            gone.append(n)
        elif _step_of(n) < cur:
            complete.append(n)
    if keep_last > 0:
        gone += complete[: max(0, len(complete) - (keep_last - 1))]
    gone.sort(key=_step_of)
    for n in gone:
        _remove_tag(os.path.join(ckpt, n))
    return gone


def _estimate_bytes(module: torch.nn.Module, cfg, world: int) -> int:
    """This rank's share of a checkpoint estimated from its parameters: per parameter its weights (in their dtype)
    + the FP32 master copy + two FP32 Adam moments (+ an FP32 EMA copy under memory.ema), divided by the number of
    ranks holding that parameter (dense: the data-parallel ranks, dp = world / pp; experts: dp / ep), so that the
    sum over ranks counts each parameter once. Pickle framing, RNG states and client state are not counted."""
    dp = max(1, world // max(1, cfg.parallel.pp))
    per_param = 12 + (4 if cfg.memory.ema else 0)
    total = 0.0
    for p in module.parameters():
        holders = dp if getattr(p, "allreduce", True) else max(1, dp // max(1, cfg.parallel.ep))
        total += p.numel() * (p.element_size() + per_param) / holders
    return math.ceil(total)


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 1e9:.3f} GB)" if n >= 10**7 else f"{n} bytes"


def checkpoint_dir(path: str | os.PathLike) -> str:
    """A run's OUT dir or its `ckpt/` dir -> the DeepSpeed checkpoint dir (the one with `latest` and the tags)."""
    path = os.fspath(path)
    sub = os.path.join(path, "ckpt")
    return sub if os.path.isdir(sub) else path


def resume_source(
    resume: str, cfg, world: int | None = None, data: dict | None = None, verify: bool = True
) -> tuple[str, str, str | None]:
    """(checkpoint dir, tag, note) to resume from, after checking the checkpoint is complete, belongs to this
    config and (when `world` is given) was saved by as many ranks as this run has: ZeRO-1's optimizer partitions
    and the per-rank RNG states do not carry over to another count (CheckpointError saying what to do). With
    `data` (this run's data fingerprint): the checkpoint's data position means the same rows only on the same
    data, so other data is refused (DataError naming the key that differs). `verify`: check every file's
    checksum (`verify_checksums`; False: sizes only, for the launcher's precheck — rank 0 verifies again)."""
    ck = checkpoint_dir(resume)
    if not os.path.isdir(ck):
        raise CheckpointError(f"--resume {resume}: no DeepSpeed checkpoint here (no ckpt/ dir, no 'latest')")
    root = os.path.dirname(os.path.abspath(ck)) if os.path.basename(os.path.normpath(ck)) == "ckpt" else ck
    tag, note = resolve_resume(ck, root, verify)
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


class _NotFinite(Exception):
    """A JSON number that is not a finite float (NaN, Infinity, 1e400): not JSON a metrics line may hold."""


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _NotFinite(f"{text} is not a finite number")
    return x


def _no_constant(name: str):
    raise _NotFinite(f"{name} is not a finite number")


# Keys of a metrics line the plugin reads back (plots, summaries, --resume): a number or null each.
_NUMBER_KEYS = (
    "loss",
    "lm_loss",
    "mtp_loss",
    "balance_loss",
    "maxvio",
    "maxvio_batch",
    "maxvio_global",
    "gamma",
    "lr",
    "grad_norm",
    "eval_loss",
    "tokens_per_s",
    "tokens_seen",
    "cross_node_per_token",
    "tokens_dropped",
)
_LAYER_NUMBER_KEYS = ("maxvio_batch", "maxvio_global", "cross_node_per_token", "tokens_dropped")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _row_problem(row, experts: dict) -> str | None:
    """Why `row` is not a metrics line (None: it is one). `experts`: {MoE layer: number of experts} of the lines
    before, filled here (every line's expert loads must have one length per layer, the same set of layers)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"'step' must be an integer >= 0 (got {json.dumps(step)})" if "step" in row else "no 'step'"
    for k in _NUMBER_KEYS:
        if k in row and row[k] is not None and not _is_number(row[k]):
            return f"{k!r} must be a number or null (got {_short(row[k])})"
    if "maxvio_layers" in row and not (
        isinstance(row["maxvio_layers"], list) and all(_is_number(v) for v in row["maxvio_layers"])
    ):
        return "'maxvio_layers' must be a list of numbers"
    layers = row.get("moe_layers")
    if layers is None:
        return None
    if not isinstance(layers, dict) or not layers:
        return f"'moe_layers' must be an object of MoE layers (got {_short(layers)})"
    if experts and set(layers) != set(experts):
        return f"'moe_layers' names layers {sorted(layers)}, the lines before named {sorted(experts)}"
    for name, lay in layers.items():
        where = f"moe_layers[{name!r}]"
        if not isinstance(lay, dict):
            return f"{where} must be an object (got {_short(lay)})"
        loads = lay.get("loads")
        if not isinstance(loads, list) or not loads or not all(_is_number(v) and v >= 0 for v in loads):
            return f"{where}['loads'] must be a non-empty list of numbers >= 0 (got {_short(loads)})"
        if experts.setdefault(name, len(loads)) != len(loads):
            return f"{where}['loads'] has {len(loads)} experts, the lines before had {experts[name]}"
        for k in _LAYER_NUMBER_KEYS:
            if lay.get(k) is not None and not _is_number(lay[k]):
                return f"{where}[{k!r}] must be a number or null (got {_short(lay[k])})"
    return None


def _short(v) -> str:
    t = json.dumps(v)
    return t if len(t) <= 60 else t[:57] + "..."


def read_jsonl(path: str) -> tuple[list[dict], str | None]:
    """The lines of a metrics.jsonl, strictly: each must be a JSON object with an integer `step`, finite numbers
    only (no NaN / Infinity / overflowing literals), numbers (or null) where the plugin reads numbers, and
    `moe_layers` (routing telemetry) with the same layers and one expert count per layer on every line.

    Args:
        path: the file.

    Returns:
        (the rows, a note when its last line was torn — an interrupted write — and dropped; None otherwise; the
        caller decides whether to rewrite the file).

    Raises:
        ConfigError: "PATH:LINE: what is wrong" for the first bad line (a torn line before the last included).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    lines = raw.split(b"\n")
    rows, torn, experts = [], None, {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line, parse_float=_finite_float, parse_constant=_no_constant)
        except _NotFinite as e:
            raise ConfigError(f"{where}: {e}; metrics lines hold finite numbers (null for none)") from None
        except RecursionError:
            raise ConfigError(f"{where}: nested too deeply to be a metrics line") from None
        except (ValueError, UnicodeDecodeError) as e:
            if any(x.strip() for x in lines[i + 1 :]):
                raise ConfigError(
                    f"{where}: not a JSON line ({e}); only a torn last line is dropped "
                    "automatically — remove or fix this one"
                ) from None
            torn = f"dropped a torn last line of {path} ({len(line)} bytes; the write was interrupted)"
            continue
        problem = _row_problem(row, experts)
        if problem:
            raise ConfigError(f"{where}: not a metrics line: {problem}")
        rows.append(row)
    return rows, torn


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def metrics_line(rec: dict) -> str:
    """`rec` as one metrics.jsonl line (no newline) that `read_jsonl` reads back: strict JSON, a non-finite float
    (a diverged loss, an overflowed gradient norm) written as null.

    Args:
        rec: the step's metrics.

    Returns:
        The JSON text.
    """
    return json.dumps(_json_safe(rec), allow_nan=False)


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
            f.writelines(metrics_line(r) + "\n" for r in rows)
        os.replace(tmp, self.metrics_path)

    def save(self, tag: str, step: int, write: Callable[[], None], module: torch.nn.Module) -> None:
        """Save checkpoint `tag` (step `step`) so that a full disk cannot cost the previous one. Collective: every
        rank calls it, with `write` writing this rank's files of the tag (the engine's `save_checkpoint`, which
        must not write `latest`, and its EMA shard).

        1. Free space, before anything is written: every rank checks the file system of the checkpoint directory
           against the expected size (the newest complete checkpoint's files; without one, an estimate from the
           parameters, see `_estimate_bytes`); too little on any rank -> CheckpointError on every rank naming the
           directory, the bytes needed and the bytes free. Space that `keep_last` frees after the save does not
           count. A stale directory of the same tag (an interrupted run's) is deleted first.
        2. `write()`; a failed write on any rank (OSError: ENOSPC, EDQUOT, EROFS, EFBIG, EACCES, ...; torch's zip
           writer's RuntimeError) -> rank 0 deletes the partial tag directory, `latest` keeps naming the previous
           checkpoint, and every rank raises CheckpointError naming the rank, the error, the bytes needed and free.
        3. `complete`: the marker with every file's size and CRC-32 (the ranks share the reading), then `latest`
           (atomically), then `keep_last` (`prune_checkpoints`).

        Args:
            tag: the tag ("step<N>"); step: the step it holds; write: this rank's writer; module: this rank's
                parameters (the size estimate; nothing is read from it otherwise).

        Raises:
            CheckpointError: on every rank, as above (exit status 2).
        """
        if self.ckpt is None:
            raise RuntimeError("RunDir.save: this run saves no checkpoints (no --out, or save disabled)")
        ckpt, d = self.ckpt, os.path.join(self.ckpt, tag)
        stale = 0
        if self.rank == 0:
            try:
                _remove_tag(d)
            except OSError:
                stale = 1
        before = _read_latest(ckpt) if self.rank == 0 else None
        prev = _complete_tags(ckpt, exclude=tag)
        prev_bytes = sum(read_marker(ckpt, prev[-1][1])["files"].values()) if prev else 0
        own = 0 if prev else _estimate_bytes(module, self.cfg, self.world)
        rows = self._gather_ints([free_bytes(ckpt), own, prev_bytes, stale])  # also: rank 0's deletion is done
        after = self._after_failure_text(prev)
        if rows[0][3]:
            raise CheckpointError(
                f"saving checkpoint {tag} into {ckpt}: a directory {d} of an earlier run is in the way and cannot "
                f"be deleted; delete it and resume; nothing was written, {after}"
            )
        need = rows[0][2] or sum(r[1] for r in rows)  # rank 0's view decides: every rank the same number
        basis = f"the size of {prev[-1][1]}" if rows[0][2] and prev else "estimated from the parameters"
        low = min(range(len(rows)), key=lambda r: rows[r][0])
        if rows[low][0] < need:
            on = f" (as rank {low} sees it)" if len(rows) > 1 else ""
            raise CheckpointError(
                f"saving checkpoint {tag} into {ckpt}: it needs about {_bytes(need)} ({basis}), only "
                f"{_bytes(rows[low][0])} are free there{on}; free some space (or set dsv3.train.keep_last to keep "
                f"fewer checkpoints) and resume; nothing was written, {after}"
            )
        failure = None
        try:
            write()
        except (OSError, RuntimeError) as e:
            failure = write_failure(e)
            if failure is None:
                raise
            if "torch's checkpoint writer" in failure:  # no errno: say what the disk holds now
                failure += f"; {_bytes(free_bytes(ckpt))} are free in {ckpt} now"
        failures = self._gather_objects(failure)
        bad = next((r for r, f in enumerate(failures) if f is not None), None)
        if bad is not None:
            if self.rank == 0:
                self._undo(d, tag, before)
            self._barrier()  # the partial files are gone before any rank exits
            raise CheckpointError(
                f"saving checkpoint {tag} into {ckpt} failed on rank {bad}: {failures[bad]}; it needed about "
                f"{_bytes(need)}, {_bytes(rows[bad][0])} were free; the partial {tag} was removed, {after}"
            )
        self._complete(tag, step, before, after)

    def _after_failure_text(self, prev: list[tuple[int, str]]) -> str:
        latest = _read_latest(self.ckpt)
        if latest and tag_problem(self.ckpt, latest) is None:
            return f"the previous checkpoint {latest} is intact and still the latest"
        if prev:
            return f"the previous complete checkpoint {prev[-1][1]} is intact (--resume picks it)"
        return "there is no earlier checkpoint to resume from"

    def _undo(self, d: str, tag: str, before: str | None) -> None:
        """Rank 0 after a failed save: the partial tag goes, and `latest` names what it named before."""
        try:
            _remove_tag(d)
        except OSError as e:
            print(f"dsv3 train: could not delete the partial {d} ({e.strerror}); delete it", file=sys.stderr)
        now = _read_latest(self.ckpt)
        if now == tag:  # an engine wrote it after all: put the previous pointer back
            try:
                if before:
                    write_latest(self.ckpt, before)
                else:
                    os.remove(os.path.join(self.ckpt, "latest"))
            except OSError as e:
                print(f"dsv3 train: could not restore {self.ckpt}/latest ({e.strerror})", file=sys.stderr)

    def _complete(self, tag: str, step: int, before: str | None, after: str) -> None:
        """Every rank checksums a share of the tag's files; rank 0 writes the marker, then `latest`, then prunes.
        A failure there (the disk filled by the marker itself) removes the tag like a failed write."""
        ckpt, d = self.ckpt, os.path.join(self.ckpt, tag)
        box = [_tag_files(d) if self.rank == 0 else None]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        mine, err = {}, None
        try:
            for rel in box[0][self.rank :: self.world]:
                mine[rel] = file_checksum(os.path.join(d, rel))
        except OSError as e:
            err = f"{e.strerror} ({e.filename})"
        shares = self._gather_objects((mine, err))
        err = next((e for _, e in shares if e), None)
        if self.rank == 0 and err is None:
            sums = {k: v for m, _ in shares for k, v in m.items()}
            try:
                mark_complete(ckpt, tag, step, self.world, self.config_hash, self.data, checksums=sums)
                write_latest(ckpt, tag)
            except OSError as e:
                err = write_failure(e)
        if self.rank == 0 and err is not None:
            self._undo(d, tag, before)
        if self.rank == 0 and err is None:
            try:
                prune_checkpoints(ckpt, self.cfg.train.keep_last, tag)
            except OSError as e:  # the new checkpoint is complete: say so, and what is left to delete
                print(
                    f"dsv3 train: {ckpt}: could not delete an old checkpoint for dsv3.train.keep_last "
                    f"({e.strerror}: {e.filename}); delete it by hand",
                    file=sys.stderr,
                    flush=True,
                )
        box = [err]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(box, src=0)
        if box[0] is not None:
            raise CheckpointError(
                f"completing checkpoint {tag} in {ckpt} failed: {box[0]}; the partial {tag} was removed, {after}"
            )

    def _collective_device(self) -> torch.device:
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (int64), rank order; one all-gather."""
        if not torch.distributed.is_initialized():
            return [list(values)]
        t = torch.tensor(values, dtype=torch.int64, device=self._collective_device())
        out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(out, t)
        return [x.cpu().tolist() for x in out]

    def _gather_objects(self, obj) -> list:
        """Every rank's `obj` (strings, dicts of this job's ranks: never bytes from outside), rank order."""
        if not torch.distributed.is_initialized():
            return [obj]
        out = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(out, obj)
        return out

    def _barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None
