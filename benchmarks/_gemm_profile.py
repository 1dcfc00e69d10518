"""The matrix products of a measured step, as torch's CPU profiler sees them, and the machine's GEMM rate: where a
bench's figure stands against what faster GEMM kernels alone could give (`python -m benchmarks model` and `moe`).

FLOPs are counted here from each call's operand shapes (2·M·K·N, times the batch of a `bmm`), not by the profiler's
`with_flops`, which counts none for the in-place `addmm_` / `baddbmm_` our expert kernel uses. The CPU
flash-attention kernel is not counted as a matrix product: its time stays outside.
"""

from __future__ import annotations

import math
import time

__all__ = ["GEMM_OPS", "gemm_flops", "profile_gemms", "gemm_rate"]

# op -> index of its first matrix operand among the op's recorded inputs (the second follows it)
GEMM_OPS = {"aten::mm": 0, "aten::bmm": 0}
GEMM_OPS.update({f"aten::{op}": 1 for op in ("addmm", "addmm_", "baddbmm", "baddbmm_")})  # self, then the matrices


def gemm_flops(op: str, shapes: list) -> float:
    """2·(batch)·M·K·N of one call of `op` from its recorded input shapes ([.., M, K] times [.., K, N])."""
    a, b = shapes[GEMM_OPS[op]], shapes[GEMM_OPS[op] + 1]
    return 2.0 * math.prod(a) * b[-1]


def profile_gemms(fn) -> dict:
    """Run `fn()` once under torch's CPU profiler -> {"gflop", "ms", "calls"}: `ms` is the products' self time as
    the profiler measures it, the wall-clock time of each call on the calling thread (all of its OpenMP threads'
    work inside it), so it compares with wall times, not with a process's CPU time when torch runs > 1 thread."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in GEMM_OPS]
    return {
        "gflop": sum(e.count * gemm_flops(e.key, e.input_shapes) for e in events) / 1e9,
        "ms": sum(e.self_cpu_time_total for e in events) / 1e3,  # profiler times are in µs
        "calls": sum(e.count for e in events),
    }


def gemm_rate(dtype, n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of an n×n×n `torch.mm` in `dtype` (wall time, best of `repeats`, torch's threads as set)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9
