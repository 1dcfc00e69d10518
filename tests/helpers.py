"""Test harness: run a function on N gloo ranks on loopback; build tiny released-format checkpoints."""
from __future__ import annotations

from dsv3_plugin.distributed import spawn

__all__ = ["run_ranks"]


def run_ranks(fn, nproc: int, *args, timeout_s: float = 300.0):
    """Run module-level `fn(*args)` on `nproc` gloo ranks; `fn` calls `init_distributed()` itself.
    Returns the list of per-rank return values (rank order)."""
    return spawn(fn, nproc, *args, timeout_s=timeout_s)
