"""FP8 tile/block quantization: error vs per-tensor scaling on outlier activations, quantization
throughput vs a memcpy of the same bytes, and (GPU) blockwise FP8 GEMM TFLOP/s vs BF16.

Headline (`ours` / `baseline` / `ratio`): per-token relative quantization error of 1×128 tiles vs one
per-tensor scale on activations whose token norms span 10^±1.5 and which carry outlier channels (×1000);
`ratio` = per-tensor error / tile error (> 1: fine-grained scaling is more accurate).
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import positive_int
from dsv3_plugin.config import FP8Config
from dsv3_plugin.precision.fp8.linear import Fp8Recipe, select_backend
from dsv3_plugin.precision.fp8.quant import (
    dequantize_blockwise,
    dequantize_tilewise,
    quantize_blockwise,
    quantize_tensorwise,
    quantize_tilewise,
)


def add_arguments(p):
    p.add_argument("--tokens", type=positive_int, default=2048, help="rows of the activation matrix")
    p.add_argument("--hidden", type=positive_int, default=7168, help="columns (V3 hidden size by default)")
    p.add_argument("--outlier-scale", type=float, default=1000.0)
    p.add_argument("--repeat", type=positive_int, default=5)
    p.add_argument(
        "--gemm",
        type=positive_int,
        nargs=3,
        default=[4096, 7168, 7168],
        metavar=("M", "K", "N"),
        help="GEMM shape on GPU (CPU uses a 256x1024x1024 emulation check)",
    )
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")


def _median_time(fn, repeat: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def outlier_activations(tokens: int, hidden: int, outlier_scale: float, device, seed: int = 0):
    """randn rows scaled log-uniformly over 10^±1.5 (token norms), every 256th channel × `outlier_scale`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-1.5, 1.5, tokens)[:, None]
    keep = torch.ones(hidden, dtype=torch.bool)
    keep[7::256] = False
    x[:, ~keep] *= outlier_scale
    return x.to(device), keep.to(device)


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # --- error on outlier activations
    x, keep = outlier_activations(args.tokens, args.hidden, args.outlier_scale, device)

    def tok_err(y):
        return ((y - x)[:, keep].norm(dim=1) / x[:, keep].norm(dim=1)).mean().item()

    q, s = quantize_tilewise(x)
    qp, sp = quantize_tilewise(x, pow2=True)
    qb, sb = quantize_blockwise(x)
    qt, st = quantize_tensorwise(x)
    err = {
        "tile_1x128": tok_err(dequantize_tilewise(q, s)),
        "tile_1x128_pow2": tok_err(dequantize_tilewise(qp, sp)),
        "block_128x128": tok_err(dequantize_blockwise(qb, sb)),
        "per_tensor": tok_err(qt.float() * st),
    }
    err["ratio"] = err["per_tensor"] / err["tile_1x128"]
    err["block_ratio"] = err["per_tensor"] / err["block_128x128"]

    # --- quantization throughput (BF16 input, bytes read) vs memcpy of the same bytes
    xb = x.to(torch.bfloat16)
    dst = torch.empty_like(xb)
    t_q = _median_time(lambda: quantize_tilewise(xb), args.repeat, sync)
    t_c = _median_time(lambda: dst.copy_(xb), args.repeat, sync)
    nbytes = xb.numel() * xb.element_size()
    quant = {"bytes": nbytes, "ours_GBps": nbytes / t_q / 1e9, "memcpy_GBps": nbytes / t_c / 1e9}
    quant["ratio"] = quant["ours_GBps"] / quant["memcpy_GBps"]

    # --- GEMM: blockwise FP8 vs BF16 (GPU); on CPU only the emulation's agreement/cost is reported
    gemm = _gemm(args, device, sync)
    return {
        "ours": err["tile_1x128"],
        "baseline": err["per_tensor"],
        "ratio": err["ratio"],
        "metric": "mean per-token relative error on non-outlier channels (lower is better)",
        "error": err,
        "quantize": quant,
        "gemm": gemm,
        "device": str(device),
    }


def _gemm(args, device, sync) -> dict:
    if device.type != "cuda":
        M, K, N = 256, 1024, 1024
    else:
        M, K, N = args.gemm
    g = torch.Generator().manual_seed(1)
    a = torch.randn(M, K, generator=g).to(device)
    w = (torch.randn(N, K, generator=g) * 0.02).to(device)
    backend, why = select_backend(FP8Config(), device)
    r = Fp8Recipe()
    qa, sa, ka = r.act(a)
    qw, sw, kw = r.weight(w)
    out = backend.gemm(qa, sa, ka, qw, sw, kw)
    ref = a @ w.t()
    rel = ((out - ref).norm() / ref.norm()).item()
    flops = 2 * M * K * N
    t_fp8 = _median_time(lambda: backend.gemm(qa, sa, ka, qw, sw, kw), args.repeat, sync)
    ab, wb = a.to(torch.bfloat16), w.to(torch.bfloat16)
    t_bf16 = _median_time(lambda: ab @ wb.t(), args.repeat, sync)
    res = {
        "shape": [M, K, N],
        "backend": backend.name,
        "backend_reason": why,
        "rel_err_vs_fp32": rel,
        "fp8_TFLOPs": flops / t_fp8 / 1e12,
        "bf16_TFLOPs": flops / t_bf16 / 1e12,
    }
    res["ratio"] = res["fp8_TFLOPs"] / res["bf16_TFLOPs"]
    if backend.name == "emulate":
        res["note"] = "emulation (exact FP8 semantics, not a speed path); GPU figures need an SM90 device"
    return res
