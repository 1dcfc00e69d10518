"""Whole-model training step (forward + LM loss + backward) of our DSv3Model vs transformers' DeepseekV3ForCausalLM
vs torchtitan's DeepSeekV3Model, same config, same parameter count, same batch.

Per sequence length and dtype: CPU and wall time per step (median, each implementation in its own child process,
interleaved round by round), peak RSS, a per-part breakdown (each part's forward + backward timed standalone on the
inputs it saw), parameter counts per part (the bench fails when the totals differ), and for ours the matrix
products' time and FLOPs against a 2048³ GEMM's rate (`ratio_if_gemm_at_peak`). Excluded alike: MTP, the balance
loss, YaRN. torchtitan is optional (extra `peers`): when it does not import, the bench says so (`skipped`).
`--train` measures the training-loop tax instead (`benchmarks._train_overhead`).

Design notes (what is timed, the breakdown, the GEMM ceiling, the peers' setup): docs/design_notes.md#bench-model
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import time

from benchmarks import _model_impls as model_impls
from benchmarks import positive_int, run_child
from benchmarks._gemm_profile import gemm_rate, profile_gemms
from benchmarks._train_overhead import train_tax

__all__ = ["add_arguments", "run", "PARTS", "IMPLS", "titan_import_error"]

IMPLS = ("ours", "hf", "titan")
PARTS = ("attention", "routed_experts", "router", "dense_shared_mlp", "head_loss", "norms", "embedding")
_DTYPES = ("float32", "bfloat16")
_MIB = 2**20

# module-name patterns of each part, per implementation (dense_shared_mlp also checks the class: an MoE layer's
# own module shares the dense layers' name)
_PATTERNS = {
    "ours": {
        "attention": r"layers\.\d+\.self_attn",
        "routed_experts": r"layers\.\d+\.mlp\.experts",
        "router": r"layers\.\d+\.mlp\.gate",
        "dense_shared_mlp": r"layers\.\d+\.mlp(\.shared_experts)?",
        "head_loss": r"lm_head",
        "norms": r"layers\.\d+\.(input_layernorm|post_attention_layernorm)|norm",
        "embedding": r"embed_tokens",
    },
    "hf": {
        "attention": r"model\.layers\.\d+\.self_attn",
        "routed_experts": r"model\.layers\.\d+\.mlp\.experts",
        "router": r"model\.layers\.\d+\.mlp\.gate",
        "dense_shared_mlp": r"model\.layers\.\d+\.mlp(\.shared_experts)?",
        "head_loss": r"lm_head",
        "norms": r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)|model\.norm",
        "embedding": r"model\.embed_tokens",
    },
    "titan": {
        "attention": r"layers\.\d+\.attention",
        "routed_experts": r"layers\.\d+\.moe\.routed_experts",
        "router": r"layers\.\d+\.moe\.router",
        "dense_shared_mlp": r"layers\.\d+\.(feed_forward|moe\.shared_experts)",
        "head_loss": r"lm_head",
        "norms": r"layers\.\d+\.(attention_norm|ffn_norm)|norm",
        "embedding": r"tok_embeddings",
    },
}
_MLP_CLASSES = {"DenseMLP", "DeepseekV3MLP", "FeedForward"}


def _csv(kind, allowed=None, required=None):
    def parse(text: str):
        items = [s.strip() for s in text.split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list (got {text!r})")
        out = [kind(s) for s in items]
        bad = [s for s in out if allowed is not None and s not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(str, bad))} (choose from {', '.join(allowed)})")
        if len(set(out)) != len(out):
            raise argparse.ArgumentTypeError(f"repeated entry in {text!r}")
        if required is not None and required not in out:
            raise argparse.ArgumentTypeError(f"must include {required} (the figures are peer / {required})")
        return out

    return parse


def add_arguments(p) -> None:
    p.add_argument("--seq-lens", type=_csv(positive_int), default=[256, 1024], help="T values, e.g. 256,1024,4096")
    p.add_argument("--dtypes", type=_csv(str, _DTYPES), default=list(_DTYPES), help="float32,bfloat16")
    p.add_argument("--impls", type=_csv(str, IMPLS, "ours"), default=list(IMPLS), help="ours,hf,titan (ours required)")
    p.add_argument("--batch", type=positive_int, default=4, help="B, sequences per step")
    p.add_argument("--preset", choices=("tiny", "small"), default="small", help="model shape (small: dim 256)")
    p.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (one child per impl each)")
    p.add_argument("--steps", type=positive_int, default=2, help="timed steps per child (after the warm-up steps)")
    p.add_argument(
        "--warmup",
        type=positive_int,
        default=3,
        help="untimed steps first (the first few are slower: fresh pages, the allocator's thresholds settling)",
    )
    p.add_argument("--part-repeats", type=positive_int, default=3, help="standalone timings per part")
    p.add_argument(
        "--no-breakdown", action="store_true", help="skip the per-part breakdown (and with it our GEMM ceiling, `gemm`)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0 = torch's default)")
    p.add_argument("--png", default=None, help="write the breakdown as a PNG here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train",
        action="store_true",
        help="instead: the training-loop tax, `dsv3 train` (1 and 2 gloo ranks) vs the bare fwd + bwd + AdamW step, "
        "at the first --seq-lens value, fp32",
    )
    p.add_argument("--train-steps", type=positive_int, default=12, help="--train: steps of each run")
    p.add_argument(
        "--fused-adamw",
        action="store_true",
        help='--train: torch\'s fused AdamW kernel on both sides ("fused": true in the optimizer params)',
    )
    p.add_argument(
        "--no-flat-grads",
        action="store_true",
        help="--train: dsv3 train with memory.flat_grads false (DeepSpeed's own ZeRO-1 gradient copies)",
    )
    p.add_argument(
        "--no-chunked-step",
        action="store_true",
        help="--train: dsv3 train with memory.chunked_step false (DeepSpeed's own optimizer step, full-size "
        "temporaries)",
    )
    p.add_argument(
        "--fp32-grad-norm",
        action="store_true",
        help="--train: dsv3 train with memory.grad_norm fp32 (FP32 pieces of the flat gradients, as the bare "
        "step's clip_grad_norm_, instead of DeepSpeed's FP64 norm per parameter)",
    )


def titan_import_error() -> str | None:
    """None when torchtitan's DeepSeek-V3 model imports, else why not (exception type and message)."""
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
    except Exception as e:  # whatever stops the import (missing module, a broken dependency) is the reason
        return f"{type(e).__name__}: {e}"
    return None


def run(args) -> dict:
    for flag, on in (
        ("--fused-adamw", args.fused_adamw),
        ("--no-flat-grads", args.no_flat_grads),
        ("--fp32-grad-norm", args.fp32_grad_norm),
        ("--no-chunked-step", args.no_chunked_step),
    ):
        if on and not args.train:
            print(f"error: {flag}: only with --train (a setting of the training-loop tax)", file=sys.stderr)
            raise SystemExit(2)
    if args.fp32_grad_norm and args.no_flat_grads:
        print(
            "error: --fp32-grad-norm: the FP32 norm is taken over the flat gradients, not with --no-flat-grads",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if args.train:
        if args.train_steps <= args.warmup:
            print(f"error: --train-steps {args.train_steps}: must exceed --warmup {args.warmup}", file=sys.stderr)
            raise SystemExit(2)
        block = model_impls.bench_config(args.preset, args.seq_lens[0]).to_dict()
        res = train_tax(
            block,
            args.batch,
            args.seq_lens[0],
            args.train_steps,
            args.warmup,
            args.fused_adamw,
            not args.no_flat_grads,
            "fp32" if args.fp32_grad_norm else "fp64",
            not args.no_chunked_step,
        )
        res.update(
            bench="model --train",
            preset=args.preset,
            figure="tokens/s: dsv3 train on 1 rank (ours) vs the bare model step in one process (baseline)",
            ours=res["train_1rank"]["tokens_per_s"],
            baseline=res["bare"]["tokens_per_s"],
            ratio=res["train_1rank"]["tokens_per_s"] / res["bare"]["tokens_per_s"],
        )
        return res
    impls, skipped = list(args.impls), {}
    if "titan" in impls:
        why = titan_import_error()
        if why is not None:
            impls.remove("titan")
            skipped["titan"] = f"torchtitan not importable ({why}); install the `peers` extra to measure it"
            print(f"[bench model] torchtitan skipped: {skipped['titan']}", file=sys.stderr)
    results = []
    for T in args.seq_lens:
        for dtype in args.dtypes:
            results.append(_measure(args, impls, T, dtype))
    out = {
        "bench": "model",
        "preset": args.preset,
        "batch": args.batch,
        "impls": impls,
        "skipped": skipped,
        "excluded": {
            "mtp": "not built by transformers' DeepseekV3ForCausalLM: ours mtp.depth = 0, torchtitan no mtp_layers",
            "balance_loss": "ours seq_aux_alpha = 0 (the peers compute no sequence-wise balance loss)",
            "yarn": "plain RoPE in all three",
        },
        "timing": "median per step over rounds × steps, after --warmup steps (children interleaved); CPU time = "
        "process_time of the child",
        "peak_memory": "child process ru_maxrss after its timed steps (imports included)",
        "breakdown_method": "inputs captured with forward hooks during one step, each part's fwd+bwd timed alone",
        # CPU time peer / ours per (T, dtype): > 1 means ours is faster
        "ratio": {f"T={r['T']} {r['dtype']}": r["ratio"] for r in results},
        # wall time peer / ours if our step's matrix products ran at the rate of one 2048³ GEMM (module docstring)
        "ratio_if_gemm_at_peak": {
            f"T={r['T']} {r['dtype']}": r["ratio_if_gemm_at_peak"] for r in results if "ratio_if_gemm_at_peak" in r
        },
        "results": results,
    }
    if args.png:
        _plot(results, args.png)
        out["png"] = args.png
    return out


def _measure(args, impls, T, dtype) -> dict:
    spec = {"preset": args.preset, "T": T, "B": args.batch, "dtype": dtype, "steps": args.steps, "seed": args.seed}
    spec.update(threads=args.threads, part_repeats=args.part_repeats, warmup=args.warmup)
    runs = {i: [] for i in impls}
    for r in range(args.rounds):
        for impl in impls:  # interleaved: one child per implementation per round
            s = dict(spec, breakdown=(r == 0 and not args.no_breakdown))
            res = run_child("benchmarks.model", impl, [json.dumps(s)])
            runs[impl].append(res)
            print(
                f"[bench model] T={T} {dtype} round {r} {impl}: cpu {statistics.median(res['cpu_s']) * 1e3:.0f} ms, "
                f"wall {statistics.median(res['wall_s']) * 1e3:.0f} ms, peak {res['peak_rss_mib']:.0f} MiB",
                file=sys.stderr,
            )
        if r == 0:
            _check_counts({i: runs[i][0]["params"] for i in impls})
    per = {}
    for impl, rs in runs.items():
        cpu = [t for r in rs for t in r["cpu_s"]]
        wall = [t for r in rs for t in r["wall_s"]]
        per[impl] = {
            "name": rs[0]["name"],
            "cpu_ms": statistics.median(cpu) * 1e3,
            "wall_ms": statistics.median(wall) * 1e3,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "rss_after_build_mib": max(r["rss_after_build_mib"] for r in rs),
            "loss": rs[0]["loss"],
            "params": rs[0]["params"],
            "notes": rs[0]["notes"],
        }
        if rs[0].get("breakdown") is not None:
            per[impl]["breakdown"] = rs[0]["breakdown"]
        if rs[0].get("gemm") is not None:
            per[impl]["gemm"] = rs[0]["gemm"]
    ours = per["ours"]
    ratio = {p: per[p]["cpu_ms"] / ours["cpu_ms"] for p in per if p != "ours"}
    ratio_wall = {p: per[p]["wall_ms"] / ours["wall_ms"] for p in per if p != "ours"}
    out = {"T": T, "dtype": dtype, "tokens_per_step": T * args.batch, **per, "ratio": ratio, "ratio_wall": ratio_wall}
    if "gemm" in ours:
        g = ours["gemm"]
        g["rate_fraction"] = g["gflop"] / (g["ms"] / 1e3) / g["peak_gflops"] if g["ms"] > 0 else None
        at_peak_ms = ours["wall_ms"] - g["ms"] + g["gflop"] / g["peak_gflops"] * 1e3  # wall times (docstring)
        out["ratio_if_gemm_at_peak"] = {p: per[p]["wall_ms"] / at_peak_ms for p in per if p != "ours"}
    return out


def _check_counts(params: dict) -> None:
    totals = {i: p["total"] for i, p in params.items()}
    if len(set(totals.values())) == 1:
        return
    parts = sorted({k for p in params.values() for k in p["by_part"]})
    diff = [f"{k}: " + ", ".join(f"{i} {p['by_part'].get(k, 0)}" for i, p in params.items()) for k in parts]
    diff = [d for d, k in zip(diff, parts) if len({p["by_part"].get(k, 0) for p in params.values()}) > 1]
    raise RuntimeError(f"parameter counts differ ({totals}); by part: " + "; ".join(diff))


def _plot(results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f"T={r['T']} {r['dtype']} {i}", r[i]) for r in results for i in IMPLS if i in r and "breakdown" in r[i]]
    if not rows:
        raise RuntimeError("--png: no breakdown measured (drop --no-breakdown)")
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    for y, (_, res) in enumerate(rows):
        left = 0.0
        for j, part in enumerate((*PARTS, "other")):
            w = res["breakdown"]["cpu_ms"][part] if part != "other" else max(res["breakdown"]["other_cpu_ms"], 0.0)
            ax.barh(y, w, left=left, color=f"C{j}", label=part if y == 0 else None)
            left += w
    ax.set_yticks(range(len(rows)), [n for n, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("CPU ms per step (fwd + bwd, parts timed standalone)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- child


def _child(impl: str, spec_json: str) -> None:
    spec = json.loads(spec_json)
    import torch

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    B, T, dtype = spec["B"], spec["T"], getattr(torch, spec["dtype"])
    built = model_impls.build(impl, spec["preset"], T, dtype)
    model = built.model
    ids_BT = torch.randint(0, built.vocab, (B, T), generator=torch.Generator().manual_seed(spec["seed"] + 1))
    step = built.step_fn(ids_BT)
    rss_build = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cpu, wall, loss = [], [], None
    for i in range(spec["warmup"] + spec["steps"]):
        model.zero_grad(set_to_none=True)
        c0, w0 = time.process_time(), time.perf_counter()
        loss = step()
        c1, w1 = time.process_time(), time.perf_counter()
        if i >= spec["warmup"]:
            cpu.append(c1 - c0), wall.append(w1 - w0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "name": built.name,
        "notes": built.notes,
        "cpu_s": cpu,
        "wall_s": wall,
        "loss": float(loss),
        "peak_rss_mib": peak / _MIB,
        "rss_after_build_mib": rss_build / _MIB,
        "params": _param_counts(impl, model),
    }
    if spec["breakdown"]:
        bd = model_impls.breakdown(impl, built, ids_BT, _PATTERNS[impl], _MLP_CLASSES, spec["part_repeats"])
        bd["sum_cpu_ms"] = sum(bd["cpu_ms"].values())
        bd["step_cpu_ms"] = statistics.median(cpu) * 1e3
        bd["other_cpu_ms"] = bd["step_cpu_ms"] - bd["sum_cpu_ms"]
        out["breakdown"] = bd
        if impl == "ours":
            model.zero_grad(set_to_none=True)
            out["gemm"] = dict(profile_gemms(step), peak_gflops=gemm_rate(dtype))
    print(json.dumps(out))


def _param_counts(impl: str, model) -> dict:
    """Parameters in total (tied ones once) and per part: each parameter goes to the part whose module pattern
    matches the longest prefix of its name."""
    pats = _PATTERNS[impl]
    by_part: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        part, best = "other", -1
        for k, pat in pats.items():
            m = re.match(f"(?:{pat})(?=\\.|$)", name)
            if m and m.end() > best:
                part, best = k, m.end()
        by_part[part] = by_part.get(part, 0) + p.numel()
    return {"total": sum(by_part.values()), "by_part": by_part}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(
            "usage: python -m benchmarks model [--json] (this module's __main__ is the bench's child process)"
        )
