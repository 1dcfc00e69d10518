"""Checkpoint conversion: throughput and peak RSS of the streaming FP8 -> BF16 converter vs load-all-then-save.

A synthetic sharded FP8 checkpoint with V3-shaped layers is generated at each requested size; each approach runs in
its own child process (peak RSS = its ru_maxrss): ours (`checkpoint.convert(..., to="hf-bf16")`), the baseline
(load every shard, dequantize with DeepSeek's per-block formula in plain torch, save per shard), a plain copy (the
I/O ceiling) and, at the largest size, ours without the non-finite checks (what they cost). Figures are GB/s of
input bytes; `ratio` = ours / baseline at the largest size, `fraction_of_copy` = ours / copy.

Design notes (the approaches, the checks' cost, peak RSS): docs/design_notes.md#bench-convert
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

from benchmarks import positive_int, run_child
from dsv3_plugin.checkpoint.convert import convert
from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint

__all__ = ["add_arguments", "run", "make_synthetic_checkpoint"]

_H, _HEADS, _QL, _KVL, _NOPE, _ROPE, _V, _MI = 7168, 128, 1536, 512, 128, 64, 128, 2048


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes-gb",
        default="0.6,1.8",
        help="input sizes (GB of FP8 checkpoint), comma-separated; throughput is measured at the largest",
    )
    p.add_argument("--shard-mb", type=positive_int, default=256, help="input shard size (MiB)")
    p.add_argument("--dir", default=None, help="where to create the temporary checkpoints (default: $TMPDIR)")
    p.add_argument("--skip-baseline-small", action="store_true", help="run the baseline only at the largest size")


def _config(target_bytes: float, n_experts: int = 8, heads: int = _HEADS) -> dict:
    """A V3-shaped HF config whose FP8 checkpoint is about `target_bytes`: MoE layers of ~0.6 GB (MLA with
    `heads` heads + `n_experts` routed + 1 shared expert; 128 heads and 8 experts by default), as many as fit."""
    E = n_experts
    attn = (
        _QL * _H + heads * (_NOPE + _ROPE) * _QL + (_KVL + _ROPE) * _H + heads * (_NOPE + _V) * _KVL + _H * heads * _V
    )
    L = max(1, int(round(target_bytes / (attn + (E + 1) * 3 * _MI * _H))))
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 4096,
        "hidden_size": _H,
        "intermediate_size": 18432,
        "moe_intermediate_size": _MI,
        "num_hidden_layers": L,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "n_shared_experts": 1,
        "n_routed_experts": E,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": _KVL,
        "q_lora_rank": _QL,
        "qk_rope_head_dim": _ROPE,
        "v_head_dim": _V,
        "qk_nope_head_dim": _NOPE,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def make_synthetic_checkpoint(
    path: str, target_bytes: float, shard_bytes: int, n_experts: int = 8, heads: int = _HEADS
) -> dict:
    """Write the benchmark's FP8 checkpoint; FP8 payloads are cut from one random pool (content does not
    change the cost of dequantization; the E4M3 NaN codes are avoided). `n_experts` / `heads` reshape its
    layers (fewer heads, more experts: a checkpoint whose bytes sit mostly in experts, as V3's do)."""
    import torch

    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (64 * 2**20,), dtype=torch.uint8, generator=g)
    pool[(pool & 0x7F) == 0x7F] = 0x3F
    state = {"off": 0}

    def fp8_tensor(name, shape):
        n = shape[0] * shape[1]
        o = state["off"] % (pool.numel() - n) if n < pool.numel() else 0
        state["off"] += 7919 * 4096
        data = pool[o : o + n] if n <= pool.numel() else pool.repeat(-(-n // pool.numel()))[:n]
        grid = (-(-shape[0] // 128), -(-shape[1] // 128))
        return data.clone().view(torch.float8_e4m3fn).view(shape), torch.rand(grid, generator=g) * 1e-3

    def make(name, shape):
        return torch.randn(shape, generator=g) * 0.02

    cfg = _config(target_bytes, n_experts, heads)
    write_released_checkpoint(path, cfg, make, fp8=True, shard_bytes=shard_bytes, fp8_tensor=fp8_tensor)
    return cfg


# ---------------------------------------------------------------------------------------------- child
def _baseline(src: str, dst: str) -> None:
    """Load everything, dequantize with the plain formula, save shard by shard."""
    import torch
    from safetensors.torch import load_file, save_file

    idx_path = os.path.join(src, "model.safetensors.index.json")
    with open(idx_path) as f:
        wmap = json.load(f)["weight_map"]
    state = {}
    for fn in sorted(set(wmap.values())):
        state.update(load_file(os.path.join(src, fn)))
    out = {}
    for name, t in state.items():
        if name.endswith("_scale_inv"):
            continue
        if t.element_size() == 1:
            s = state[name + "_scale_inv"]
            O, I = t.shape
            s_full = s.repeat_interleave(128, 0)[:O].repeat_interleave(128, 1)[:, :I]
            out[name] = (t.to(torch.float32) * s_full).to(torch.bfloat16)
        else:
            out[name] = t
    os.makedirs(dst)
    new_map = {}
    for fn in sorted(set(wmap.values())):
        part = {n: out[n] for n, f in wmap.items() if f == fn and n in out}
        save_file(part, os.path.join(dst, fn), metadata={"format": "pt"})
        new_map.update({n: fn for n in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": new_map}, f)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))


def _copy(src: str, dst: str) -> None:
    os.makedirs(dst)
    for fn in sorted(os.listdir(src)):
        with open(os.path.join(src, fn), "rb") as a, open(os.path.join(dst, fn), "wb") as b:
            shutil.copyfileobj(a, b, 16 * 2**20)


def _child(approach: str, src: str, dst: str) -> None:
    import torch  # noqa: F401  (imported before the clock and the RSS base, as in every approach)

    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    rss0 = ru0.ru_maxrss * 1024
    t0 = time.perf_counter()
    if approach == "ours":
        convert(src, dst, "hf-bf16", progress=False)
    elif approach == "ours_unchecked":
        convert(src, dst, "hf-bf16", progress=False, allow_non_finite=True)
    elif approach == "baseline":
        _baseline(src, dst)
    else:
        _copy(src, dst)
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    print(
        json.dumps(
            {"wall_s": wall, "cpu_s": cpu, "peak_rss_bytes": ru1.ru_maxrss * 1024, "rss_after_imports_bytes": rss0}
        )
    )


def _run_child(approach: str, src: str, dst: str) -> dict:
    return run_child("benchmarks.convert", approach, [src, dst], cleanup=dst)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run(args) -> dict:
    from tqdm import tqdm

    sizes = sorted(float(s) for s in args.sizes_gb.split(","))
    shard = args.shard_mb * 2**20
    runs = []
    with tempfile.TemporaryDirectory(prefix="dsv3-bench-convert-", dir=args.dir) as tmp:
        steps = [
            (s, a)
            for s in sizes
            for a in ("copy", "ours", "ours_unchecked", "baseline")
            if not (args.skip_baseline_small and a == "baseline" and s != sizes[-1])
            and not (a == "ours_unchecked" and s != sizes[-1])
        ]
        bar = tqdm(total=len(steps), desc="bench convert", file=sys.stderr)
        for size in sizes:
            src = os.path.join(tmp, f"src-{size}")
            make_synthetic_checkpoint(src, size * 1e9, shard)
            nbytes = _dir_bytes(src)
            largest_out = 2 * max(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
            row = {"size_gb": size, "input_bytes": nbytes, "largest_output_shard_bytes": largest_out}
            for s, a in steps:
                if s != size:
                    continue
                r = _run_child(a, src, os.path.join(tmp, f"out-{a}"))
                r["gbps"] = nbytes / r["wall_s"] / 1e9
                row[a] = r
                bar.update(1)
            shutil.rmtree(src)
            runs.append(row)
        bar.close()
    big = runs[-1]
    bound = big["largest_output_shard_bytes"] + 2**30
    return {
        "bench": "convert",
        "input_bytes": big["input_bytes"],
        "ours_gbps": big["ours"]["gbps"],
        "baseline_gbps": big["baseline"]["gbps"],
        "copy_gbps": big["copy"]["gbps"],
        "ratio": big["ours"]["gbps"] / big["baseline"]["gbps"],
        "fraction_of_copy": big["ours"]["gbps"] / big["copy"]["gbps"],
        "ours_unchecked_gbps": big["ours_unchecked"]["gbps"],
        "finite_check_cost": 1.0 - big["ours"]["gbps"] / big["ours_unchecked"]["gbps"],
        # CPU seconds (user + sys) are less disturbed than wall time by other jobs' I/O on a shared machine
        "finite_check_cpu_cost": big["ours"]["cpu_s"] / big["ours_unchecked"]["cpu_s"] - 1.0,
        "ours_peak_rss_bytes": big["ours"]["peak_rss_bytes"],
        "baseline_peak_rss_bytes": big["baseline"]["peak_rss_bytes"],
        "rss_bound_bytes": bound,
        "ours_within_rss_bound": all(
            r["ours"]["peak_rss_bytes"] <= r["largest_output_shard_bytes"] + 2**30 for r in runs
        ),
        "peak_rss_by_size": [
            {
                "size_gb": r["size_gb"],
                "input_bytes": r["input_bytes"],
                "ours": r["ours"]["peak_rss_bytes"],
                "baseline": r.get("baseline", {}).get("peak_rss_bytes"),
            }
            for r in runs
        ],
        "runs": runs,
    }


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child(*sys.argv[2:])
    else:
        raise SystemExit(
            "usage: python -m benchmarks convert [--json] (this module's __main__ is the bench's child process)"
        )
