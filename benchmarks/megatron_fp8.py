"""Megatron `pretrain()` step time with the plugin's FP8 (MLA projections, dense / shared-expert MLPs and routed
experts, DeepSeek-V3's blockwise recipe) vs the same run without FP8.

Two runs of `python -m dsv3_plugin.megatron.pretrain_gpt --nproc N` (Megatron-LM's own training loop, mock data, the
same model, seed and flags), one after the other in this process's run: `ours` adds `--fp8-format e4m3 --fp8-recipe
blockwise`, the `baseline` has no FP8 (fp32 on CPU, `--bf16` on CUDA). Step time: Megatron's own "elapsed time per
iteration" log (`--log-interval 1`), the median over the iterations after `--warmup`. `ratio` = baseline / ours
(> 1: FP8 is faster). On CPU the FP8 GEMMs are the exact emulation (quantize, per-128 FP32 promotion in Python), so
the ratio there is the emulation's cost, not a speed-up; the DeepSeek-V3 target (>= 1.3x) is a GPU figure (Hopper,
cuBLAS blockwise or Transformer Engine). Needs megatron-core >= 0.19 (`megatron.training`); with an older one it
prints why and exits 2.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from benchmarks import ROOT, positive_int

__all__ = ["add_arguments", "run", "step_times"]

_ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def add_arguments(p):
    p.add_argument("--nproc", type=positive_int, default=1, help="data-parallel ranks (spawned processes)")
    p.add_argument("--layers", type=positive_int, default=3, help="decoder layers of the tiny preset")
    p.add_argument(
        "--config", default=None, help='JSON file with a "dsv3" block (default: the tiny preset with --layers)'
    )
    p.add_argument("--micro-batch", type=positive_int, default=2, help="--micro-batch-size")
    p.add_argument("--seq-len", type=positive_int, default=64, help="--seq-length")
    p.add_argument("--iters", type=positive_int, default=6, help="iterations per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations left out of the figures")


def step_times(log: str) -> dict[int, float]:
    """Megatron's per-iteration step times (seconds) from its training log (`--log-interval 1`).

    Args:
        log: the run's stdout.

    Returns:
        {iteration: seconds}.
    """
    return {int(m.group(1)): float(m.group(2)) / 1000.0 for m in _ELAPSED.finditer(log)}


def _flags(args, cfg_path: str, fp8: bool, cuda: bool) -> list[str]:
    f = ["--nproc", str(args.nproc), "--dsv3-config", cfg_path, "--micro-batch-size", str(args.micro_batch)]
    f += ["--global-batch-size", str(args.micro_batch * args.nproc), "--seq-length", str(args.seq_len)]
    f += ["--train-iters", str(args.iters), "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    f += ["--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0", "--seed", "1234"]
    if cuda:
        f += ["--bf16"]
    if fp8:
        f += ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
    return f


def run(args) -> dict:
    from importlib.util import find_spec

    import torch

    if find_spec("megatron") is None or find_spec("megatron.training") is None:
        print(
            "error: python -m benchmarks megatron-fp8: needs megatron-core >= 0.19 (megatron.training, Megatron's "
            "pretrain() loop); this environment has none",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.warmup < 0 or args.warmup >= args.iters:
        print(f"error: --warmup {args.warmup}: must be >= 0 and < --iters {args.iters}", file=sys.stderr)
        raise SystemExit(2)
    cuda = torch.cuda.is_available()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [ROOT, env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    res: dict = {
        "nproc": args.nproc,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "iters": args.iters,
        "warmup": args.warmup,
        "device": "cuda" if cuda else "cpu",
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="dsv3-bench-megatron-fp8-") as tmp:
        cfg_path = args.config
        if cfg_path is None:
            cfg_path = os.path.join(tmp, "ds.json")
            with open(cfg_path, "w") as f:
                json.dump({"dsv3": {"preset": "tiny", "model": {"num_hidden_layers": args.layers}}}, f)
        res["config"] = args.config or f"tiny preset, {args.layers} layers"
        for name, fp8 in (("fp8", True), ("baseline", False)):
            cmd = [sys.executable, "-m", "dsv3_plugin.megatron.pretrain_gpt", *_flags(args, cfg_path, fp8, cuda)]
            p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"pretrain_gpt ({name}) failed:\n{p.stderr[-4000:]}")
            times = step_times(p.stdout)
            measured = [t for it, t in sorted(times.items()) if it > args.warmup]
            if not measured:
                raise RuntimeError(f"pretrain_gpt ({name}): no step times in its log after iteration {args.warmup}")
            line = next((x for x in p.stdout.splitlines() if x.startswith("dsv3_plugin: FP8 (")), None)
            res["runs"][name] = {"step_s": statistics.median(measured), "step_times_s": measured, "fp8_line": line}
    ours, base = res["runs"]["fp8"]["step_s"], res["runs"]["baseline"]["step_s"]
    res["figure"] = (
        "Megatron pretrain() median step time: the plugin's FP8 (MLA, MLPs, routed experts; ours) vs without FP8 "
        "(baseline: " + ("BF16" if cuda else "fp32; FP8 is the exact CPU emulation, so ratio < 1 is its cost") + ")"
    )
    res["ours"], res["baseline"], res["ratio"] = ours, base, base / ours
    return res
