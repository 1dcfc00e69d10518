"""`dsv3 export`: a source (`sources.open_source`: a `dsv3 train` run, a Megatron-LM or a Megatron-layout
checkpoint) written out in DeepSeek-V3's released format (README_WEIGHTS of the release).

Written: safetensors shards + `model.safetensors.index.json`, the HF `config.json` of the model
(`num_nextn_predict_layers`, `torch_dtype`), the MTP module at layer index `num_hidden_layers` with its own copies
of `embed_tokens` / `shared_head.head`, the router bias `e_score_correction_bias` in FP32, the tokenizer files.
`--to hf-bf16`: every other tensor BF16. `--to hf`: FP8 E4M3 + 128x128 `weight_scale_inv` exactly where the
release quantizes (`names.is_quantized_in_release`; `synthetic.quantize_fp8_blockwise`: scale_inv = amax / 448)
and the release's `quantization_config`. A LoRA run: its base merged, W + s·B·A (`lora_merge`), or `--to peft`
its adapters (`peft_adapter`). Streaming and atomic (`convert.atomic_output_dir`); each target is one entry of
`WRITERS`. Details: docs/design_notes.md#checkpoint-export, docs/checkpoints.md#lora-adapters.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsv3_plugin.checkpoint.convert import atomic_output_dir
from dsv3_plugin.checkpoint.integrity import check_finite
from dsv3_plugin.checkpoint.lora_merge import merged_bytes, write_merged_files
from dsv3_plugin.checkpoint.names import is_quantized_in_release, native_to_released, released_names, released_shapes
from dsv3_plugin.checkpoint.peft_adapter import peft_adapter_bytes, write_peft_files
from dsv3_plugin.checkpoint.reader import INDEX_NAME, SCALE_SUFFIX, CheckpointReader
from dsv3_plugin.checkpoint.run_checkpoint import RunCheckpoint, find_run_checkpoint
from dsv3_plugin.checkpoint.sources import NOT_A_SOURCE, Source, Tensors, open_source
from dsv3_plugin.checkpoint.synthetic import quantize_fp8_blockwise
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter
from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.tokenizer import TOKENIZER_FILES, check_vocab_fits, has_tokenizer, load_tokenizer
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.safe_files import copy_regular

__all__ = [
    "export",
    "ReleasedFormat",
    "PeftFormat",
    "WRITERS",
    "EXPORT_TARGETS",
    "QUANTIZATION_CONFIG",
    # re-exported from run_checkpoint / sources, where they live
    "find_run_checkpoint",
    "RunCheckpoint",
    "NOT_A_SOURCE",
]

# DeepSeek-V3's release, verbatim (config.json of deepseek-ai/DeepSeek-V3)
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
_SHARD_BYTES = 5 * 2**30


# --- the released-format writer --------------------------------------------------------------------------------
class _Shards:
    """Fills one output shard in memory (at most `shard_bytes`, a weight and its scale never split), writes it with
    the streaming safetensors writer, and names the shards `model-0000k-of-0000N` with an index at the end."""

    def __init__(self, out: str, shard_bytes: int):
        self.out, self.limit = out, shard_bytes
        self.items: list[tuple[str, torch.Tensor]] = []
        self.nbytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.items and self.nbytes + n > self.limit and not name.endswith(SCALE_SUFFIX):
            self.flush()
        self.items.append((name, t))
        self.nbytes += n

    def flush(self) -> None:
        if not self.items:
            return
        fn = f".part-{len(self.files):05d}.safetensors"
        specs = [(n, t.dtype, tuple(t.shape)) for n, t in self.items]
        with StreamingSafetensorsWriter(os.path.join(self.out, fn), specs, {"format": "pt"}) as w:
            for n, t in self.items:
                w.write(n, t)
        self.total += w.total_bytes
        self.files.append((fn, [n for n, _ in self.items]))
        self.items, self.nbytes = [], 0

    def finish(self) -> dict:
        self.flush()
        weight_map = {}
        for k, (fn, names) in enumerate(self.files):
            final = f"model-{k + 1:05d}-of-{len(self.files):05d}.safetensors"
            os.rename(os.path.join(self.out, fn), os.path.join(self.out, final))
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        _write_json(os.path.join(self.out, INDEX_NAME), index)
        return {"tensors": len(weight_map), "files": len(self.files), "output_bytes": self.total}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _write_released(tensors: Tensors, hf: dict, out: str, fp8: bool, shard_bytes: int, dup_ok: bool) -> dict:
    """Write `tensors` (released names, any float dtype) as the released format into `out`: shapes checked against
    `hf`, NaN/Inf refused, FP8 where the release quantizes (`fp8`), the MTP module's copies of the embedding / head
    written from the main tensors (own bytes, no shared storage), every required tensor present."""
    L = hf["num_hidden_layers"]
    shapes = released_shapes(hf)
    required, optional = released_names(hf)
    depth = hf.get("num_nextn_predict_layers") or 0
    head = "model.embed_tokens.weight" if hf.get("tie_word_embeddings") else "lm_head.weight"
    copies: dict[str, list[str]] = {"model.embed_tokens.weight": [], head: []}
    for k in range(depth):
        copies["model.embed_tokens.weight"].append(f"model.layers.{L + k}.embed_tokens.weight")
        copies[head].append(f"model.layers.{L + k}.shared_head.head.weight")
    copy_names = {c for cs in copies.values() for c in cs}
    shards, done = _Shards(out, shard_bytes), set()
    for name, t, where in tensors:
        if name in copy_names:
            continue  # a source's own MTP copy (Megatron layouts keep one): written from the main tensor instead
        if name not in shapes:
            raise CheckpointError(f"{name} in {where}: not a tensor of the model's released format")
        if name in done:
            if dup_ok:
                continue  # a pipeline rank's copy (1F1B's embedding on the last stage, DualPipe's mirrors)
            raise CheckpointError(f"{name} in {where}: stored twice")
        if tuple(t.shape) != tuple(shapes[name]):
            raise CheckpointError(f"{name} in {where}: shape {tuple(t.shape)}, the config's is {tuple(shapes[name])}")
        if fp8 and is_quantized_in_release(name, L):
            check_finite(t, f"{name} in {where}")
            q, s = quantize_fp8_blockwise(t, tuple(QUANTIZATION_CONFIG["weight_block_size"]))
            shards.add(name, q)
            shards.add(name + SCALE_SUFFIX, s)
        else:
            keep32 = name.endswith("e_score_correction_bias")  # the router bias stays FP32, as in the release
            o = t.to(torch.float32 if keep32 else torch.bfloat16).contiguous()
            check_finite(o, f"{name} in {where} (as {o.dtype})")
            shards.add(name, o)
            for c in copies.get(name, ()):
                shards.add(c, o)
                done.add(c)
        done.add(name)
    missing = sorted(required - done)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{missing[0]}: missing from the source{more}")
    del optional
    return shards.finish()


def _out_config(hf: dict, fp8: bool) -> dict:
    out = {k: v for k, v in hf.items() if k != "quantization_config"}
    out["torch_dtype"] = "bfloat16"
    if fp8:
        out["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return out


@dataclass(frozen=True)
class ReleasedFormat:
    """DeepSeek-V3's released format: BF16 weights (`fp8` False, `--to hf-bf16`), or FP8 E4M3 + 128x128
    `weight_scale_inv` where the release quantizes and the release's `quantization_config` (`fp8`, `--to hf`)."""

    fp8: bool

    @property
    def merge_target(self) -> str:
        return "hf" if self.fp8 else "hf-bf16"

    def check(self, source: Source) -> None:
        """Nothing to refuse before writing: every source kind has released tensors (or adapters + a base)."""

    def expected_bytes(self, source: Source) -> int:
        """About what `write` writes: every released tensor in its output dtype (FP8 + fp32 block scales where the
        release quantizes, when `fp8`), a header entry and an index line per tensor, and the config."""
        hf = source.hf
        if source.lora is not None:
            with CheckpointReader(source.base) as reader:
                lo = source.lora
                return merged_bytes(reader, lo.adapters, source.cfg, lo.lora, self.merge_target) + 512 * len(
                    reader.stored
                )
        L, b = hf["num_hidden_layers"], QUANTIZATION_CONFIG["weight_block_size"]
        n = 0
        shapes = released_shapes(hf)
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if self.fp8 and is_quantized_in_release(name, L):
                n += numel + 4 * (-(-shape[0] // b[0])) * (-(-shape[1] // b[1]))
            else:
                n += numel * (4 if name.endswith("e_score_correction_bias") else 2)
        return n + 512 * len(shapes) + 65536

    def write(self, source: Source, out: str, shard_bytes: int, on_read: Callable[[int], None]) -> dict:
        """Write `source`'s tensors (shards + index, at most `shard_bytes` of tensor data each) and config.json into
        the directory `out`; a LoRA run's base merged with its adapters, W + s·B·A (`lora_merge`: with `fp8` the
        base's FP8 blocks the adapters leave unchanged keep their bytes). Returns {"tensors", "files",
        "output_bytes"}."""
        if source.lora is not None:
            lo = source.lora
            with CheckpointReader(source.base) as reader:
                L = source.cfg.model.num_hidden_layers
                bias = {native_to_released(n, L): t for n, t in lo.router_bias.items()}  # trained: replaces the base's
                out_sum = write_merged_files(
                    reader, out, lo.adapters, source.cfg, lo.lora, self.merge_target, bias, shard_bytes
                )
            on_read(source.input_bytes)
            return out_sum
        hf = source.hf
        summary = _write_released(source.tensors(on_read), hf, out, self.fp8, shard_bytes, source.duplicates)
        _write_json(os.path.join(out, "config.json"), _out_config(hf, self.fp8))
        return summary


class PeftFormat:
    """A PEFT LoRA adapter directory (`peft_adapter`: `adapter_config.json` + `adapter_model.safetensors`) of a
    LoRA run's adapters, for `peft.PeftModel.from_pretrained` on transformers' model of the run's base."""

    def check(self, source: Source) -> None:
        if source.lora is None:
            raise CheckpointError(f"--to peft: {source.path} has no LoRA adapters: {source.no_adapters_reason()}")
        if source.lora.lora.bias_update:
            raise CheckpointError(
                f"--to peft: {source.path} trained the routing bias (lora.bias_update true), which a PEFT adapter "
                "cannot carry; export it merged (--to hf-bf16 or hf)"
            )

    def expected_bytes(self, source: Source) -> int:
        return peft_adapter_bytes(source.lora.adapters) + 65536

    def write(self, source: Source, out: str, shard_bytes: int, on_read: Callable[[int], None]) -> dict:
        """`adapter_config.json` (base_model_name_or_path: the run's base directory) and the adapters into `out`."""
        lo = source.lora
        summary = write_peft_files(out, lo.adapters, source.cfg, lo.lora, source.base)
        on_read(source.input_bytes)
        return summary


# --to TARGET -> its writer (anything with `check(source)`, `expected_bytes(source)` and
# `write(source, out, shard_bytes, on_read)`)
WRITERS = {"hf-bf16": ReleasedFormat(fp8=False), "hf": ReleasedFormat(fp8=True), "peft": PeftFormat()}
EXPORT_TARGETS = tuple(WRITERS)


# --- tokenizer -------------------------------------------------------------------------------------------------
def _tokenizer_source(tokenizer: str | None, default: str | None, vocab_size: int) -> str | None:
    """The tokenizer directory to export: `tokenizer` (must hold one) or `default` when it holds one; checked to
    load and to fit the model's vocabulary (DataError otherwise). None: nothing to export."""
    path = tokenizer if tokenizer is not None else (default if default and has_tokenizer(default) else None)
    if path is None:
        return None
    check_vocab_fits(load_tokenizer(path), vocab_size, path)
    return path


_TOKENIZER_COPIED = (*TOKENIZER_FILES, "chat_template.jinja")


def _copy_tokenizer(src: str, out: str) -> list[str]:
    """Copy the tokenizer files `src` holds into `out`: the bytes of each regular file inside `src` (`safe_files`;
    a link out of `src` or a FIFO is a DataError, never followed into the export)."""
    copied = []
    for fn in _TOKENIZER_COPIED:
        p = os.path.join(src, fn)
        if os.path.lexists(p):
            copy_regular(p, os.path.join(out, fn), DataError, src)
            copied.append(fn)
    return copied


def _tokenizer_bytes(tok_dir: str | None) -> int:
    if not tok_dir:
        return 0
    return sum(
        os.path.getsize(os.path.join(tok_dir, f)) for f in _TOKENIZER_COPIED if os.path.isfile(os.path.join(tok_dir, f))
    )


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="export",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
    )


# --- entry point -----------------------------------------------------------------------------------------------
def export(
    src: str | os.PathLike | Source,
    dst: str | os.PathLike,
    to: str,
    tag: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    progress: bool = True,
    shard_bytes: int = _SHARD_BYTES,
    config: str | os.PathLike | None = None,
    base: str | os.PathLike | None = None,
) -> dict:
    """Export a source (a `dsv3 train` run: any pp x ep x dp layout, FP32 / BF16 / FP8 training; a Megatron-LM
    training checkpoint of the plugin's `pretrain_gpt` (torch_dist); a Megatron-layout directory) to DeepSeek-V3's
    released format in new directory `dst` (atomic).

    Args:
        src: an opened source (`sources.open_source`), or a path, opened here with `tag` and `config`: a run
            directory (`--out` of dsv3 train), its `ckpt/` or one tag's directory; a Megatron-LM `--save`
            directory (or one `iter_NNNNNNN`); or a Megatron-layout directory.
        dst: the output directory (must not exist).
        to: "hf-bf16" (BF16 weights), "hf" (FP8 E4M3 + 128x128 weight_scale_inv where the release has them) or
            "peft" (a LoRA run's adapters as a PEFT adapter directory). A LoRA run's hf-bf16 / hf is its base
            merged with the adapters.
        tag: the run's checkpoint tag (default: `latest` when complete, else the newest complete one); for a
            Megatron-LM checkpoint the iteration (default: the tracker file's). Only with a path.
        tokenizer: a tokenizer directory to ship (default: RUN/tokenizer/, or the Megatron dir's own files).
        progress: tqdm bar on stderr (bytes of the source read).
        shard_bytes: largest output shard (bytes of tensor data).
        config: for a Megatron-LM checkpoint only (required there): the `--dsv3-config` JSON of its run, or a
            released config.json. Only with a path.
        base: for a LoRA run only: its released base (default: the directory the run recorded); its fingerprint
            must be the run's. Only with a path.

    Returns:
        {"to", "src", "dst", "source" ("run" | "megatron-lm" | "megatron-layout"), "tag", "tensors", "files",
        "output_bytes", "input_bytes", "tokenizer" (the directory copied, or None), "tokenizer_files",
        "base" (a LoRA run's base directory, else None), "notes" (lines for the user)}.

    Raises:
        CheckpointError: `src` is neither kind, incomplete, or holds a tensor that is missing, unexpected,
            mis-shaped or non-finite (the message names it and its file); `dst` exists; `--to peft` from a source
            without adapters; a LoRA run's base missing or not the one it was trained on.
        DataError: the tokenizer cannot be loaded or does not fit the model's vocabulary.
    """
    writer = WRITERS.get(to)
    if writer is None:
        full = [t for t, w in WRITERS.items() if isinstance(w, ReleasedFormat)]
        raise ConfigError(f"--to {to!r}: choose {' or '.join(full)}, or peft for a LoRA run's adapters")
    if isinstance(src, Source):
        if tag is not None or config is not None or base is not None:
            raise ConfigError(
                "--tag / --config / --base: given to open_source with the path, not to export with a source"
            )
        source = src
    else:
        source = open_source(src, tag=tag, config=config, base=base)
    writer.check(source)
    dst = os.path.abspath(os.fspath(dst))
    notes = list(source.notes)
    tok_dir = _tokenizer_source(
        None if tokenizer is None else os.fspath(tokenizer), source.default_tokenizer, source.cfg.model.vocab_size
    )
    if tok_dir is None:
        notes.append(
            f"no tokenizer exported: the source has none ({source.no_tokenizer_reason()}); add one with --tokenizer DIR"
        )
    with atomic_output_dir(dst, writer.expected_bytes(source) + _tokenizer_bytes(tok_dir)) as tmp:
        with _progress(source.input_bytes, progress) as bar:
            summary = writer.write(source, tmp, shard_bytes, bar.update)
        notes += summary.pop("notes", [])
        copied = _copy_tokenizer(tok_dir, tmp) if tok_dir else []
    return {
        "to": to,
        "src": source.path,
        "dst": dst,
        "source": source.kind,
        "tag": source.tag,
        **summary,
        "input_bytes": source.input_bytes,
        "tokenizer": tok_dir,
        "tokenizer_files": copied,
        "base": source.base,
        "notes": notes,
    }
