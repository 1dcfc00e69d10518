"""`dsv3 export` throughput: a run checkpoint to the released format (BF16 and FP8) vs a plain copy of its bytes.

A synthetic `dsv3 train` checkpoint (one DeepSpeed tag as pp = ep = 1 writes it: `mp_rank_00_model_states.pt` with the
module's FP32 weights, `param_shapes` and the run's "dsv3" config) of V3-shaped layers (hidden 7168, MLA, 2048-wide
experts; 16 heads, 4 routed experts, a small vocabulary) is written in a temporary directory at the requested size.
Each approach runs in its own child process (the time covers the work only, not interpreter start-up):

- copy: read + write of the tag's files (16 MiB chunks, `shutil.copyfileobj`): the I/O ceiling, same bytes in;
- ours_bf16: `export(..., to="hf-bf16")`; ours_fp8: `export(..., to="hf")` (FP8 block quantization).

Figures are GB/s of input bytes; `ratio` = ours_bf16 / copy (the issue's target: >= 0.8), `ratio_fp8` the same for
FP8. Peak RSS (ru_maxrss) of each child is reported: the mmapped input pages it touched count in it.
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
from dsv3_plugin.checkpoint.export import export
from dsv3_plugin.checkpoint.names import is_runtime_state
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.model.transformer import DSv3Model

__all__ = ["add_arguments", "run", "make_synthetic_run", "bench_block"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-gb", type=float, default=1.0, help="size of the run checkpoint (GB of FP32 weights)")
    p.add_argument("--shard-mb", type=positive_int, default=1024, help="largest output shard (MiB)")
    p.add_argument("--dir", default=None, help="where to create the temporary run (default: $TMPDIR)")


def bench_block(target_bytes: float) -> dict:
    """A "dsv3" block of V3-shaped MoE layers (~1 GB of FP32 weights each), as many as make `target_bytes`."""
    per_layer = 4 * 257e6  # attention with 16 heads ~37M + (4 routed + 1 shared) x 3 x 2048 x 7168 ~220M parameters
    return {
        "model": {
            "vocab_size": 4096,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_hidden_layers": max(1, round(target_bytes / per_layer)),
            "num_attention_heads": 16,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "first_k_dense_replace": 0,
            "max_position_embeddings": 4096,
        },
        "moe": {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "intermediate_size": 2048,
            "top_k": 2,
            "n_group": 1,
            "topk_group": 1,
        },
        "mtp": {"depth": 0},
    }


def make_synthetic_run(path: str, block: dict) -> int:
    """Write a run directory `path` holding one complete-looking tag (`ckpt/latest` -> step1) of the model `block`
    describes; values cut from one random pool (their content does not change the cost). Returns input bytes."""
    import torch

    cfg = DSv3Config.from_block(block)
    with torch.device("meta"):
        model = DSv3Model(cfg)
    pool = torch.randn(16 * 2**20, generator=torch.Generator().manual_seed(0)) * 0.02
    state, off = {}, 0
    for n, t in model.state_dict().items():
        if is_runtime_state(n):
            continue
        k = t.numel()
        o = off % (pool.numel() - min(k, pool.numel() - 1))
        data = pool[o : o + k] if k <= pool.numel() else pool.repeat(-(-k // pool.numel()))[:k]
        state[n] = data.clone().view(t.shape)
        off += 7919 * 1024
    d = os.path.join(path, "ckpt", "step1")
    os.makedirs(d)
    f = os.path.join(d, "mp_rank_00_model_states.pt")
    shapes = [{n: tuple(p.shape) for n, p in model.named_parameters()}]
    torch.save({"module": state, "param_shapes": shapes, "dsv3": {"config": cfg.to_dict()}}, f)
    with open(os.path.join(path, "ckpt", "latest"), "w") as fh:
        fh.write("step1")
    return os.path.getsize(f)


def _copy(src: str, dst: str) -> None:
    d = os.path.join(src, "ckpt", "step1")
    os.makedirs(dst)
    for fn in sorted(os.listdir(d)):
        with open(os.path.join(d, fn), "rb") as a, open(os.path.join(dst, fn), "wb") as b:
            shutil.copyfileobj(a, b, 16 * 2**20)


def _child(approach: str, src: str, dst: str, shard_bytes: int) -> None:
    import torch  # noqa: F401  (imported before the clock, as in every approach)

    t0 = time.perf_counter()
    if approach == "copy":
        _copy(src, dst)
    else:
        export(src, dst, "hf-bf16" if approach == "ours_bf16" else "hf", progress=False, shard_bytes=shard_bytes)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "peak_rss_bytes": ru.ru_maxrss * 1024}))


def _run_child(approach: str, src: str, dst: str, shard_bytes: int) -> dict:
    return run_child("benchmarks.export", approach, [src, dst, str(shard_bytes)], cleanup=dst)


def run(args) -> dict:
    from tqdm import tqdm

    shard = args.shard_mb * 2**20
    out = {"bench": "export"}
    with tempfile.TemporaryDirectory(prefix="dsv3-bench-export-", dir=args.dir) as tmp:
        src = os.path.join(tmp, "run")
        nbytes = make_synthetic_run(src, bench_block(args.size_gb * 1e9))
        out["input_bytes"] = nbytes
        # copy first and last: the page cache is as warm for the copy as for ours (both read the same file)
        approaches = ("copy", "ours_bf16", "ours_fp8", "copy")
        res: dict[str, list] = {}
        for a in tqdm(approaches, desc="bench export", file=sys.stderr):
            r = _run_child(a, src, os.path.join(tmp, f"out-{a}"), shard)
            r["gbps"] = nbytes / r["wall_s"] / 1e9
            res.setdefault(a, []).append(r)
    copy = max(res["copy"], key=lambda r: r["gbps"])  # the faster copy: the stricter baseline
    for a in ("ours_bf16", "ours_fp8"):
        out[f"{a}_gbps"] = res[a][0]["gbps"]
        out[f"{a}_peak_rss_bytes"] = res[a][0]["peak_rss_bytes"]
    out["copy_gbps"] = copy["gbps"]
    out["copy_runs_gbps"] = [r["gbps"] for r in res["copy"]]
    out["ratio"] = out["ours_bf16_gbps"] / copy["gbps"]
    out["ratio_fp8"] = out["ours_fp8_gbps"] / copy["gbps"]
    return out


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        raise SystemExit("usage: python -m benchmarks.export --child APPROACH SRC DST SHARD_BYTES")
