"""Benches for `python -m benchmarks NAME` (one module each; the runner is `benchmarks/__main__.py`).

A checkout-only folder beside the package: `dsv3_plugin` never imports it and it is not installed. Shared helpers
here: the machine facts every report carries, the argparse type for sizes, and a bench's child process.
"""

import json
import os
import platform
import shutil
import subprocess
import sys

__all__ = ["ROOT", "env_facts", "positive_int", "run_child"]

# The checkout's root: put first on a child's PYTHONPATH so that it runs this checkout's `dsv3_plugin` and benches.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_facts() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.is_available(),
    }


def positive_int(text: str) -> int:
    """argparse type for sizes and counts: a bad value is a usage error (exit 2) naming the flag."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (got {text!r})") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {v})")
    return v


def run_child(module: str, approach: str, args: list[str], cleanup: str | None = None) -> dict:
    """Run `python -m MODULE --child APPROACH ARGS...` (one approach of a bench, in a fresh process so that its peak
    RSS and imports are its own) and return the JSON object its last stdout line holds; `cleanup` (a path) is
    removed afterwards either way.

    Raises:
        RuntimeError: the child failed (with the end of its stderr).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    r = subprocess.run(
        [sys.executable, "-m", module, "--child", approach, *args], env=env, capture_output=True, text=True
    )
    if cleanup is not None:
        shutil.rmtree(cleanup, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(f"bench child {approach} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
