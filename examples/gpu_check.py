"""Check dsv3-plugin's FP8 GPU backends against its exact CPU-semantics emulation (run on a Hopper GPU).

    PYTHONPATH=. python examples/fp8_gpu_check.py            # prints one JSON object; exit 0 = all checks pass
    PYTHONPATH=. python examples/fp8_gpu_check.py --device cpu   # dry run of the script itself (emulation only)

What it checks (each part is skipped, with the reason, when its backend cannot run here):
  1. backend selection (`auto`) and why;
  2. torch blockwise `_scaled_mm` (1x128 x 128x128 Fprop/Dgrad, 1x128 x 1x128 Wgrad) vs the emulation on the
     same FP8 operands: differences must be FP32 accumulation-order noise (rel. < 1e-3);
  3. `Fp8Linear` forward + both gradients: torch backend and Transformer Engine Float8BlockScaling vs the
     emulation (TE quantizes itself, so only FP8-level agreement, rel. < 2e-2, is expected);
  4. 5 steps of the tiny DSv3 model with fp8.enabled on the GPU vs the emulated backend (loss rel. < 1e-3);
  5. GEMM throughput: blockwise FP8 vs BF16 at 4096x7168x7168 (reported, not asserted).
"""
import json
import sys
import time

import torch

from dsv3_plugin.config import FP8Config, load_config
from dsv3_plugin.fp8_linear import (EmulatedBackend, Fp8Linear, Fp8Recipe, TorchScaledMMBackend,
                                    torch_blockwise_available, select_backend)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    res, ok = {"torch": torch.__version__, "cuda": torch.version.cuda}, True
    dev = torch.device(sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({**res, "error": "no CUDA device"}))
        return 1
    if dev.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(dev)
        res["capability"] = list(torch.cuda.get_device_capability(dev))
    try:
        import transformer_engine
        res["transformer_engine"] = transformer_engine.__version__
    except Exception as e:  # noqa: BLE001
        res["transformer_engine"] = f"not importable ({type(e).__name__})"
    be, why = select_backend(FP8Config(), dev)
    res["auto_backend"], res["auto_reason"] = be.name, why

    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 1000, generator=g).to(dev)           # ragged in every dim
    w = (torch.randn(700, 1000, generator=g) * 0.02).to(dev)
    dy = torch.randn(300, 700, generator=g).to(dev)
    r, emu = Fp8Recipe(), EmulatedBackend()

    torch_ok, torch_why = torch_blockwise_available(dev)
    res["torch_scaled_mm"] = {"available": torch_ok, "reason": torch_why}
    if torch_ok:
        tb = TorchScaledMMBackend()
        qw, sw, kw = r.weight(w)
        cases = {"fprop": (r.act(x), (qw, sw, kw)), "dgrad": (r.act(dy), (qw.t(), sw.t(), kw)),
                 "wgrad": (r.act(dy.t()), r.act(x.t()))}
        for name, (a, b) in cases.items():
            e = rel(tb.gemm(*a, *b), emu.gemm(*a, *b))
            res["torch_scaled_mm"][name + "_rel_vs_emulation"] = e
            ok &= e < 1e-3

    def linear_grads(backend):
        lin = Fp8Linear(1000, 700, bias=False, recipe=r, backend=backend, device=dev)
        with torch.no_grad():
            lin.weight.copy_(w)
        xx = x.clone().requires_grad_()
        y = lin(xx)
        y.backward(dy)
        return y.detach(), xx.grad, lin.weight.grad

    ref = linear_grads(emu)
    others = {}
    if torch_ok:
        others["torch"] = TorchScaledMMBackend()
    try:
        others["te"] = select_backend(FP8Config(backend="te"), dev)[0]
    except Exception as e:  # noqa: BLE001
        res["te_linear"] = f"skipped: {e}"
    for name, b in others.items():
        try:
            got = linear_grads(b)
        except Exception as e:  # noqa: BLE001 — report and continue with the other checks
            res[f"{name}_linear_error"] = f"{type(e).__name__}: {e}"[:400]
            ok = False
            continue
        errs = {k: rel(a, c) for k, a, c in zip(("y", "dx", "dw"), got, ref)}
        res[f"{name}_linear_rel_vs_emulation"] = errs
        ok &= max(errs.values()) < (1e-3 if name == "torch" else 2e-2)

    try:
        ok &= check_model(dev, res)
    except Exception as e:  # noqa: BLE001
        res["model_error"] = f"{type(e).__name__}: {e}"[:400]
        ok = False
    if torch_ok:
        res["gemm_4096x7168x7168"] = gemm_speed(dev, r)
    res["ok"] = bool(ok)
    print(json.dumps(res, indent=2))
    return 0 if ok else 1


def check_model(dev, res) -> bool:
    """A few training steps of the tiny model: the auto-selected GPU backend vs the emulation."""
    from dsv3_plugin.model import DSv3Model
    cfg = load_config({"preset": "tiny", "fp8": {"enabled": True}})
    losses = {}
    for name, backend in (("auto", "auto"), ("emulate", "emulate")):
        c = load_config({**cfg.to_dict(), "fp8": {"enabled": True, "backend": backend}})
        torch.manual_seed(0)
        m = DSv3Model(c)
        m.reset_parameters(seed=0)
        m.to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1)).to(dev)
        ls = []
        for _ in range(5 if dev.type == "cuda" else 2):
            out = m(ids, torch.roll(ids, -1, 1))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
            ls.append(out.loss.item())
        losses[name] = ls
        res[f"model_{name}_backend"] = m.fp8_report.backend
    res["model_losses"] = losses
    e = max(abs(a - b) / abs(b) for a, b in zip(losses["auto"], losses["emulate"]))
    res["model_loss_rel_auto_vs_emulation"] = e
    return e < 1e-3


def gemm_speed(dev, r) -> dict:
    M, K, N = 4096, 7168, 7168
    a = torch.randn(M, K, device=dev)
    b = torch.randn(N, K, device=dev) * 0.02
    qa, sa, ka = r.act(a)
    qb, sb, kb = r.weight(b)
    tb, ab, bb = TorchScaledMMBackend(), a.bfloat16(), b.bfloat16()

    def timeit(fn):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / 10
    t8, t16 = timeit(lambda: tb.gemm(qa, sa, ka, qb, sb, kb)), timeit(lambda: ab @ bb.t())
    return {"fp8_blockwise_TFLOPs": 2 * M * K * N / t8 / 1e12, "bf16_TFLOPs": 2 * M * K * N / t16 / 1e12,
            "ratio": t16 / t8, "note": "times include the scale-layout copies (no operand padding at this shape)"}


if __name__ == "__main__":
    sys.exit(main())
