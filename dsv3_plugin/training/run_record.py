"""Which config a run directory and its checkpoints belong to: the config identity (the sections of a DSv3Config
that decide what a checkpoint holds: tensor shapes, which experts exist, how state is partitioned), its hash,
the run record `run.json` that holds both, and the refusal to resume a checkpoint written for another identity
(naming the first key that differs).

Training knobs (γ / λ schedules, α, lr, steps, fp8, recompute, EMA decay, seed) are not part of the identity: they
may change on resume. The files are written atomically (`write_json_atomic`: a temporary file, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
import os

from dsv3_plugin.errors import CheckpointError

__all__ = [
    "config_identity",
    "identity_hash",
    "write_run_record",
    "read_run_record",
    "check_identity",
    "write_text_atomic",
    "write_json_atomic",
    "RUN_RECORD",
]

RUN_RECORD = "run.json"


def write_text_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same directory (flushed, fsync-ed, renamed over
    `path`): a crash or a full disk leaves the old file or the new one, never half of one, and no temporary file.

    Args:
        path: the file; text: its new content.
    """
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_json_atomic(path: str, obj) -> None:
    """`obj` as JSON (indented, keys sorted) at `path`, atomically (`write_text_atomic`).

    Args:
        path: the file; obj: a JSON-serialisable object.
    """
    write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


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
    """The first 16 hex digits of the SHA-256 of `ident` as canonical JSON (keys sorted, no spaces): what the
    completion markers and `run.json` record."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def write_run_record(out: str, cfg, world: int) -> dict:
    """Write OUT/run.json (atomically): the config identity of `cfg`, its hash, and the number of ranks.

    Args:
        out: the run directory; cfg: the run's DSv3Config; world: the number of ranks.

    Returns:
        The record written.
    """
    ident = config_identity(cfg)
    rec = {"config_hash": identity_hash(ident), "world_size": world, "identity": ident}
    write_json_atomic(os.path.join(out, RUN_RECORD), rec)
    return rec


def read_run_record(run_root: str) -> dict | None:
    """RUN_ROOT/run.json, or None when there is none (a run written before run records existed); CheckpointError
    naming the file when it is not a run record."""
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
