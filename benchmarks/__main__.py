"""`python -m benchmarks NAME [--json] [flags]`: one JSON object with our figure, the baseline's measured in the same
run and their `ratio` (ours / baseline, > 1 is better); machine facts under `env`.

Each bench is a module `benchmarks/<name>.py` with `add_arguments(parser)` and `run(args) -> dict`, found by itself
(modules with a leading underscore are helpers); `NAME` is the module's name with dashes for underscores. Exit codes
as `dsv3`'s: 2 for a usage error or bad input, naming the flag or key.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys

import benchmarks
from benchmarks import env_facts
from dsv3_plugin.cli import run_command

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The runner's parser: one sub-command per bench module, each with `--json` and the bench's own flags."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="measure a figure against its baseline in the same run"
    )
    sub = parser.add_subparsers(dest="bench", metavar="NAME")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        mod = importlib.import_module(f"benchmarks.{info.name}")
        name = info.name.replace("_", "-")  # module fp8_accum -> `python -m benchmarks fp8-accum` (or fp8_accum)
        bp = sub.add_parser(
            name, aliases=[info.name] if name != info.name else [], help=(mod.__doc__ or "").strip().splitlines()[0]
        )
        bp.add_argument("--json", action="store_true", help="print one JSON object (default: indented)")
        mod.add_arguments(bp)
        bp.set_defaults(func=_runner(mod))
    return parser


def _runner(mod):
    def run(args) -> int:
        out = mod.run(args)
        out.setdefault("env", env_facts())
        print(json.dumps(out) if args.json else json.dumps(out, indent=2))
        return 0

    return run


def main(argv: list[str] | None = None) -> int:
    """Run one bench.

    Args:
        argv: the arguments after `python -m benchmarks` (default: `sys.argv[1:]`): `NAME [--json] [flags]`.

    Returns:
        The exit code: 0 after printing the bench's JSON; 2 on bad input (`ConfigError` and the like, on stderr).

    Raises:
        SystemExit: from argparse: `--help` (0), an unknown bench or bad flags (2); a bench's own refusals (2).
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    return run_command(args.func, args, args.bench)


if __name__ == "__main__":
    raise SystemExit(main())
