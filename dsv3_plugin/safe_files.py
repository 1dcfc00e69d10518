"""Reading files out of a directory someone else filled: regular files only, and only inside that directory.

A checkpoint, run or tokenizer directory is untrusted input, and its *entries* are too: a symbolic link can point
anywhere (a `tokenizer.json` linked to a private key would be copied into an exported model), so a file is read
only when its real path lies inside the directory's real path; `open()` of a FIFO blocks forever and a device can
stream without end, so a file is read only when it is a regular file, checked with `os.stat`, opened with
`O_NONBLOCK | O_NOFOLLOW` and `fstat`-ed again (same device and inode as checked), or nothing is read.

NOTE: one kind of link out is allowed: a Hugging Face hub cache snapshot (`.../models--ORG--NAME/snapshots/REV/`)
may read files whose real path lies in the same repository's `blobs/`, as `snapshot_download` lays them out.

Design notes: docs/design_notes.md#safe-files
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import BinaryIO

__all__ = [
    "check_regular",
    "check_entries",
    "open_regular",
    "opened_path",
    "copy_regular",
    "read_regular",
    "hf_blob_store",
]

_HUB_REPO_PREFIXES = ("models--", "datasets--", "spaces--")  # huggingface_hub's cache layout: <type>s--org--name
_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def hf_blob_store(real_dir: str) -> str | None:
    """The blob store (`<repo>/blobs`) a Hugging Face hub cache snapshot directory may link into, or None.

    Args:
        real_dir: a directory's real path (`os.path.realpath`).

    Returns:
        `<repo>/blobs` when `real_dir` is `<repo>/snapshots/<rev>` or below it and `<repo>`'s name is a hub cache
        repository's (`models--…`, `datasets--…`, `spaces--…`); None otherwise.
    """
    d = real_dir
    while True:
        parent = os.path.dirname(d)
        if parent == d:
            return None
        repo = os.path.dirname(parent)
        if os.path.basename(parent) == "snapshots" and os.path.basename(repo).startswith(_HUB_REPO_PREFIXES):
            return os.path.join(repo, "blobs")
        d = parent


def _inside(real: str, real_root: str) -> bool:
    return real != real_root and os.path.commonpath([real, real_root]) == real_root


def _resolve(path: str, root: str | None, error_cls: type) -> str:
    """The real path of `path`, refused (error_cls) when it leaves `root` (see the module docstring)."""
    real = os.path.realpath(path)
    if root is None:
        return real
    real_root = os.path.realpath(root)
    if _inside(real, real_root):
        return real
    blobs = hf_blob_store(real_root)
    if blobs is not None and _inside(real, blobs):
        return real
    raise error_cls(
        f"{path}: resolves to {real}, outside {root} (a link out of the directory; only files inside it are read)"
    )


def check_regular(
    path: str | os.PathLike, error_cls: type, root: str | os.PathLike | None = None, what: str = ""
) -> str:
    """Check, without opening it, that `path` is a regular file (links followed) inside directory `root`.

    Args:
        path: the file, usually `os.path.join(root, name)`.
        error_cls: the exception to raise (`CheckpointError`, `DataError`, ...).
        root: the directory the file must lie in (its real path; the Hugging Face snapshot exception applies).
            None: no containment check (a file the user named explicitly).
        what: what the file should be, for the message ("safetensors file"); default "regular file".

    Returns:
        The file's real path.

    Raises:
        error_cls: missing, a link out of `root`, not a regular file (FIFO, socket, device, directory), or
            unreadable; one line naming `path`.
    """
    path = os.fspath(path)
    real = _resolve(path, None if root is None else os.fspath(root), error_cls)
    _stat_regular(path, real, error_cls, what)
    return real


def _stat_regular(path: str, real: str, error_cls: type, what: str) -> os.stat_result:
    try:
        st = os.stat(real)
    except FileNotFoundError:
        raise error_cls(f"{path}: missing") from None
    except OSError as e:
        raise error_cls(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error_cls(f"{path}: is a {_kind(st.st_mode)}, expected a {what or 'regular file'}")
    return st


def _open_fd(path: str, error_cls: type, root: str | None, what: str) -> int:
    real = _resolve(path, root, error_cls)
    st = _stat_regular(path, real, error_cls, what)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise error_cls(f"{path}: missing") from None
    except OSError as e:  # ELOOP: the resolved path became a link after the check
        raise error_cls(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        st2 = os.fstat(fd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise error_cls(
                f"{path}: replaced while being opened (now a {_kind(st2.st_mode)}); expected a {what or 'regular file'}"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file: plain blocking reads from here on
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(
    path: str | os.PathLike, error_cls: type, root: str | os.PathLike | None = None, what: str = ""
) -> BinaryIO:
    """Open `path` for binary reading after the checks of `check_regular`, race-free (module docstring).

    Args:
        path, error_cls, root, what: as for `check_regular`.

    Returns:
        A binary file object positioned at the start (close it, or use it as a context manager).

    Raises:
        error_cls: as `check_regular`, or the entry changed between the check and the open.
    """
    path = os.fspath(path)
    fd = _open_fd(path, error_cls, None if root is None else os.fspath(root), what)
    return os.fdopen(fd, "rb")


@contextlib.contextmanager
def opened_path(
    path: str | os.PathLike, error_cls: type, root: str | os.PathLike | None = None, what: str = ""
) -> Iterator[str]:
    """A path naming the checked, open file, for libraries that only take paths (`safe_open`, `torch.load`).

    Args:
        path, error_cls, root, what: as for `check_regular`.

    Yields:
        `/proc/self/fd/N` of the descriptor `open_regular` checked (opening it opens that same file, whatever
        happens to `path` meanwhile); without `/proc` (not Linux), the file's real path. Valid inside the block:
        a memory map made inside it stays valid after.
    """
    with open_regular(path, error_cls, root, what) as f:
        proc = f"/proc/self/fd/{f.fileno()}"
        yield proc if os.path.exists(proc) else os.path.realpath(os.fspath(path))


def read_regular(
    path: str | os.PathLike,
    error_cls: type,
    root: str | os.PathLike | None = None,
    limit: int | None = None,
    what: str = "",
) -> bytes:
    """The bytes of `path` (checked as `open_regular`), at most `limit + 1` of them when `limit` is given (so a
    caller can tell "larger than limit" without reading a huge file)."""
    with open_regular(path, error_cls, root, what) as f:
        return f.read() if limit is None else f.read(limit + 1)


def copy_regular(
    src: str | os.PathLike, dst: str | os.PathLike, error_cls: type, root: str | os.PathLike | None = None
) -> int:
    """Copy the bytes of regular file `src` (checked as `open_regular`: a link's target's bytes, never the link)
    to a new file `dst`.

    Args:
        src: the file to copy, inside `root`.
        dst: the file to write (created or truncated; permissions 0o644 before the umask).
        error_cls, root: as for `check_regular`.

    Returns:
        The number of bytes copied.

    Raises:
        error_cls: `src` fails a check. OSError: writing `dst` failed (no space, read-only, ...).
    """
    n = 0
    with open_regular(src, error_cls, root) as fin, open(dst, "wb") as fout:
        while chunk := fin.read(1 << 20):
            fout.write(chunk)
            n += len(chunk)
    return n


def check_entries(
    directory: str | os.PathLike, names: list[str] | tuple[str, ...], error_cls: type, what: str = ""
) -> list[str]:
    """`check_regular` every entry of `names` that exists in `directory` (dangling links included), against
    `directory` itself. Returns the names checked (those present), in the given order."""
    directory = os.fspath(directory)
    present = []
    for n in names:
        p = os.path.join(directory, n)
        if os.path.lexists(p):
            check_regular(p, error_cls, directory, what)
            present.append(n)
    return present
