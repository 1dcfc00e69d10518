"""dsv3-plugin's GPU check: one script, one JSON object on stdout; exit 0 when every check passes.

    make gpu-check                                   # on a Hopper GPU (≈ 8 minutes or less on one H200)
    make gpu-check GPU_CHECK_ARGS=--dry-run          # on CPU in seconds: tiny shapes, same code, same JSON keys
    PYTHONPATH=. python examples/gpu_check.py --help

Sections (each {"status": "ok" | "fail" | "skipped" | "error", ...}; a skipped section says why):
  env             torch / CUDA / GPU / Transformer Engine / mmaemu versions, the GPU's peak TFLOP/s (spec sheet)
  fp8_gemm        the same FP8 operands (1×128 × 128×128, pow2 scales) through torch blockwise `_scaled_mm`, our
                  exact emulation and the Hopper-modeled backend (mmaemu, N_C = 128), for Fprop, Dgrad and Wgrad:
                  bit agreement and max differences; pass: torch within the derived bound of the emulation
                  (tensor-core chains per 128 + FP32 promotion)
  te_linear       TE `Float8BlockScaling` Linear (our recipe bridge, pow2 scales) vs `Fp8Linear` on the emulation
                  and on the Hopper-modeled backend: y, dx, dw; whether TE's quantized inputs equal ours
  tiny_logits     the tiny model's fp32 logits on CUDA vs CPU (≤ 1e-5, TF32 off)
  fp8_model_steps 5 training steps of the tiny model, FP8 auto backend on the GPU vs the emulation
  grouped_mm      routed experts through `grouped_mm` vs the loop kernel (BF16 on the GPU), forward and grads
  lora_fp8_base   LoRA forward + backward on a frozen base kept in FP8 vs the same base dequantized to BF16 (same
                  adapters, batch): ms and peak memory of each (the `small` shape); one adapted Linear's y and dx
                  within the derived bound of FP8 (1×128 activations, the GEMM's bound) against BF16 (rounding)
  moe             MoE layer forward+backward at DeepSeek-V3 shapes (hidden 7168, expert width 2048, top-8; 8 and
                  32 local experts, as a rank of 256 experts under EP 32 / 8): tokens/s and TFLOP/s in BF16 and FP8
                  against transformers' DeepseekV3MoE and Megatron-Core's MoELayer (TE grouped GEMM, BF16 and its
                  blockwise FP8) on the same weights, FP8 against our BF16 path, and the GPU's peak
Sections stop being started once `--budget-s` is spent (reported as skipped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dsv3_plugin.config import DSv3Config, FP8Config  # noqa: E402
from dsv3_plugin.precision.fp8.linear import (
    EmulatedBackend,
    Fp8Linear,
    Fp8Recipe,
    TorchScaledMMBackend,
    select_backend,
    torch_blockwise_available,
)
from dsv3_plugin.precision.fp8.quant import quantize_blockwise  # noqa: E402

SECTIONS = ("env", "fp8_gemm", "te_linear", "tiny_logits", "fp8_model_steps", "grouped_mm", "lora_fp8_base", "moe")
# Dense (no sparsity) peak tensor throughput, TFLOP/s, from NVIDIA's data sheets: (BF16, FP8).
PEAKS = {
    "H200": (989.4, 1978.9),
    "H100 SXM": (989.4, 1978.9),
    "H100 80GB HBM3": (989.4, 1978.9),
    "H100 NVL": (835.0, 1670.0),
    "H100 PCIe": (756.0, 1513.0),
    "H800": (989.4, 1978.9),
    "A100": (312.0, None),
}
FULL = {
    "gemm": (512, 2048, 1024),
    "linear": (256, 1024, 512),
    "moe_tokens": 4096,
    "moe_hidden": 7168,
    "moe_ffn": 2048,
    "moe_local_experts": (8, 32),
    "grouped": (2048, 7168, 2048, 8),
    "lora_model": ("small", 8, 512),  # preset, B, T
    "repeats": 5,
}
DRY = {
    "gemm": (32, 256, 160),
    "linear": (32, 256, 128),
    "moe_tokens": 16,
    "moe_hidden": 64,
    "moe_ffn": 32,
    "moe_local_experts": (8, 32),
    "grouped": (40, 64, 32, 4),
    "lora_model": ("tiny", 2, 16),
    "repeats": 1,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny shapes: every code path that can run without a GPU, the same JSON keys",
    )
    p.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--budget-s", type=float, default=420.0, help="start no new section after this many seconds")
    p.add_argument("--repeats", type=int, default=None, help="timed passes per MoE measurement")
    p.add_argument("--moe-tokens", type=int, default=None, help="tokens per MoE layer call (default 4096)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.shapes = dict(DRY if args.dry_run else FULL)
    if args.repeats:
        args.shapes["repeats"] = args.repeats
    if args.moe_tokens:
        args.shapes["moe_tokens"] = args.moe_tokens
    args.device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    return args


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Bit agreement and differences of two results of the same computation."""
    a, b = a.detach().float().cpu().contiguous(), b.detach().float().cpu().contiguous()
    d = (a - b).abs()
    return {
        "bit_equal_fraction": (a.view(torch.int32) == b.view(torch.int32)).float().mean().item(),
        "max_abs_diff": d.max().item() if d.numel() else 0.0,
        "normwise_rel_diff": (d.norm() / b.norm().clamp_min(1e-30)).item(),
    }


def _within(a, b, bound) -> bool:
    return bool(((a.detach().double().cpu() - b.detach().double().cpu()).abs() <= bound.cpu()).all())


# --------------------------------------------------------------------------------------------------


def sec_env(args, res):
    out = {
        "status": "ok",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": str(args.device),
        "dry_run": args.dry_run,
    }
    if args.device.type == "cuda":
        if not torch.cuda.is_available():
            return {**out, "status": "error", "reason": "no CUDA device (use --dry-run on a machine without a GPU)"}
        name = torch.cuda.get_device_name(args.device)
        out.update(gpu=name, capability=list(torch.cuda.get_device_capability(args.device)))
        peak = next((v for k, v in PEAKS.items() if k.lower() in name.lower()), None)
        out["peak_tflops"] = {"bf16": peak[0], "fp8": peak[1]} if peak else None
        out["peak_source"] = "NVIDIA data sheet, dense" if peak else f"unknown GPU {name!r}"
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except Exception as e:  # noqa: BLE001 — TE raises RuntimeError without its CUDA library
        out["transformer_engine"] = f"not importable ({type(e).__name__})"
    from dsv3_plugin.precision.fp8.hopper import mmaemu_status

    out["mmaemu"] = mmaemu_status()[1]
    be, why = select_backend(FP8Config(), args.device)
    out["auto_fp8_backend"], out["auto_fp8_reason"] = be.name, why
    return out


def _operands(dev, M, K, N, pow2=True):
    """x [M, K], w [N, K], dy [M, N] (ragged-free shapes) and the FP8 operands of Fprop, Dgrad and Wgrad."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(dev)
    w = (torch.randn(N, K, generator=g) * 0.02).to(dev)
    dy = torch.randn(M, N, generator=g).to(dev)
    r = Fp8Recipe(pow2=pow2)
    qw, sw, kw = r.weight(w)
    cases = {
        "fprop": (r.act(x), (qw, sw, kw)),
        "dgrad": (r.act(dy), (qw.t(), sw.t(), kw)),
        "wgrad": (r.act(dy.t()), r.act(x.t())),
    }
    return x, w, dy, r, cases


def _bound(a, b, which):
    from dsv3_plugin.precision.fp8.hopper import emulation_error_bound, hopper_error_bound

    (qa, sa, ka), (qb, sb, kb) = a, b
    if which == "emulate":
        return emulation_error_bound(qa, qb, sa, ka, sb, kb)
    return hopper_error_bound(qa, qb, 128, sa, ka, sb, kb)


def sec_fp8_gemm(args, res):
    from dsv3_plugin.precision.fp8.hopper import HopperEmulatedBackend, mmaemu_status

    dev = args.device
    M, K, N = args.shapes["gemm"]
    _, _, _, _, cases = _operands(dev, M, K, N)
    emu = EmulatedBackend()
    hop_ok, hop_why = mmaemu_status()
    tb_ok, tb_why = torch_blockwise_available(dev)
    out = {"status": "ok", "shape_MKN": [M, K, N], "torch_scaled_mm": tb_why, "hopper_emulated": hop_why}
    ok = True
    for name, (a, b) in cases.items():
        ref = emu.gemm(*a, *b)
        row = {}
        bound = _bound(a, b, "emulate") + _bound(a, b, "hopper")  # a tensor-core GEMM promoted every 128
        if hop_ok:
            hop = HopperEmulatedBackend(128).gemm(*a, *b)
            row["hopper_vs_emulate"] = _diff(hop, ref)
            row["hopper_within_bound"] = _within(hop, ref, bound)
            ok &= row["hopper_within_bound"]
        if tb_ok:
            tor = TorchScaledMMBackend().gemm(*a, *b)
            row["torch_vs_emulate"] = _diff(tor, ref)
            row["torch_within_bound"] = _within(tor, ref, bound)
            ok &= row["torch_within_bound"]
            if hop_ok:
                row["torch_vs_hopper"] = _diff(tor, hop)
        out[name] = row
    if not hop_ok and not tb_ok:
        return {**out, "status": "skipped", "reason": f"neither torch blockwise ({tb_why}) nor mmaemu ({hop_why})"}
    out["status"] = "ok" if ok else "fail"
    return out


def _te_quantized_equal(x, r):
    """Whether TE's 1×128 quantizer (pow2, amax eps 1e-4) gives our FP8 bytes and scales for x."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    q = Float8BlockQuantizer(
        fp8_dtype=tex.DType.kFloat8E4M3,
        rowwise=True,
        columnwise=False,
        amax_epsilon=1e-4,
        force_pow_2_scales=True,
        block_scaling_dim=1,
    )
    t = q(x)
    data = t._rowwise_data.view(torch.float8_e4m3fn)
    si = t._rowwise_scale_inv.float()
    ours_q, ours_s, _ = r.act(x)
    M, Kc = ours_s.shape
    layouts = {
        "[M, K/128]": si[:M, :Kc] if si.shape[0] >= M else None,
        "[K/128, M] (GEMM-ready)": si[:Kc, :M].t() if si.shape[0] >= Kc and si.shape[1] >= M else None,
    }
    same_s = {k: bool(torch.equal(v, ours_s)) for k, v in layouts.items() if v is not None and v.shape == ours_s.shape}
    return {
        "data_equal": bool(torch.equal(data.view(torch.uint8), ours_q.view(torch.uint8))),
        "scales_equal_in_layout": same_s,
        "te_scale_shape": list(si.shape),
    }


def sec_te_linear(args, res):
    dev = args.device
    cfg = FP8Config(enabled=True, pow2_scales=True, backend="te")
    try:
        te_be, why = select_backend(cfg, dev)
    except Exception as e:  # noqa: BLE001
        return {"status": "skipped", "reason": str(e)}
    from dsv3_plugin.precision.fp8.hopper import HopperEmulatedBackend, mmaemu_status

    M, K, N = args.shapes["linear"]
    x, w, dy, r, cases = _operands(dev, M, K, N)

    def run(backend):
        lin = Fp8Linear(K, N, bias=False, recipe=r, backend=backend, device=dev)
        with torch.no_grad():
            lin.weight.copy_(w)
        xx = x.clone().requires_grad_()
        y = lin(xx)
        y.backward(dy)
        return {"y": y.detach(), "dx": xx.grad, "dw": lin.weight.grad}

    out = {"status": "ok", "shape_MKN": [M, K, N], "te": why}
    te = run(te_be)
    emu = run(EmulatedBackend())
    try:
        out["te_fp8_inputs"] = _te_quantized_equal(x, r)
    except Exception as e:  # noqa: BLE001 — TE's internal tensor API moves between versions
        out["te_fp8_inputs"] = f"could not compare ({type(e).__name__}: {str(e)[:200]})"
    ok = True
    gemm_of = {"y": "fprop", "dx": "dgrad", "dw": "wgrad"}
    for k in ("y", "dx", "dw"):
        a, b = cases[gemm_of[k]]
        bound = _bound(a, b, "emulate") + _bound(a, b, "hopper")
        out[f"te_vs_emulate_{k}"] = {**_diff(te[k], emu[k]), "within_bound": _within(te[k], emu[k], bound)}
        ok &= out[f"te_vs_emulate_{k}"]["within_bound"]
    if mmaemu_status()[0]:
        hop = run(HopperEmulatedBackend(128))
        for k in ("y", "dx", "dw"):
            out[f"te_vs_hopper_{k}"] = _diff(te[k], hop[k])
    out["status"] = "ok" if ok else "fail"
    return out


def _tiny(seed=0, **ovr):
    from dsv3_plugin.training.transforms import build_model

    m = build_model(DSv3Config.from_block({"preset": "tiny", **ovr}))
    m.reset_parameters(seed=seed)
    return m


def sec_tiny_logits(args, res):
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs IEEE fp32 GEMMs
    torch.backends.cudnn.allow_tf32 = False
    m = _tiny().eval()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(ids).logits
        got = m.to(dev)(ids.to(dev)).logits.cpu()
    d = (got - ref).abs().max().item()
    return {"status": "ok" if d <= 1e-5 else "fail", "devices": [str(dev), "cpu"], "max_abs_diff": d, "tolerance": 1e-5}


def sec_fp8_model_steps(args, res):
    dev = args.device
    losses = {}
    for backend in ("auto", "emulate"):
        torch.manual_seed(0)
        m = _tiny(fp8={"enabled": True, "backend": backend}).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        B, T, steps = (2, 16, 1) if args.dry_run else (4, 64, 5)
        ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1)).to(dev)
        ls = []
        for _ in range(steps):
            out = m(ids, torch.roll(ids, -1, 1))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            ls.append(out.loss.item())
        losses[backend] = {"backend": m.fp8_report.backend, "losses": ls}
    e = max(abs(a - b) / abs(b) for a, b in zip(losses["auto"]["losses"], losses["emulate"]["losses"]))
    # NOTE: 1e-3 is the FP8 level of agreement (TE quantizes and accumulates on its own), not an FP32 bound.
    return {"status": "ok" if e < 1e-3 else "fail", "runs": losses, "max_rel_loss_diff": e, "tolerance": 1e-3}


def sec_grouped_mm(args, res):
    from dsv3_plugin.model.kernels import apply_split
    from dsv3_plugin.model.moe.grouped_mm import expert_kernel, grouped_mm_swiglu, swiglu_magnitudes
    from dsv3_plugin.model.moe.layer import GroupedSwiGLUKernel

    loop = GroupedSwiGLUKernel()
    dev = args.device
    N, H, I, E = args.shapes["grouped"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kernel, why = expert_kernel(dev, dt, H, I)
    g = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(E), N, replacement=True, generator=g).bincount(minlength=E).tolist()
    counts[-1] += counts[0]  # one empty expert on purpose
    counts[0] = 0
    x = torch.randn(N, H, generator=g)
    ws = [
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, H, I, generator=g) * 0.05,
    ]
    dy = torch.randn(N, H, generator=g)

    def run(fn):
        ps = [t.to(dev, dt).requires_grad_() for t in (x, *ws)]
        y = fn(ps[0], counts, *ps[1:])
        y.backward(dy.to(dev, dt))
        return [y.detach()] + [p.grad for p in ps]

    got = run(grouped_mm_swiglu)
    ref = run(lambda x_, c, *w: apply_split(loop, list(c), x_, *w))  # the loop kernel, never grouped_mm
    mags = swiglu_magnitudes(*(t.to(dev, dt) for t in (x,)), counts, *(w.to(dev, dt) for w in ws), dy.to(dev, dt))
    # rounding of both kernels: the stored g, u, h, y (and gradients) in `dt` plus the FP32 accumulation over the
    # longest reduction (N rows for Wgrad, H + I along the chain), twice (two kernels), to first order
    unit = 2.0**-8 if dt == torch.bfloat16 else 2.0**-24
    tol_scale = 2 * (6 * unit + (N + H + I) * 2.0**-24)
    names = ("y", "dx", "dw1", "dw3", "dw2")
    out = {
        "status": "ok",
        "kernel_selected": kernel,
        "reason": why,
        "dtype": str(dt),
        "N_H_I_E": [N, H, I, E],
        "counts": counts,
    }
    ok = True
    for n, a, b, mg in zip(names, got, ref, mags):
        within = _within(a, b, tol_scale * mg)
        out[n] = {**_diff(a, b), "within_bound": within}
        ok &= within
    out["status"] = "ok" if ok else "fail"
    return out


def lora_linear_pair(w, A, B, scale: float, dev):
    """One adapted Linear twice, same adapters (BF16): on the FP8 blocks of w (`FrozenFp8Linear`, the auto FP8
    backend) and on those blocks dequantized to BF16. Returns (fp8 module, bf16 module, dequantized w fp32)."""
    from dsv3_plugin.model.kernels import KernelLinear, PlainLinearKernel
    from dsv3_plugin.precision.fp8.frozen import FrozenFp8Gemm, FrozenFp8Linear
    from dsv3_plugin.precision.fp8.linear import AutoBackend
    from dsv3_plugin.precision.fp8.quant import dequantize_blockwise
    from dsv3_plugin.training.lora import LoRALinearKernel

    N, K = w.shape
    lin8 = FrozenFp8Linear(K, N, FrozenFp8Gemm(Fp8Recipe(), AutoBackend(FP8Config(enabled=True))), device=dev)
    lin8.weight, lin8.weight_scale_inv = (t.to(dev) for t in quantize_blockwise(w))
    w_d = dequantize_blockwise(lin8.weight.cpu(), lin8.weight_scale_inv.cpu())
    linb = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16).requires_grad_(False)
    linb.weight.copy_(w_d)
    linb.__class__, linb.kernel = KernelLinear, PlainLinearKernel()
    for m in (lin8, linb):
        m.lora_A = torch.nn.Parameter(A.to(dev, torch.bfloat16))
        m.lora_B = torch.nn.Parameter(B.to(dev, torch.bfloat16))
        m.kernel = LoRALinearKernel(m.kernel, m, scale)
    return lin8, linb, w_d


def fp8_vs_bf16_bound(a, a_q, w_q, w_s, out8, outb):
    """Per-element bound on |out8 − outb| for out = a · Wᵀ (+ the same adapter term z on both sides) with a [M, K]
    the BF16 operand, a_q its 1×128 FP8 quantization (`quant` triple), W [N, K] the FP8 weight w_q (E4M3) with its
    128×128 scales w_s, on the BF16 side W dequantized and rounded to BF16. `out8` / `outb`: (base term, output). FP8
    side |a_q − a|·|W| (the activation's quantization, measured) + the FP8 GEMM's bound (exact emulation and a
    tensor-core chain per 128); BF16 side |a|·|W − bf16(W)| + γ_K |a|·|bf16(W)| (FP32 accumulation in any order);
    each side's two BF16 roundings (the GEMM's output, then + z) u·(|base| + |out|). First order in u (BF16's unit
    roundoff, 2⁻⁸), with u·|computed value| standing for u·|exact value|."""
    from dsv3_plugin.precision.fp8.hopper import emulation_error_bound, hopper_error_bound
    from dsv3_plugin.precision.fp8.quant import dequantize_blockwise, dequantize_tilewise

    (q, s, k), wq = a_q, (w_q.cpu(), w_s.cpu())
    w_d = dequantize_blockwise(*wq)
    a64, w64 = a.double().cpu(), w_d.double()
    wb = w_d.bfloat16().double()
    K, u, u32 = a.shape[1], 2.0**-8, 2.0**-24
    gamma = K * u32 / (1 - K * u32)
    d_a = (dequantize_tilewise(q.cpu(), s.cpu(), dtype=torch.float64) - a64).abs()
    gemm = emulation_error_bound(q.cpu(), wq[0], s.cpu(), k, wq[1], "block")
    gemm = gemm + hopper_error_bound(q.cpu(), wq[0], 128, s.cpu(), k, wq[1], "block")
    bound = d_a @ w64.abs().t() + gemm.double() + a64.abs() @ (w64 - wb).abs().t() + gamma * (a64.abs() @ wb.abs().t())
    for base, out in out8, outb:
        bound = bound + u * (base.double().cpu().abs() + out.double().cpu().abs())
    return bound


def _lora_layer_agreement(dev, M, K, N) -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g) * 0.02
    A, B = torch.randn(8, K, generator=g) * 0.05, torch.randn(N, 8, generator=g) * 0.05
    x, dy = torch.randn(M, K, generator=g).bfloat16(), torch.randn(M, N, generator=g).bfloat16()
    lin8, linb, _ = lora_linear_pair(w, A, B, 2.0, dev)
    r, out, ok = Fp8Recipe(), {}, True
    got, xd, dyd = {}, x.to(dev), dy.to(dev)
    with torch.no_grad():  # each side's base term alone (its first BF16 rounding)
        g8, q8, s8 = lin8.kernel.inner.gemm, lin8.weight, lin8.weight_scale_inv
        base = {
            "fp8": (g8.fwd(xd, q8, s8).bfloat16(), g8.dgrad(dyd, q8, s8).bfloat16()),
            "bf16": (xd @ linb.weight.t(), dyd @ linb.weight),
        }
    for name, m in ("fp8", lin8), ("bf16", linb):
        xx = xd.clone().requires_grad_()
        y = m(xx)
        y.backward(dyd)
        got[name] = {"y": (y.detach(), base[name][0]), "dx": (xx.grad, base[name][1])}
    q, sq = lin8.weight, lin8.weight_scale_inv
    for k, (a, wq) in {"y": (x, (q, sq)), "dx": (dy, (q.t().contiguous(), sq.t().contiguous()))}.items():
        (o8, b8), (ob, bb) = got["fp8"][k], got["bf16"][k]
        bound = fp8_vs_bf16_bound(a, r.act(a.float()), *wq, (b8, o8), (bb, ob))
        out[k] = {**_diff(o8, ob), "within_bound": _within(o8, ob, bound)}
        ok &= out[k]["within_bound"]
    return {"shape_MKN": [M, K, N], **out, "ok": ok}


def _lora_model_step(path: str, fp8: bool, ids, dev, repeats: int) -> dict:
    """ms per LoRA forward + backward (median of `repeats` after one warm-up) and peak memory of one model."""
    from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
    from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
    from dsv3_plugin.training.lora import apply_lora

    lora, train = {"rank": 16, "alpha": 32.0, "dropout": 0.0}, {"seed": 0}
    if fp8:
        m = load_frozen_base(path, dtype=torch.bfloat16, fp8={"enabled": True}, lora=lora, train=train)
    else:
        m = load_pretrained(path, torch.bfloat16, train=train)
        apply_lora(m, pretrained_config(path, lora=lora, train=train))
    m = m.to(dev).train()
    frozen = sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()] if not t.requires_grad)
    labels = torch.roll(ids, -1, 1)
    ts, loss = [], None
    for i in range(repeats + 1):
        if i == 1 and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        _sync(dev)
        t0 = time.perf_counter()
        m.zero_grad(set_to_none=True)
        loss = m(ids, labels=labels).loss
        loss.backward()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    grads = {n: p.grad.float().norm().item() for n, p in m.named_parameters() if p.requires_grad}
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    return {
        "ms": sorted(ts[1:])[len(ts[1:]) // 2] * 1e3,
        "peak_mib": peak,
        "frozen_mib": frozen / 2**20,
        "loss": loss.item(),
        "adapter_grad_norm": math.sqrt(sum(v * v for v in grads.values())),
        "backend": m.fp8_report.backend if fp8 else "bf16",
    }


def sec_lora_fp8_base(args, res):
    import tempfile

    from benchmarks.lora import write_base

    dev = args.device
    M, K, N = args.shapes["linear"]
    out = {"status": "ok", "layer": _lora_layer_agreement(dev, M, K, N)}
    preset, B, T = args.shapes["lora_model"]
    with tempfile.TemporaryDirectory(prefix="gpu_check_lora_") as tmp:
        path = write_base(os.path.join(tmp, "base"), preset, T, 0)
        ids = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1)).to(dev)
        rows = {k: _lora_model_step(path, k == "fp8", ids, dev, args.shapes["repeats"]) for k in ("fp8", "bf16")}
    out["model"] = {"preset": preset, "B": B, "T": T, **rows}
    out["model"].update(lora_fp8_summary(rows["fp8"], rows["bf16"]))
    if not out["layer"]["ok"]:
        out["status"] = "fail"
    return out


def lora_fp8_summary(fp8: dict, bf16: dict) -> dict:
    """BF16 / FP8 ratios of the model rows (> 1: the FP8 base is faster / smaller); peak None without CUDA."""
    return {
        "bf16_over_fp8_ms": bf16["ms"] / fp8["ms"],
        "bf16_over_fp8_peak": None if fp8["peak_mib"] is None else bf16["peak_mib"] / fp8["peak_mib"],
        "bf16_over_fp8_frozen": bf16["frozen_mib"] / fp8["frozen_mib"],
        "loss_diff": abs(fp8["loss"] - bf16["loss"]),
    }


def _moe_pair(dev, dt, tokens, hidden, ffn, experts):
    """Our DeepSeekMoE and transformers' DeepseekV3MoE with identical weights (bench `moe`'s builder), every
    matrix rescaled by fan-in (the builder's scale is set for hidden 256 / FFN 128) so that router scores and
    activations stay in range at hidden 7168."""
    from benchmarks.moe import build_pair

    ours, theirs, x = build_pair(
        tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=8, groups=1, topk_group=1, shared=1, seed=0
    )
    with torch.no_grad():
        for mod in (ours, theirs):
            for p in mod.parameters():
                if p.dim() >= 2:
                    p.mul_(math.sqrt((256 if p.shape[-1] == hidden else 128) / p.shape[-1]))
    return ours.to(dev, dt), theirs.to(dev, dt), x.to(dev, dt)


def _time_fwd_bwd(mod, x, g_out, repeats, dev):
    def step():
        xi = x.detach().requires_grad_(True)
        mod(xi).backward(g_out)

    step()  # warm-up (allocator, kernels, probes)
    _sync(dev)
    ts = []
    for _ in range(repeats):
        mod.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return min(ts)


class _BTH(torch.nn.Module):
    """Megatron-Core's MoELayer called as our layers are: [B, T, H] in, [B, T, H] out."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from benchmarks import _megatron_moe as megatron_moe

        return megatron_moe.forward(self.layer, x)


def _megatron_rows(dev, dt, ours, x, g_out, repeats, flops) -> tuple[dict, bool]:
    """Megatron-Core's own MoELayer holding our layer's weights (`benchmarks/_megatron_moe.py`): its output against ours
    and its forward+backward time, in `dt` and (TE on CUDA) with Megatron's blockwise FP8. -> (rows, failed)."""
    from benchmarks import _megatron_moe as megatron_moe

    have, why = megatron_moe.available()
    if not have:
        return {"megatron_core": f"unavailable ({why})"}, False
    from patches.megatron_cpu import cpu_shims

    T, H = x.shape[1], x.shape[2]
    I = ours.experts.down_proj.shape[2]
    out, failed = {"megatron_core_version": why}, False
    with cpu_shims():  # on CPU only (the --dry-run): nothing is patched where CUDA is available
        megatron_moe.ensure_parallel_state(dev)
        for fp8 in (False, True):
            key = "megatron_core_fp8" if fp8 else "megatron_core"
            try:
                layer, info = megatron_moe.build(ours, dt, dev, fp8=fp8)
            except ValueError as e:  # FP8 without TE on CUDA: not measurable here, said so
                out[key] = f"unavailable ({e})"
                continue
            try:
                mod = _BTH(layer)
                if not fp8:
                    with torch.no_grad():
                        ref, got = ours(x), mod(x)
                    # both in `dt`: the stored fc1 / activation / fc2 / combine results rounded (4 u) plus FP32
                    # accumulation over fc1 (H), fc2 (I) and the top-8 + shared sum, on each side; normwise proxy
                    unit = 2.0**-8 if dt == torch.bfloat16 else 2.0**-24
                    bound = 2 * (4 * unit + (H + I + 9) * 2.0**-24) * ref.abs().max()
                    within = _within(got, ref, bound)
                    out["ours_vs_megatron_core"] = {**_diff(got, ref), "within_bound": within}
                    # FP32 (the CPU check): same routing, same products; a wrong weight mapping fails here. In
                    # BF16 a near-tie of router scores may pick another expert on one side: reported, not failed.
                    failed |= dt == torch.float32 and not within
                t = _time_fwd_bwd(mod, x, g_out, repeats, dev)
                out[key] = {"tokens_per_s": T / t, "tflops": flops / t / 1e12, "ms": t * 1e3, **info}
            except Exception as e:  # noqa: BLE001 — reported in the row; the section then fails
                out[key] = f"error ({type(e).__name__}: {str(e)[:300]})"
                failed = True
            del layer
    return out, failed


def sec_moe(args, res):
    from benchmarks.moe import moe_flops
    from dsv3_plugin.precision.fp8.experts import Fp8ExpertKernel

    dev = args.device
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    T, H, I, R = (args.shapes[k] for k in ("moe_tokens", "moe_hidden", "moe_ffn", "repeats"))
    peak = (res.get("env") or {}).get("peak_tflops")
    out = {
        "status": "ok",
        "dtype": str(dt),
        "tokens": T,
        "hidden": H,
        "expert_ffn": I,
        "top_k": 8,
        "timing": f"best of {R} forward+backward passes after one warm-up",
    }
    failed = False
    for E in args.shapes["moe_local_experts"]:
        ours, theirs, x = _moe_pair(dev, dt, T, H, I, E)
        g_out = torch.randn_like(x)
        flops = moe_flops(T, H, I, E, 8, 1)
        row = {"flops_per_pass": flops, "rows_per_expert": T * 8 / E}
        with torch.no_grad():
            y1, y2 = ours(x), theirs(x)
        row["ours_vs_transformers"] = _diff(y1, y2)
        for name, mod in (("ours", ours), ("transformers_eager", theirs)):
            t = _time_fwd_bwd(mod, x, g_out, R, dev)
            row[name] = {"tokens_per_s": T / t, "tflops": flops / t / 1e12, "ms": t * 1e3}
        try:
            theirs.config._experts_implementation = "grouped_mm"
            t = _time_fwd_bwd(theirs, x, g_out, R, dev)
            row["transformers_grouped_mm"] = {"tokens_per_s": T / t, "tflops": flops / t / 1e12, "ms": t * 1e3}
        except Exception as e:  # noqa: BLE001
            row["transformers_grouped_mm"] = f"unavailable ({type(e).__name__}: {str(e)[:160]})"
        mg, mg_failed = _megatron_rows(dev, dt, ours, x, g_out, R, flops)
        row.update(mg)
        failed |= mg_failed
        # FP8: routed experts on the FP8 path, shared expert's Linears as Fp8Linear, backend `auto` for the device
        cfg = FP8Config(enabled=True)
        be, why = select_backend(cfg, dev)
        r = Fp8Recipe.from_config(cfg)
        ours.experts.kernel = Fp8ExpertKernel(r, be)
        for n in ("gate_proj", "up_proj", "down_proj"):
            setattr(ours.shared_experts, n, Fp8Linear.from_linear(getattr(ours.shared_experts, n), r, be))
        t = _time_fwd_bwd(ours, x, g_out, R, dev)
        row["ours_fp8"] = {
            "tokens_per_s": T / t,
            "tflops": flops / t / 1e12,
            "ms": t * 1e3,
            "backend": be.name,
            "backend_reason": why,
        }
        base = max((v["tokens_per_s"] for k, v in row.items() if k.startswith("transformers") and isinstance(v, dict)))
        row["ratio_vs_best_transformers"] = row["ours"]["tokens_per_s"] / base
        row["ratio_fp8_vs_best_transformers"] = row["ours_fp8"]["tokens_per_s"] / base
        row["ratio_fp8_vs_ours_bf16"] = row["ours_fp8"]["tokens_per_s"] / row["ours"]["tokens_per_s"]
        for ours_key, mg_key in (("ours", "megatron_core"), ("ours_fp8", "megatron_core_fp8")):
            if isinstance(row.get(mg_key), dict):
                row[f"ratio_{ours_key}_vs_{mg_key}"] = row[ours_key]["tokens_per_s"] / row[mg_key]["tokens_per_s"]
        if peak:
            row["fraction_of_peak"] = {
                "ours": row["ours"]["tflops"] / peak["bf16"],
                "ours_fp8": row["ours_fp8"]["tflops"] / peak["fp8"],
            }
        out[f"local_experts_{E}"] = row
        del ours, theirs, x, g_out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        out["status"] = "fail"
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    res = {
        "dry_run": args.dry_run,
        "shapes": {k: list(v) if isinstance(v, tuple) else v for k, v in args.shapes.items()},
    }
    fns = {name: globals()[f"sec_{name}"] for name in SECTIONS}
    for name in SECTIONS:
        if name not in args.sections:
            res[name] = {"status": "skipped", "reason": "not requested (--sections)"}
            continue
        if time.perf_counter() - t0 > args.budget_s:
            res[name] = {"status": "skipped", "reason": f"time budget of {args.budget_s:.0f} s spent"}
            continue
        if name != "env" and res.get("env", {}).get("status") == "error":
            res[name] = {"status": "skipped", "reason": "environment unusable (see env)"}
            continue
        ts = time.perf_counter()
        try:
            res[name] = fns[name](args, res)
        except Exception as e:  # noqa: BLE001 — report and go on with the other sections
            res[name] = {
                "status": "error",
                "reason": f"{type(e).__name__}: {str(e)[:400]}",
                "traceback": traceback.format_exc()[-1500:],
            }
        res[name]["seconds"] = time.perf_counter() - ts
        print(f"[gpu-check] {name}: {res[name]['status']} ({res[name]['seconds']:.1f} s)", file=sys.stderr)
    res["failures"] = [n for n in SECTIONS if res[n]["status"] in ("fail", "error")]
    res["ok"] = not res["failures"]
    res["seconds"] = time.perf_counter() - t0
    text = json.dumps(res, indent=2, default=float)
    print(text)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
