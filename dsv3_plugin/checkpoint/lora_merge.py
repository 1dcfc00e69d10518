"""Merging LoRA adapters into a released checkpoint, streamed one tensor at a time.

    W' = fl(W + fl(s · fl(B A)))     in FP32, W the base tensor (FP8 dequantized: w_fp8 · scale_inv per block)

Targets: "hf" keeps the release's storage (FP8 rows re-quantized to its 128x128 E4M3 blocks with DeepSeek's
scale_inv = amax / 448, `synthetic.quantize_fp8_blockwise`; a block the adapter leaves unchanged keeps its bytes and
scale), "hf-bf16" casts once to BF16, "hf-fp32" keeps FP32; the router bias stays FP32. The FP8 error bound is
derived in `requantize_fp8` (docs/checkpoints.md#lora-adapters). Peak memory: one tensor and its temporaries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping

import torch

from dsv3_plugin.checkpoint.convert import atomic_output_dir
from dsv3_plugin.checkpoint.integrity import is_finite
from dsv3_plugin.checkpoint.lora_names import adapter_sites, lora_scale
from dsv3_plugin.checkpoint.names import is_quantized_in_release
from dsv3_plugin.checkpoint.reader import INDEX_NAME, SCALE_SUFFIX, CheckpointReader
from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter
from dsv3_plugin.config import DSv3Config, LoRAConfig
from dsv3_plugin.data.tokenizer import TOKENIZER_FILES
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.safe_files import copy_regular

__all__ = [
    "MERGE_TARGETS",
    "lora_delta",
    "requantize_fp8",
    "iter_merged_tensors",
    "write_merged_release",
    "write_merged_files",
    "merged_bytes",
]

MERGE_TARGETS = ("hf", "hf-bf16", "hf-fp32")
_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}  # + weight_block_size


def lora_delta(A: torch.Tensor, B: torch.Tensor, s: float) -> torch.Tensor:
    """fl(s · fl(B A)) in FP32 (peft's `get_delta_weight` order). A [r, d_in], B [d_out, r] -> [d_out, d_in]."""
    return (B.float() @ A.float()) * s


def requantize_fp8(
    w: torch.Tensor, delta: torch.Tensor, q_old: torch.Tensor, s_old: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-quantize merged W' = W + delta [O, I] (FP32) to E4M3 blocks; blocks where delta is all zero keep
    (q_old, s_old) bit for bit (a fresh amax / 448 of an unchanged block need not reproduce the release's scale).

    Error of a re-quantized block, with s = fl(amax / 448), y = fl(w / s) (|y| <= 448 up to one FP32 rounding,
    so no saturation), q = round-to-nearest-even of y in E4M3 (3 mantissa bits, normals from 2^-6, subnormal
    spacing 2^-9):  |q - y| <= 2^-4 · |y| for |y| >= 2^-6 (half a spacing 2^(e-3) in binade [2^e, 2^(e+1)))
    and <= 2^-10 below (half the subnormal spacing). With the FP32 roundings of w / s and of q · s:

        |w - fl(q · s)| <= 2^-4 · |w| + 2^-10 · s + 2^-22 · |w|     elementwise,

    so <= amax · 2^-4 · (1 + 2^-18) + 2^-10 · s in the block; the top binade [256, 448] gives max 16 s = amax / 28.

    Returns:
        (q float8_e4m3fn [O, I], scale_inv fp32 [ceil(O/b0), ceil(I/b1)]).
    """
    q, s = quantize_fp8_blockwise(w, block)
    O, I = w.shape
    nr, nc = s.shape
    pad = torch.zeros(nr * block[0], nc * block[1], dtype=torch.bool)
    pad[:O, :I] = delta != 0
    changed = pad.view(nr, block[0], nc, block[1]).any(dim=3).any(dim=1)  # [nr, nc]
    el = changed.repeat_interleave(block[0], 0)[:O].repeat_interleave(block[1], 1)[:, :I]
    q8 = torch.where(el, q.view(torch.uint8), q_old.contiguous().view(torch.uint8)).view(torch.float8_e4m3fn)
    return q8, torch.where(changed, s, s_old.float())


def _delta_map(adapters, cfg: DSv3Config, lora: LoRAConfig) -> dict[str, tuple[str, str, int | None]]:
    """{released weight name: (native A, native B, expert row or None)} of every adapted released tensor."""
    L, E = cfg.model.num_hidden_layers, cfg.moe.n_routed_experts
    out = {}
    for site in adapter_sites(adapters, cfg, lora):
        for e in range(E) if site.kind == "experts" else (None,):
            out[site.released(L, e)] = (site.a, site.b, e)
    return out


def _kind(reader: CheckpointReader, n: str, adapted: bool, replaced: bool, to: str) -> tuple[str, torch.dtype]:
    """How output tensor `n` is made: "raw" (the base's FP8 bytes and scale), "requant" (FP8 base, adapted),
    "quant" (FP8 from a float tensor), "float" (cast to the returned dtype)."""
    stored = reader.info(n).torch_dtype
    if to == "hf" and (reader.is_fp8(n) or is_quantized_in_release(n, _L(reader))):
        if reader.is_fp8(n) and not replaced:
            return ("requant" if adapted else "raw"), torch.float8_e4m3fn
        return "quant", torch.float8_e4m3fn
    if n.endswith("e_score_correction_bias") or to == "hf-fp32":
        return "float", torch.float32
    return "float", (torch.bfloat16 if to == "hf-bf16" else stored)


def _L(reader: CheckpointReader) -> int:
    return int(reader.config.get("num_hidden_layers", 1 << 30))


def _check(reader: CheckpointReader, deltas: dict, replace: Mapping, to: str) -> None:
    if to not in MERGE_TARGETS:
        raise CheckpointError(f"merge target {to!r}: expected one of {', '.join(MERGE_TARGETS)}")
    for n, t in replace.items():
        if n not in reader or tuple(t.shape) != tuple(reader.shape(n)):
            raise CheckpointError(f"{n}: replaces no tensor of shape {list(t.shape)} in {reader.path}")
    for n in deltas:
        if n not in reader:
            raise CheckpointError(f"{n}: adapted but missing from the base checkpoint {reader.path}")


def iter_merged_tensors(
    reader: CheckpointReader,
    adapters: Mapping[str, torch.Tensor],
    cfg: DSv3Config,
    lora: LoRAConfig,
    to: str = "hf",
    replace: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(released name, tensor) of the merged checkpoint, file by file in the base's order; an FP8 weight is
    followed by its `_scale_inv` ("hf").

    Args:
        reader: the base checkpoint (FP8 + weight_scale_inv, or BF16); cfg: its config.
        adapters: native adapter tensors (`lora_names`); lora: their config (scale s, targets).
        to: one of MERGE_TARGETS ("hf": FP8 where the release quantizes; "hf-bf16"; "hf-fp32").
        replace: {released name: tensor} taking the base's place before merging (e.g. a trained router bias).

    Raises:
        CheckpointError: bad adapters, a `replace` name or shape the base lacks, a merged tensor not finite.
    """
    deltas, s, replace = _delta_map(adapters, cfg, lora), lora_scale(lora), dict(replace or {})
    _check(reader, deltas, replace, to)
    for _, names in reader.names_by_file().items():
        for n in names:
            kind, dt = _kind(reader, n, n in deltas, n in replace, to)
            if kind == "raw":
                reader.get(n, torch.float32)  # the integrity checks (codes, scales) of what is copied
                yield n, reader.raw(n)
                yield n + SCALE_SUFFIX, reader.raw(n + SCALE_SUFFIX).float()
                continue
            w = replace[n].float() if n in replace else reader.get(n, torch.float32)
            d = None
            if n in deltas:
                a, b, e = deltas[n]
                A, B = (adapters[a], adapters[b]) if e is None else (adapters[a][e], adapters[b][e])
                d = lora_delta(A, B, s)
                if tuple(d.shape) != tuple(w.shape):
                    raise CheckpointError(f"{n}: shape {list(w.shape)} in {reader.path}, its adapter's {list(d.shape)}")
                w = w + d
            if not is_finite(w):
                why = "merged with its LoRA adapter" if d is not None else "as given" if n in replace else "in the base"
                raise CheckpointError(f"{n}: non-finite values ({why}); nothing merged is written")
            if kind == "requant":
                q, sc = requantize_fp8(w, d, reader.raw(n), reader.raw(n + SCALE_SUFFIX), reader.block)
            elif kind == "quant":
                q, sc = quantize_fp8_blockwise(w, reader.block)
            else:
                yield n, w.to(dt)
                continue
            yield n, q
            yield n + SCALE_SUFFIX, sc


def _plan(reader: CheckpointReader, deltas: dict, replace: Mapping, to: str) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every output tensor in `iter_merged_tensors` order, from the headers alone."""
    specs = []
    for _, names in reader.names_by_file().items():
        for n in names:
            kind, dt = _kind(reader, n, n in deltas, n in replace, to)
            shape = tuple(reader.shape(n))
            specs.append((n, dt, shape))
            if kind != "float":
                specs.append((n + SCALE_SUFFIX, torch.float32, tuple(-(-d // b) for d, b in zip(shape, reader.block))))
    return specs


def write_merged_release(
    base: str | os.PathLike,
    dst: str | os.PathLike,
    adapters: Mapping[str, torch.Tensor],
    cfg: DSv3Config,
    lora: LoRAConfig,
    to: str = "hf",
    replace: Mapping[str, torch.Tensor] | None = None,
    shard_bytes: int = 5 * 2**30,
) -> dict:
    """Write base + adapters, merged, as a released-format directory (atomically: a hidden sibling renamed at the
    end): shards of at most `shard_bytes` with an index, the base's config.json (`quantization_config` for "hf"
    only, `torch_dtype`), and the base's tokenizer files.

    Args:
        base: the base checkpoint directory; dst: the directory to create (must not exist).
        adapters, cfg, lora, to, replace: as for `iter_merged_tensors`.
        shard_bytes: the largest shard (a weight and its scale stay together).

    Returns:
        {"tensors": N, "files": shards, "output_bytes": bytes of tensor data}.
    """
    replace = dict(replace or {})
    with CheckpointReader(base) as reader:
        deltas = _delta_map(adapters, cfg, lora)
        _check(reader, deltas, replace, to)
        total = sum(torch.Size(sp[2]).numel() * sp[1].itemsize for sp in _plan(reader, deltas, replace, to))
        with atomic_output_dir(os.fspath(dst), total + (1 << 20)) as tmp:
            summary = write_merged_files(reader, tmp, adapters, cfg, lora, to, replace, shard_bytes)
            for fn in TOKENIZER_FILES:
                if os.path.lexists(os.path.join(reader.path, fn)):
                    copy_regular(os.path.join(reader.path, fn), os.path.join(tmp, fn), CheckpointError, reader.path)
    return summary


def merged_bytes(reader: CheckpointReader, adapters, cfg: DSv3Config, lora: LoRAConfig, to: str = "hf") -> int:
    """Bytes of tensor data `write_merged_files` writes (from the headers alone)."""
    deltas = _delta_map(adapters, cfg, lora)
    return sum(torch.Size(sp[2]).numel() * sp[1].itemsize for sp in _plan(reader, deltas, {}, to))


def write_merged_files(
    reader: CheckpointReader,
    out: str,
    adapters: Mapping[str, torch.Tensor],
    cfg: DSv3Config,
    lora: LoRAConfig,
    to: str = "hf",
    replace: Mapping[str, torch.Tensor] | None = None,
    shard_bytes: int = 5 * 2**30,
) -> dict:
    """The merged shards, index and config.json written into the existing directory `out` (the non-atomic part of
    `write_merged_release`, without the tokenizer; `reader` the open base; other Args as there).

    Returns:
        {"tensors": N, "files": shards, "output_bytes": bytes of tensor data}.
    """
    replace = dict(replace or {})
    deltas = _delta_map(adapters, cfg, lora)
    _check(reader, deltas, replace, to)
    specs = _plan(reader, deltas, replace, to)
    shards: list[list] = [[]]
    size = 0
    for sp in specs:
        nb = torch.Size(sp[2]).numel() * sp[1].itemsize
        if shards[-1] and size + nb > shard_bytes and not sp[0].endswith(SCALE_SUFFIX):
            shards.append([])
            size = 0
        shards[-1].append(sp)
        size += nb
    total = sum(torch.Size(sp[2]).numel() * sp[1].itemsize for sp in specs)
    it = iter_merged_tensors(reader, adapters, cfg, lora, to, replace)
    conf = {k: v for k, v in reader.config.items() if k != "quantization_config"}
    conf["torch_dtype"] = "float32" if to == "hf-fp32" else "bfloat16"
    if to == "hf":
        conf["quantization_config"] = {**_QUANT, "weight_block_size": list(reader.block)}
    weight_map = {}
    for k, items in enumerate(shards):
        fn = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        with StreamingSafetensorsWriter(os.path.join(out, fn), items) as w:
            for name, _, _ in items:
                got, t = next(it)
                if got != name:  # the plan and the stream are made by the same rules
                    raise CheckpointError(f"{got}: produced out of plan (expected {name})")
                w.write(name, t)
                weight_map[name] = fn
    with open(os.path.join(out, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return {"tensors": len(weight_map), "files": len(shards), "output_bytes": total}
