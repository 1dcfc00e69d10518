"""Released-format checkpoints made in code: DeepSeek's block-wise FP8 quantization and a streaming writer of
sharded checkpoints (tests, the example, and the multi-GB benchmark input).

Quantization follows the released weights' semantics (README_WEIGHTS, `inference/kernel.py`): per 128x128
block (ragged at edges), scale_inv = amax(|w|) / 448 (E4M3's largest finite value) and
w_fp8 = cast_e4m3(w / scale_inv), so that dequantization is w_fp8 * scale_inv.
Which tensors are quantized mirrors V3's release (`Row.fp8` of the name table, `names.py`): every attention and
MLP projection (dense, routed and shared experts); not norms, the router, embeddings, the output head or
`eh_proj`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable

import torch

from dsv3_plugin.checkpoint.names import is_quantized_in_release, released_shapes
from dsv3_plugin.checkpoint.reader import INDEX_NAME, SCALE_SUFFIX, SINGLE_NAME
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter

__all__ = ["quantize_fp8_blockwise", "write_released_checkpoint", "quantize_checkpoint"]

E4M3_MAX = 448.0


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """[O, I] float -> (float8_e4m3fn [O, I], scale_inv fp32 [ceil(O/b0), ceil(I/b1)]), ragged edges zero-padded."""
    O, I = w.shape
    nr, nc = -(-O // block[0]), -(-I // block[1])
    pad = torch.zeros(nr * block[0], nc * block[1], dtype=torch.float32)
    pad[:O, :I] = w.float()
    blocks = pad.view(nr, block[0], nc, block[1])
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nr, nc]
    scale_inv = amax / E4M3_MAX
    q = (blocks / scale_inv[:, None, :, None]).view(nr * block[0], nc * block[1])[:O, :I]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv.contiguous()


def write_released_checkpoint(
    path: str,
    cfg: dict,
    make: Callable[[str, tuple], torch.Tensor],
    fp8: bool = True,
    shard_bytes: int = 5 * 2**30,
    names: Iterable[str] | None = None,
    block: tuple[int, int] = (128, 128),
    fp8_tensor: Callable[[str, tuple], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict:
    """Write a released-format checkpoint to directory `path` (created): config.json plus shards of at most
    `shard_bytes` (one `model.safetensors` if everything fits) with an index.

    `make(name, shape)` returns each tensor's float value; with `fp8`, release-quantized tensors are stored
    as FP8 + `_scale_inv` (via `fp8_tensor(name, shape)` when given, which returns (w_fp8, scale_inv)
    directly). The router bias is fp32; other unquantized tensors bf16. Returns the index dict."""
    os.makedirs(path, exist_ok=True)
    shapes = released_shapes(cfg)
    order = list(names) if names is not None else list(shapes)
    plan: list[tuple[str, torch.dtype, tuple, bool]] = []
    for n in order:
        shape = shapes[n]
        if fp8 and is_quantized_in_release(n, cfg["num_hidden_layers"]):
            plan.append((n, torch.float8_e4m3fn, shape, True))
            plan.append((n + SCALE_SUFFIX, torch.float32, (-(-shape[0] // block[0]), -(-shape[1] // block[1])), False))
        else:
            dt = torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16
            plan.append((n, dt, shape, False))
    shards, cur, cur_bytes = [], [], 0
    for item in plan:
        nb = torch.Size(item[2]).numel() * item[1].itemsize
        if cur and cur_bytes + nb > shard_bytes and not item[0].endswith(SCALE_SUFFIX):
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(item)
        cur_bytes += nb
    shards.append(cur)
    weight_map, total = {}, 0
    for k, items in enumerate(shards):
        fn = SINGLE_NAME if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with StreamingSafetensorsWriter(os.path.join(path, fn), [(n, dt, s) for n, dt, s, _ in items]) as w:
            pending: dict[str, torch.Tensor] = {}
            for n, dt, shape, is_q in items:
                if n in pending:
                    t = pending.pop(n)
                elif is_q:
                    q, s = fp8_tensor(n, shape) if fp8_tensor else quantize_fp8_blockwise(make(n, shape), block)
                    pending[n + SCALE_SUFFIX] = s
                    t = q
                else:
                    t = make(n, shape).to(dt)
                w.write(n, t)
                weight_map[n] = fn
            total += w.total_bytes
    hf = dict(cfg)
    if fp8:
        hf["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(block),
        }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    return index


def quantize_checkpoint(
    src_tensors: dict[str, torch.Tensor],
    path: str,
    cfg: dict,
    shard_bytes: int = 5 * 2**30,
    block: tuple[int, int] = (128, 128),
) -> dict:
    """Store given float tensors (released names) as an FP8 released-format checkpoint at `path`."""
    # Optional tensors (the MTP block's embedding/head copies) may be absent; the rest must be there.
    names = [n for n in released_shapes(cfg) if n in src_tensors]
    return write_released_checkpoint(
        path, cfg, lambda n, s: src_tensors[n], fp8=True, shard_bytes=shard_bytes, names=names, block=block
    )
