"""Released DeepSeek-V3 checkpoints (HF layout) <-> `DSv3Model`.

Released names (docs/facts.md §1): `model.embed_tokens`, `model.layers.{i}.…`, `model.norm`,
`lm_head`; routed experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked here into
`[E, …]` tensors); the router bias `mlp.gate.e_score_correction_bias`; and the MTP module k at
`model.layers.{num_hidden_layers + k}` (enorm, hnorm, eh_proj, the decoder block, `shared_head.norm`, and
`shared_head.head` / `embed_tokens`, which are the main model's head and embedding — we share them and
check that the file's copies agree). transformers drops that layer; we load it.
"""
from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from typing import Iterator

import torch

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.errors import CheckpointError
from .integrity import check_finite
from .reader import CheckpointReader
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.training.transforms import build_model

__all__ = ["hf_to_native", "native_to_hf", "native_state_to_hf", "list_checkpoint_files",
           "iter_checkpoint_tensors", "load_pretrained", "load_hf_state_into", "pretrained_config", "model_config"]

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_MTP_SHARED = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "embed_tokens.weight"}


def hf_to_native(name: str, num_hidden_layers: int) -> tuple[str, int | None] | tuple[None, str]:
    """Map a released tensor name to (native name, expert index or None).

    Returns (None, shared_native_name) for the MTP copies of the shared embedding/head."""
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.match(name)
    if not m:
        raise KeyError(name)
    idx, rest = int(m.group(1)), m.group(2)
    if idx < num_hidden_layers:
        native = f"layers.{idx}.{rest}"
    else:
        k = idx - num_hidden_layers
        if rest in _MTP_SHARED:
            return None, _MTP_SHARED[rest]
        if rest == "shared_head.norm.weight":
            native = f"mtp.{k}.norm.weight"
        elif rest.startswith(_MTP_OWN):
            native = f"mtp.{k}.{rest}"
        else:
            native = f"mtp.{k}.layer.{rest}"
    e = _EXPERT.match(native)
    if e:
        return f"{e.group(1)}.{e.group(3)}", int(e.group(2))
    return native, None


def native_to_hf(name: str, num_hidden_layers: int, expert: int | None = None) -> str:
    """Inverse of `hf_to_native` (for stacked experts pass the expert row)."""
    if name in ("embed_tokens.weight", "norm.weight"):
        return f"model.{name}"
    if name == "lm_head.weight":
        return name
    if expert is not None:
        base, proj = name.rsplit(".", 1)
        name = f"{base}.{expert}.{proj}.weight"
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if m:
        return f"model.layers.{m.group(1)}.{m.group(2)}"
    m = re.match(r"^mtp\.(\d+)\.(.*)$", name)
    if m:
        idx, rest = num_hidden_layers + int(m.group(1)), m.group(2)
        if rest == "norm.weight":
            rest = "shared_head.norm.weight"
        elif rest.startswith("layer."):
            rest = rest[len("layer."):]
        return f"model.layers.{idx}.{rest}"
    raise KeyError(name)


def native_state_to_hf(state: dict[str, torch.Tensor], cfg: DSv3Config) -> dict[str, torch.Tensor]:
    """Our state dict -> released names (experts unstacked; MTP gets its shared head/embedding copies)."""
    L = cfg.model.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("tokens_per_expert") or name.startswith("rotary."):
            continue
        if re.search(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$", name):
            for e in range(t.shape[0]):
                out[native_to_hf(name, L, e)] = t[e]
        else:
            out[native_to_hf(name, L)] = t
    for k in range(cfg.mtp.depth):
        out[f"model.layers.{L + k}.embed_tokens.weight"] = state["embed_tokens.weight"]
        out[f"model.layers.{L + k}.shared_head.head.weight"] = state["lm_head.weight"]
    return out


def list_checkpoint_files(path: str | os.PathLike) -> dict[str, str]:
    """{stored tensor name: safetensors file} of a single-file or index-sharded directory (FP8 scales included),
    after the reader's checks of every header and of the index."""
    with CheckpointReader(path, require_config=False) as r:
        return {n: info.file for n, info in r.stored.items()}


def iter_checkpoint_tensors(path: str | os.PathLike, allow_non_finite: bool = False
                            ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield every stored tensor as (name, file, tensor) lazily, file by file, as stored: FP8 weights stay FP8
    and their `_scale_inv` come as tensors of their own (use `checkpoint.reader.CheckpointReader.get` for
    dequantized weights). Headers are checked first; NaN/Inf values (FP8 NaN codes included) raise
    `CheckpointError` unless `allow_non_finite`."""
    with CheckpointReader(path, require_config=False, allow_non_finite=allow_non_finite) as r:
        by_file: dict[str, list[str]] = defaultdict(list)
        for n, info in r.stored.items():
            by_file[info.file].append(n)
        for fn, names in by_file.items():
            for name in names:
                t = r.raw(name)
                check_finite(t, f"{name} in {os.path.basename(fn)}", allow_non_finite)
                yield name, fn, t


def _load_plan(names_shapes: Iterator[tuple[str, str, tuple, bool]], state_shapes: dict[str, tuple], L: int,
               where_dir: str) -> tuple[list[tuple[str, str, int | None]], list[tuple[str, str]]]:
    """Match stored tensors (name, file, shape, is_float) to the model's state (native name -> shape) from the
    headers alone: raises on anything unexpected, mis-shaped, non-floating or missing. Returns
    ([(name, native, expert)], [(name, native of a shared MTP copy)])."""
    plan: list[tuple[str, str, int | None]] = []
    shared: list[tuple[str, str]] = []
    seen: dict[str, set] = defaultdict(set)
    for name, fn, shape, is_float in names_shapes:
        where = f"{name} in {os.path.basename(fn)}"
        try:
            native, expert = hf_to_native(name, L)
        except KeyError:
            raise CheckpointError(f"{where}: unexpected tensor (not part of a DeepSeek-V3 model)") from None
        if native is None:
            want = state_shapes[expert]
            if tuple(shape) != tuple(want):
                raise CheckpointError(f"{where}: shape {tuple(shape)} does not match the config's {tuple(want)}")
            shared.append((name, expert))
            continue
        if native not in state_shapes and math.prod(shape) == 0:
            continue  # transformers writes empty shared-expert weights when n_shared_experts = 0
        if native not in state_shapes:
            raise CheckpointError(f"{where}: unexpected tensor (the config builds no {native})")
        if not is_float:
            raise CheckpointError(f"{where}: not a floating-point weight")
        full = tuple(state_shapes[native])
        if expert is not None and expert >= full[0]:
            raise CheckpointError(f"{where}: unexpected tensor (expert {expert} but the config has "
                                  f"{full[0]} routed experts)")
        want = full if expert is None else full[1:]
        if tuple(shape) != want:
            raise CheckpointError(f"{where}: shape {tuple(shape)} does not match the config's {want}")
        seen[native].add(expert)
        plan.append((name, native, expert))
    missing = []
    for native, shape in state_shapes.items():
        if native.endswith("tokens_per_expert"):
            continue
        got = seen.get(native, set())
        if re.search(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$", native):
            missing += [native_to_hf(native, L, e) for e in range(shape[0]) if e not in got]
        elif not got:
            missing.append(native_to_hf(native, L))
    if missing:
        raise CheckpointError(f"{missing[0]}: missing from {where_dir}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return plan, shared


def _reader_plan(reader: CheckpointReader, state_shapes: dict[str, tuple], L: int):
    items = ((n, reader.info(n).file, reader.shape(n), reader.is_fp8(n) or reader.info(n).torch_dtype.is_floating_point)
             for n in reader.names())
    return _load_plan(items, state_shapes, L, reader.path)


def _load_from_reader(model: torch.nn.Module, reader: CheckpointReader) -> None:
    L = model.cfg.model.num_hidden_layers
    state = model.state_dict()
    plan, shared = _reader_plan(reader, {k: tuple(v.shape) for k, v in state.items()}, L)
    with torch.no_grad():
        for name, native, expert in plan:
            # FP8 -> fp32: the exact product of DeepSeek's formula, then the model's dtype
            t = reader.get(name, torch.float32 if reader.is_fp8(name) else None)
            dst = state[native] if expert is None else state[native][expert]
            dst.copy_(t.to(dst.dtype))
        for name, native in shared:
            t = reader.get(name, torch.float32 if reader.is_fp8(name) else None)
            if not torch.equal(t.to(state[native].dtype), state[native]):
                raise CheckpointError(f"{name} in {os.path.basename(reader.info(name).file)}: differs from "
                                      f"{native_to_hf(native, L)}; the MTP module shares the main embedding/head "
                                      "physically (paper §3.2.3)")


def load_hf_state_into(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None,
                       allow_non_finite: bool = False) -> None:
    """Copy every released tensor of `path` into `model` (a DSv3Model); complain about anything missing,
    unexpected, mis-shaped, non-floating or (unless `allow_non_finite`) NaN/Inf — all but the last from the
    headers, before any data is read."""
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as reader:
        _load_from_reader(model, reader)


def model_config(hf_config: dict, cfg_path: str, overrides: dict | None = None) -> DSv3Config:
    """`DSv3Config.from_hf` of a released config.json's dict: the file's own defects raise `CheckpointError`
    naming `cfg_path`; the caller's `overrides` (validated afterwards) raise `ConfigError` naming their keys."""
    try:
        cfg = DSv3Config.from_hf(hf_config)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        msg = f"missing key {e}" if isinstance(e, KeyError) else str(e)
        raise CheckpointError(f"{cfg_path}: {msg}") from None
    return DSv3Config.from_hf(hf_config, **overrides) if overrides else cfg


def _config_of(reader: CheckpointReader, overrides: dict) -> DSv3Config:
    return model_config(reader.config, reader.config_path, overrides)


def _state_shapes(cfg: DSv3Config) -> dict[str, tuple]:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return {k: tuple(v.shape) for k, v in DSv3Model(cfg).state_dict().items()}


def pretrained_config(path: str | os.PathLike, **config_overrides) -> DSv3Config:
    """The `DSv3Config` a released directory builds, after checking everything that can be checked without
    reading tensor data: config.json, index, every safetensors header, FP8 scale pairing, and the tensor set
    and shapes against the model the config implies. Raises `CheckpointError` naming file and tensor/key."""
    with CheckpointReader(path) as reader:
        cfg = _config_of(reader, config_overrides)
        _reader_plan(reader, _state_shapes(cfg), cfg.model.num_hidden_layers)
    return cfg


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    allow_non_finite: bool = False, **config_overrides) -> "torch.nn.Module":
    """Build a `DSv3Model` from a released-format directory and load its weights (MTP included).

    `config_overrides` deep-merge into the derived `DSv3Config` (e.g. `parallel={"ep": 2}`). NaN/Inf in
    weights or scales raise `CheckpointError` unless `allow_non_finite` (to inspect such a file)."""
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as reader:
        cfg = _config_of(reader, config_overrides)
        _reader_plan(reader, _state_shapes(cfg), cfg.model.num_hidden_layers)  # before allocating the model
        model = build_model(cfg)
        _load_from_reader(model, reader)
    return model.to(device=device, dtype=dtype)
