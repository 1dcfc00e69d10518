"""`dsv3` command line. Each sub-command lives in its own module here and defines
`register(subparsers)`, which adds a parser whose `func(args) -> int` runs it.

Exit codes (docs/architecture.md): 0 ok, 2 bad input (`ConfigError`, `CheckpointError`, `DataError`, argparse) and
OS errors about a path (`error: COMMAND: STRERROR: PATH`), 1 other failures.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import pkgutil
import re
import sys

from dsv3_plugin.config import ConfigError
from dsv3_plugin.errors import CheckpointError, DataError

__all__ = ["main", "build_parser", "run_command", "strip_launcher_args"]


def _installed_version() -> str:
    """The installed distribution's version: pyproject.toml reads it from `dsv3_plugin.__version__` (the one
    source), and the top-level package is not imported from inside it (tests/unit/test_import_layers.py)."""
    try:
        return importlib.metadata.version("dsv3-plugin")
    except importlib.metadata.PackageNotFoundError:
        return "(dsv3-plugin is not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv3", description="DeepSeek-V3 training plugin for DeepSpeed and Megatron-Core"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        mod.register(sub)
    return parser


_LOCAL_RANK = re.compile(r"^--local[-_]rank(?:=(\d+))?$")


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop the `--local_rank=N` / `--local-rank N` that launchers insert (the deepspeed launcher puts it right
    after the script, i.e. before the sub-command; torch.distributed.launch does the same) from anywhere in
    `argv`, exporting it as LOCAL_RANK if the launcher did not (it normally does)."""
    out, i = [], 0
    while i < len(argv):
        m = _LOCAL_RANK.match(argv[i])
        if m is None:
            out.append(argv[i])
            i += 1
            continue
        value = m.group(1)
        if value is None and i + 1 < len(argv) and argv[i + 1].isdigit():
            value, i = argv[i + 1], i + 1
        if value is not None:
            os.environ.setdefault("LOCAL_RANK", value)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dsv3` command (and of `python -m dsv3_plugin`).

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`); a launcher's `--local_rank=N` /
            `--local-rank N` anywhere in them is dropped (`strip_launcher_args`).

    Returns:
        The exit code: what the sub-command returned (0 when it returned None), 2 on bad input (`ConfigError`,
        `CheckpointError`, `DataError`: printed as `error: ...` on stderr) and on an OSError that names a path
        (no space, read-only, not a directory: `error: COMMAND: STRERROR: PATH`), 130 when interrupted.

    Raises:
        SystemExit: from argparse: `--help` and `--version` (0), bad arguments (2).
    """
    argv = strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    return run_command(args.func, args, args.command)


def run_command(func, args: argparse.Namespace, command: str) -> int:
    """Run one parsed command under the exit-code convention of `main` (also used by `python -m benchmarks`).

    Args:
        func: the command, `func(args) -> int | None`.
        args: its parsed arguments.
        command: its name, for the one-line message of an OSError that names a path.

    Returns:
        What `func` returned (0 for None), 2 on bad input (`ConfigError`, `CheckpointError`, `DataError`: printed
        as `error: ...` on stderr) and on an OSError that names a path, 130 when interrupted.
    """
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print("dsv3: interrupted", file=sys.stderr)
        return 130
    except ValueError as e:  # ConfigError, CheckpointError: bad input, message names the key/tensor
        if isinstance(e, (ConfigError, CheckpointError, DataError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
    except OSError as e:
        # What the sub-command did not turn into a message itself: a path the system refused (no space, read-only,
        # not a directory, permission). One line naming the path, like bad input; other OSErrors (no file named:
        # a socket, a broken pipe) are bugs or crashes and keep their traceback.
        if e.filename is None or e.errno is None:
            raise
        where = (
            os.fsdecode(e.filename)
            if e.filename2 is None
            else f"{os.fsdecode(e.filename)} -> {os.fsdecode(e.filename2)}"
        )
        print(f"error: {command}: {e.strerror or os.strerror(e.errno)}: {where}", file=sys.stderr)
        return 2
