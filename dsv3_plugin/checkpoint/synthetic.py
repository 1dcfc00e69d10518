"""Released-format checkpoints made in code: DeepSeek's block-wise FP8 quantization and a streaming writer of
sharded checkpoints (tests, the example, and the multi-GB benchmark input).

Quantization follows the released weights' semantics (README_WEIGHTS, `inference/kernel.py`): per 128x128
block (ragged at edges), scale_inv = amax(|w|) / 448 (E4M3's largest finite value) and
w_fp8 = cast_e4m3(w / scale_inv), so that dequantization is w_fp8 * scale_inv.
Which tensors are quantized mirrors V3's release: every attention and MLP projection (dense, routed and
shared experts); not norms, the router, embeddings, the output head or `eh_proj`.
"""
from __future__ import annotations

import json
import os
import re
from typing import Callable, Iterable, Optional

import torch

from .megatron_layout import released_names
from .reader import INDEX_NAME, SCALE_SUFFIX, SINGLE_NAME
from .writer import StreamingSafetensorsWriter

__all__ = ["quantize_fp8_blockwise", "released_shapes", "is_quantized_in_release", "write_released_checkpoint",
           "quantize_checkpoint"]

E4M3_MAX = 448.0
_QUANTIZED = re.compile(r"\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|"
                        r"mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")


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


def is_quantized_in_release(name: str) -> bool:
    return bool(_QUANTIZED.search(name))


def released_shapes(cfg: dict) -> dict[str, tuple]:
    """{name: shape} of every tensor (required and optional) of a released checkpoint with HF config `cfg`."""
    H, V, nh = cfg["hidden_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kvl = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    I, mI, E = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg.get("n_routed_experts") or 0
    sI = mI * (cfg.get("n_shared_experts") or 0)
    sub = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (nh * (nope + rope), H), "self_attn.q_a_proj.weight": (ql, H),
        "self_attn.q_a_layernorm.weight": (ql,), "self_attn.q_b_proj.weight": (nh * (nope + rope), ql),
        "self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, H), "self_attn.kv_a_layernorm.weight": (kvl,),
        "self_attn.kv_b_proj.weight": (nh * (nope + vd), kvl), "self_attn.o_proj.weight": (H, nh * vd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mlp.gate.weight": (E, H), "mlp.gate.e_score_correction_bias": (E,),
        "mlp.shared_experts.gate_proj.weight": (sI, H), "mlp.shared_experts.up_proj.weight": (sI, H),
        "mlp.shared_experts.down_proj.weight": (H, sI),
        "enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H),
        "shared_head.norm.weight": (H,), "shared_head.head.weight": (V, H), "embed_tokens.weight": (V, H),
    }
    req, opt = released_names(cfg)
    out = {}
    for n in sorted(req | opt, key=_natural_key):
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            out[n] = (V, H)
        elif n == "model.norm.weight":
            out[n] = (H,)
        else:
            rest = n.split(".", 3)[3]
            m = re.match(r"mlp\.experts\.\d+\.(\w+)\.weight$", rest)
            if m:
                out[n] = (mI, H) if m.group(1) != "down_proj" else (H, mI)
            else:
                out[n] = sub[rest]
    return out


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def write_released_checkpoint(path: str, cfg: dict, make: Callable[[str, tuple], torch.Tensor],
                              fp8: bool = True, shard_bytes: int = 5 * 2**30,
                              names: Optional[Iterable[str]] = None, block: tuple[int, int] = (128, 128),
                              fp8_tensor: Optional[Callable[[str, tuple], tuple[torch.Tensor, torch.Tensor]]] = None) -> dict:
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
        if fp8 and is_quantized_in_release(n):
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
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    return index


def quantize_checkpoint(src_tensors: dict[str, torch.Tensor], path: str, cfg: dict, shard_bytes: int = 5 * 2**30,
                        block: tuple[int, int] = (128, 128)) -> dict:
    """Store given float tensors (released names) as an FP8 released-format checkpoint at `path`."""
    # Optional tensors (the MTP block's embedding/head copies) may be absent; the rest must be there.
    names = [n for n in released_shapes(cfg) if n in src_tensors]
    return write_released_checkpoint(path, cfg, lambda n, s: src_tensors[n], fp8=True, shard_bytes=shard_bytes,
                                     names=names, block=block)
