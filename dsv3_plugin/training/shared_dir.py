"""Is a directory the same directory on every rank? Checkpoints are written by every rank into one tag directory
and the completion marker and `latest` are written by rank 0 after all of them (`checkpoint_tags.save_tag`), so a
run whose ranks sit on several nodes needs a directory all nodes share (a shared file system). Checked before the
first step: rank 0 writes a file with a random token into the directory (temp name, then rename), every rank
reads it back at its own path, and a rank that cannot refuses the run on every rank with one line naming the path.
"""

from __future__ import annotations

import os
import secrets
import socket

import torch.distributed as dist

from dsv3_plugin.errors import ConfigError

__all__ = ["check_shared_dir", "shared_dir_error", "MARKER_PREFIX"]

MARKER_PREFIX = ".dsv3_shared_"  # RUN/.dsv3_shared_<token>: lives only while the check runs


def shared_dir_error(flag: str, seen: list[tuple[bool, str, str]]) -> str | None:
    """The refusal for the ranks that did not find rank 0's marker (None when every rank found it); pure.

    Args:
        flag: the option that named the directory ("--out").
        seen: [world] per rank: (found rank 0's token, host name, the directory as this rank names it).

    Returns:
        A one-line message, or None.
    """
    blind = [r for r, (ok, _, _) in enumerate(seen) if not ok]
    if not blind:
        return None
    r = blind[0]
    _, host, path = seen[r]
    others = f" (and {len(blind) - 1} more rank(s))" if len(blind) > 1 else ""
    differs = f" (rank 0 writes into {seen[0][2]})" if os.path.abspath(path) != os.path.abspath(seen[0][2]) else ""
    return (
        f"{flag} {path}: not shared by all ranks: rank {r} on host {host}{others} does not see the file rank 0 "
        f"wrote there{differs}; every rank writes its part of each checkpoint into {flag}, so a run on several "
        f"nodes needs {flag} on a file system all nodes share, given as the same path on every node"
    )


def check_shared_dir(path: str, flag: str, probe: str | None = None) -> None:
    """Refuse (ConfigError on every rank) a directory that is not the same on every rank. Collective over the
    world; rank 0's `path` must exist and (without `probe`) be writable. No-op in a single process.

    Args:
        path: the directory as this rank names it.
        flag: the option that named it, for the message.
        probe: a file in `path` that rank 0 has (e.g. a checkpoint's completion marker in a directory that is
            only read): its bytes, read by every rank, stand for the token and nothing is written.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    box = [None]
    if dist.get_rank() == 0 and probe is not None:
        try:
            with open(os.path.join(path, probe)) as f:
                box = [(probe, f.read(), None)]
        except OSError as e:
            box = [(probe, None, f"{flag} {path}: cannot read {probe}: {e.strerror or e}")]
    elif dist.get_rank() == 0:
        token = secrets.token_hex(16)
        name = MARKER_PREFIX + token
        tmp = os.path.join(path, name + ".tmp")
        try:
            with open(tmp, "w") as f:
                f.write(token)
            os.replace(tmp, os.path.join(path, name))
            box = [(name, token, None)]
        except OSError as e:
            box = [(name, token, f"{flag} {path}: cannot write into it: {e.strerror or e}")]
    dist.broadcast_object_list(box, src=0)
    name, token, error = box[0]
    if error is not None:
        raise ConfigError(error)
    try:
        with open(os.path.join(path, name)) as f:
            ok = f.read() == token
    except OSError:
        ok = False  # a missing directory or file, or no permission: either way not rank 0's
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (ok, socket.gethostname(), path))  # every rank has read before rank 0 removes
    if dist.get_rank() == 0 and probe is None:
        try:
            os.remove(os.path.join(path, name))
        except OSError:
            pass  # the run goes on; a leftover marker is harmless (a hidden file of the run directory)
    msg = shared_dir_error(flag, seen)
    if msg is not None:
        raise ConfigError(msg)
