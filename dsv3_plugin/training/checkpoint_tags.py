"""Complete checkpoints of a `dsv3 train` run: what makes a tag resumable, which tag `--resume` picks, and a save
that a full disk cannot turn into a lost run.

A tag (`ckpt/step<N>/`) is complete when its completion marker `dsv3_complete.json` is valid and every file it
lists is there with the size recorded. The marker is written by rank 0 after every rank's last file of the tag
(the engine's files and the EMA shards), and lists every file with its size and its CRC-32 (zlib's, 8 hex digits:
it detects bytes changed since the save, at disk speed; it is no defence against forgery). A tag without a valid
marker is a save that did not finish: never resumed, deleted by the next save's `keep_last`. `--resume` reads
every file's checksum again before the run starts: a changed file is refused by name (never skipped for an older
tag in silence).

Design notes: docs/design_notes.md#training-checkpoint-tags
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import zlib
from collections.abc import Callable
from typing import NamedTuple

import torch

from dsv3_plugin.data.packed import data_change
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.training.run_record import check_identity, read_run_record, write_json_atomic, write_text_atomic

__all__ = [
    "checkpoint_dir",
    "resume_source",
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
    "save_tag",
    "COMPLETE_MARKER",
    "CHECKSUM_ALGORITHM",
    "TAG_PATTERN",
]

COMPLETE_MARKER = "dsv3_complete.json"
CHECKSUM_ALGORITHM = "crc32"  # zlib's CRC-32: detects changed bytes at disk speed (not a defence against forgery)
_CHECKSUM_CHUNK = 8 << 20  # bytes read per step: large enough to run at disk speed, small enough to hold anywhere
TAG_PATTERN = re.compile(r"^step(\d+)$")  # the tags dsv3 train writes (and the only directories keep_last deletes)


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
    write_json_atomic(os.path.join(d, COMPLETE_MARKER), rec)


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
            m = TAG_PATTERN.match(n)
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
    m = TAG_PATTERN.match(tag)
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
    write_text_atomic(os.path.join(ckpt, "latest"), tag)


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
        if not TAG_PATTERN.match(n) or n == current or not os.path.isdir(os.path.join(ckpt, n)):
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


# --- one save, on every rank -----------------------------------------------------------------------------------


class _SaveJob(NamedTuple):
    """What the completion of a save needs to know of the run (`save_tag`'s arguments)."""

    ckpt: str
    rank: int
    world: int
    keep_last: int
    config_hash: str
    data: dict | None


def save_tag(
    ckpt: str,
    tag: str,
    step: int,
    write: Callable[[], None],
    module: torch.nn.Module,
    *,
    cfg,
    rank: int,
    world: int,
    config_hash: str,
    data: dict | None = None,
) -> None:
    """Save checkpoint `tag` (step `step`) into `ckpt` so that a full disk cannot cost the previous one.
    Collective: every rank calls it, with `write` writing this rank's files of the tag (the engine's
    `save_checkpoint`, which must not write `latest`, and its EMA shard).

    1. Free space, before anything is written: every rank checks the file system of the checkpoint directory
       against the expected size (the newest complete checkpoint's files; without one, an estimate from the
       parameters, see `_estimate_bytes`); too little on any rank -> CheckpointError on every rank naming the
       directory, the bytes needed and the bytes free. Space that `keep_last` frees after the save does not
       count. A stale directory of the same tag (an interrupted run's) is deleted first.
    2. `write()`; a failed write on any rank (OSError: ENOSPC, EDQUOT, EROFS, EFBIG, EACCES, ...; torch's zip
       writer's RuntimeError) -> rank 0 deletes the partial tag directory, `latest` keeps naming the previous
       checkpoint, and every rank raises CheckpointError naming the rank, the error, the bytes needed and free.
    3. Completion: the marker with every file's size and CRC-32 (the ranks share the reading), then `latest`
       (atomically), then `keep_last` (`prune_checkpoints`).

    Args:
        ckpt: the checkpoint directory; tag: the tag ("step<N>"); step: the step it holds; write: this rank's
            writer; module: this rank's parameters (the size estimate; nothing is read from it otherwise).
        cfg: the run's DSv3Config (`train.keep_last`, the size estimate); rank, world: this rank and the ranks
            saving; config_hash: the run's config identity hash; data: the data fingerprint the marker records.

    Raises:
        CheckpointError: on every rank, as above (exit status 2).
    """
    d = os.path.join(ckpt, tag)
    stale = 0
    if rank == 0:
        try:
            _remove_tag(d)
        except OSError:
            stale = 1
    before = _read_latest(ckpt) if rank == 0 else None
    prev = _complete_tags(ckpt, exclude=tag)
    prev_bytes = sum(read_marker(ckpt, prev[-1][1])["files"].values()) if prev else 0
    own = 0 if prev else _estimate_bytes(module, cfg, world)
    rows = _gather_ints([free_bytes(ckpt), own, prev_bytes, stale])  # also: rank 0's deletion is done
    after = _after_failure_text(ckpt, prev)
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
    failures = _gather_objects(failure)
    bad = next((r for r, f in enumerate(failures) if f is not None), None)
    if bad is not None:
        if rank == 0:
            _undo(ckpt, tag, before)
        _barrier()  # the partial files are gone before any rank exits
        raise CheckpointError(
            f"saving checkpoint {tag} into {ckpt} failed on rank {bad}: {failures[bad]}; it needed about "
            f"{_bytes(need)}, {_bytes(rows[bad][0])} were free; the partial {tag} was removed, {after}"
        )
    _complete(_SaveJob(ckpt, rank, world, cfg.train.keep_last, config_hash, data), tag, step, before, after)


def _after_failure_text(ckpt: str, prev: list[tuple[int, str]]) -> str:
    latest = _read_latest(ckpt)
    if latest and tag_problem(ckpt, latest) is None:
        return f"the previous checkpoint {latest} is intact and still the latest"
    if prev:
        return f"the previous complete checkpoint {prev[-1][1]} is intact (--resume picks it)"
    return "there is no earlier checkpoint to resume from"


def _undo(ckpt: str, tag: str, before: str | None) -> None:
    """Rank 0 after a failed save: the partial tag goes, and `latest` names what it named before."""
    d = os.path.join(ckpt, tag)
    try:
        _remove_tag(d)
    except OSError as e:
        print(f"dsv3 train: could not delete the partial {d} ({e.strerror}); delete it", file=sys.stderr)
    now = _read_latest(ckpt)
    if now == tag:  # an engine wrote it after all: put the previous pointer back
        try:
            if before:
                write_latest(ckpt, before)
            else:
                os.remove(os.path.join(ckpt, "latest"))
        except OSError as e:
            print(f"dsv3 train: could not restore {ckpt}/latest ({e.strerror})", file=sys.stderr)


def _complete(job: _SaveJob, tag: str, step: int, before: str | None, after: str) -> None:
    """Every rank checksums a share of the tag's files; rank 0 writes the marker, then `latest`, then prunes.
    A failure there (the disk filled by the marker itself) removes the tag like a failed write."""
    ckpt, rank, world = job.ckpt, job.rank, job.world
    d = os.path.join(ckpt, tag)
    box = [_tag_files(d) if rank == 0 else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(box, src=0)
    mine, err = {}, None
    try:
        for rel in box[0][rank::world]:
            mine[rel] = file_checksum(os.path.join(d, rel))
    except OSError as e:
        err = f"{e.strerror} ({e.filename})"
    shares = _gather_objects((mine, err))
    err = next((e for _, e in shares if e), None)
    if rank == 0 and err is None:
        sums = {k: v for m, _ in shares for k, v in m.items()}
        try:
            mark_complete(ckpt, tag, step, world, job.config_hash, job.data, checksums=sums)
            write_latest(ckpt, tag)
        except OSError as e:
            err = write_failure(e)
    if rank == 0 and err is not None:
        _undo(ckpt, tag, before)
    if rank == 0 and err is None:
        try:
            prune_checkpoints(ckpt, job.keep_last, tag)
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


def _collective_device() -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_ints(values: list[int]) -> list[list[int]]:
    """Every rank's `values` (int64), rank order; one all-gather."""
    if not torch.distributed.is_initialized():
        return [list(values)]
    t = torch.tensor(values, dtype=torch.int64, device=_collective_device())
    out = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, t)
    return [x.cpu().tolist() for x in out]


def _gather_objects(obj) -> list:
    """Every rank's `obj` (strings, dicts of this job's ranks: never bytes from outside), rank order."""
    if not torch.distributed.is_initialized():
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
