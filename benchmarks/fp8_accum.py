"""FP8 accumulation error of Hopper's tensor cores vs the FP32 promotion interval N_C (DeepSeek-V3 report §3.3.2).

For each K and N_C, the GEMM of two E4M3 matrices as `precision.fp8.hopper.hopper_gemm` computes it (tensor-core
chains of N_C elements via mmaemu, windows added in FP32; N_C = none: one chain over K) against the exact float64
product of the same FP8 values, beside our exact emulation (`fp8_gemm_emulated`). Error of one output element:
|y − y64| / Σ_k |a_k·b_k| (the paper's relative error on the `positive` distribution); per cell max, mean,
normwise and the a-priori bound of `hopper_error_bound`. Headline: `ours` = max error with N_C = 128 at K = 4096
(`positive`), `baseline` = the same without promotion, `ratio` = baseline / ours.

Design notes (the error measure, the distributions, the headline): docs/design_notes.md#bench-fp8-accum
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from benchmarks import positive_int
from dsv3_plugin.precision.fp8.hopper import emulation_error_bound, hopper_error_bound, hopper_gemm, mmaemu_status
from dsv3_plugin.precision.fp8.quant import fp8_gemm_emulated, quantize_tensorwise

__all__ = ["add_arguments", "run", "operands", "measure_cell", "DISTRIBUTIONS"]

DISTRIBUTIONS = ("activation", "positive")
PAPER = {
    "K": 4096,
    "max_rel": 0.02,
    "source": "DeepSeek-V3 report §3.3.2: 'a maximum relative error of nearly 2%' "
    "for K = 4096 without promotion (random matrices; distribution "
    "and error definition not stated)",
}


def _nc(text: str):
    if text.lower() in ("none", "null", "never"):
        return None
    v = positive_int(text)
    if v % 32:
        raise argparse.ArgumentTypeError(f"N_C must be a multiple of 32 (one FP8 WGMMA), got {v}")
    return v


def add_arguments(p) -> None:
    p.add_argument("--m", type=positive_int, default=32, help="rows of A (tokens)")
    p.add_argument("--n", type=positive_int, default=128, help="rows of B (output features)")
    p.add_argument(
        "--ks", type=positive_int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384], help="contraction lengths K"
    )
    p.add_argument(
        "--nc",
        type=_nc,
        nargs="+",
        default=[32, 64, 128, 256, 512, None],
        help="promotion intervals N_C ('none' = accumulate all of K on the tensor core)",
    )
    p.add_argument("--dists", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--outlier-every", type=positive_int, default=128, help="one outlier channel every N channels")
    p.add_argument("--outlier-scale", type=float, default=20.0, help="magnitude of the outlier channels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the chain model's small ops slow down with more threads "
        "on a shared machine; 0 = torch's default)",
    )
    p.add_argument("--png", default="runs/bench/fp8_accum.png", help="error vs K, one line per N_C ('' = none)")
    p.add_argument("--no-progress", action="store_true")


def operands(
    dist: str, M: int, N: int, K: int, seed: int = 0, outlier_every: int = 128, outlier_scale: float = 20.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 operands a [M, K], b [N, K] (tensor-wise scaled: one scale each, so any N_C is a valid tensor-core
    accumulation window). Activation-like a: standard normal rows, every `outlier_every`-th channel ×
    `outlier_scale` (LLM outlier channels); weight-like b: normal, std 0.02. `positive`: their absolute values
    (all products ≥ 0: the tensor core's truncation errors all point the same way)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + K)
    a = torch.randn(M, K, generator=g)
    a[:, ::outlier_every] *= outlier_scale
    b = torch.randn(N, K, generator=g) * 0.02
    if dist == "positive":
        a, b = a.abs(), b.abs()
    elif dist != "activation":
        raise ValueError(f"unknown distribution {dist!r} (choose from {', '.join(DISTRIBUTIONS)})")
    return quantize_tensorwise(a)[0], quantize_tensorwise(b)[0]


def _stats(y: torch.Tensor, exact: torch.Tensor, abs_sum: torch.Tensor, bound=None) -> dict:
    err = (y.double() - exact).abs()
    rel = err / abs_sum.clamp_min(torch.finfo(torch.float64).tiny)
    out = {
        "max_rel": rel.max().item(),
        "mean_rel": rel.mean().item(),
        "normwise_rel": (err.norm() / exact.norm()).item(),
    }
    if bound is not None:
        out["bound_rel"] = (bound / abs_sum.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        out["within_bound"] = bool((err <= bound).all())
    return out


def measure_cell(a_q: torch.Tensor, b_q: torch.Tensor, promote_every) -> dict:
    """Errors of the Hopper-modeled GEMM of a_q [M, K] · b_q [N, K]ᵀ (unit scales) against float64."""
    one = torch.ones(())
    exact = a_q.double() @ b_q.double().t()
    abs_sum = a_q.double().abs() @ b_q.double().abs().t()
    y = hopper_gemm(a_q, one, b_q, one, "tensor", "tensor", promote_every)
    return _stats(y, exact, abs_sum, hopper_error_bound(a_q, b_q, promote_every))


def _emulation_cell(a_q, b_q) -> dict:
    one = torch.ones(())
    exact = a_q.double() @ b_q.double().t()
    abs_sum = a_q.double().abs() @ b_q.double().abs().t()
    y = fp8_gemm_emulated(a_q, one, b_q, one, "tensor", "tensor")
    return _stats(y, exact, abs_sum, emulation_error_bound(a_q, b_q))


def _key(nc) -> str:
    return "none" if nc is None else str(nc)


def run(args) -> dict:
    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> dict:
    ok, why = mmaemu_status()
    if not ok:
        raise SystemExit(f"python -m benchmarks fp8-accum: {why}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    t0 = time.perf_counter()
    cells = [(d, K) for d in args.dists for K in args.ks]
    res = {d: {"emulate": {}, **{_key(nc): {} for nc in args.nc}} for d in args.dists}
    bar = tqdm(total=len(cells) * (len(args.nc) + 1), desc="fp8-accum", file=sys.stderr, disable=args.no_progress)
    for d, K in cells:
        a_q, b_q = operands(d, args.m, args.n, K, args.seed, args.outlier_every, args.outlier_scale)
        res[d]["emulate"][str(K)] = _emulation_cell(a_q, b_q)
        bar.update()
        for nc in args.nc:
            res[d][_key(nc)][str(K)] = measure_cell(a_q, b_q, nc)
            bar.update()
    bar.close()
    seconds = time.perf_counter() - t0
    out = {
        "bench": "fp8-accum",
        "shape": {"M": args.m, "N": args.n, "K": args.ks},
        "promote_every": [_key(nc) for nc in args.nc],
        "distributions": args.dists,
        "metric": "|y - y64| / sum_k |a_k b_k| per output (= |y - y64| / |y64| when all products are >= 0)",
        "errors": res,
        "paper": PAPER,
        "mmaemu": why,
        "seconds": seconds,
    }
    head_d = "positive" if "positive" in args.dists else args.dists[0]
    head_k = "4096" if 4096 in args.ks else str(args.ks[-1])
    if "128" in res[head_d] and "none" in res[head_d]:
        ours, base = res[head_d]["128"][head_k]["max_rel"], res[head_d]["none"][head_k]["max_rel"]
        out.update(
            ours=ours,
            baseline=base,
            ratio=base / ours if ours > 0 else float("inf"),
            headline=f"max error at K = {head_k} ({head_d}): N_C = 128 (ours) vs no promotion (baseline)",
        )
    if args.png:
        out["png"] = plot(out, args.png)
    return out


def plot(out: dict, path: str) -> str:
    """Max error vs K, one line per N_C (and the exact emulation), one panel per distribution; the paper's
    ~2% at K = 4096 marked. Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = out["distributions"]
    fig, axes = plt.subplots(1, len(dists), figsize=(7.6 * len(dists), 4.6), squeeze=False)
    numeric = [k for k in out["promote_every"] if k != "none"]
    cmap = plt.get_cmap("viridis")
    shade = {k: cmap(i / max(1, len(numeric) - 1) * 0.85) for i, k in enumerate(numeric)}
    for ax, d in zip(axes[0], dists):
        for key, series in out["errors"][d].items():
            ks = sorted(int(k) for k in series)
            label = {"none": "no promotion", "emulate": "exact emulation (ours, FP32 per 128)"}.get(key, f"N_C = {key}")
            style = {"emulate": dict(color="k", ls=":"), "none": dict(color="tab:red", lw=2.2)}.get(
                key, dict(color=shade.get(key))
            )
            ax.plot(ks, [series[str(k)]["max_rel"] for k in ks], marker="o", ms=3, label=label, **style)
        p = out["paper"]
        ax.scatter(
            [p["K"]],
            [p["max_rel"]],
            marker="*",
            s=160,
            color="gold",
            edgecolor="k",
            zorder=5,
            label="paper: 'nearly 2%' at K = 4096",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("K (contraction length)")
        ax.set_ylabel("max |y − y64| / Σ|a·b|")
        ax.set_title(f"{d} ({out['shape']['M']}×{out['shape']['N']} outputs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle("Hopper FP8 tensor-core accumulation (mmaemu, H100 model) vs FP32 promotion interval N_C")
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=d)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
