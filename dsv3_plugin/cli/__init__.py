"""`dsv3` command line. Each sub-command lives in its own module here and defines
`register(subparsers)`, which adds a parser whose `func(args) -> int` runs it.

Exit codes (DESIGN.md): 0 ok, 2 bad input (`ConfigError`, `CheckpointError`, argparse), 1 other failures.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv3", description="DeepSeek-V3 training plugin for DeepSpeed and Megatron-Core")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # ConfigError, CheckpointError: bad input, message names the key/tensor
        from ..config import ConfigError
        from ..errors import CheckpointError
        if isinstance(e, (ConfigError, CheckpointError)):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise
