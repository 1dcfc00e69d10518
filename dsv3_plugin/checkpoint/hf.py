"""Released DeepSeek-V3 checkpoints (HF layout) <-> `DSv3Model`.

Released names (deepseek_v3_facts.md §1.8): `model.embed_tokens`, `model.layers.{i}.…`, `model.norm`,
`lm_head`; routed experts per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, stacked here into
`[E, …]` tensors); the router bias `mlp.gate.e_score_correction_bias`; and the MTP module k at
`model.layers.{num_hidden_layers + k}` (enorm, hnorm, eh_proj, the decoder block, `shared_head.norm`, and
`shared_head.head` / `embed_tokens`, which are the main model's head and embedding — we share them and
check that the file's copies agree). transformers drops that layer; we load it.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Iterator

import torch
from safetensors import safe_open

from ..config import DSv3Config
from ..errors import CheckpointError

__all__ = ["hf_to_native", "native_to_hf", "native_state_to_hf", "list_checkpoint_files",
           "iter_checkpoint_tensors", "load_pretrained", "load_hf_state_into"]

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
    """{tensor name: safetensors file} for a single-file or index-sharded checkpoint directory."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        files = {n: os.path.join(path, fn) for n, fn in weight_map.items()}
        for fn in sorted(set(files.values())):
            if not os.path.exists(fn):
                raise CheckpointError(f"{index}: points to missing file {os.path.basename(fn)}")
        return files
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(single, framework="pt") as f:
        return {n: single for n in f.keys()}


def iter_checkpoint_tensors(path: str | os.PathLike) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (name, file, tensor) lazily, file by file. FP8 tensors come with their `_scale_inv` applied
    by `checkpoint.reader` when available; here plain float tensors are passed through."""
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, fn in list_checkpoint_files(path).items():
        by_file[fn].append(name)
    for fn, names in sorted(by_file.items()):
        try:
            with safe_open(fn, framework="pt") as f:
                present = set(f.keys())
                for name in sorted(names):
                    if name not in present:
                        raise CheckpointError(f"{name}: listed in the index but not in {os.path.basename(fn)}")
                    yield name, fn, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{fn}: cannot read safetensors ({type(e).__name__}: {e})") from None


def load_hf_state_into(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Copy every released tensor of `path` into `model` (a DSv3Model); complain about anything missing,
    unexpected, mis-shaped or non-floating."""
    cfg: DSv3Config = model.cfg
    L = cfg.model.num_hidden_layers
    state = model.state_dict()
    seen: dict[str, set] = defaultdict(set)
    shared_copies: list[tuple[str, str, str, torch.Tensor]] = []
    for name, fn, t in _tensors(path):
        where = f"{name} in {os.path.basename(fn)}"
        try:
            native, expert = hf_to_native(name, L)
        except KeyError:
            raise CheckpointError(f"{where}: unexpected tensor (not part of a DeepSeek-V3 model)") from None
        if native is None:
            shared_copies.append((name, fn, expert, t))
            continue
        if native not in state and t.numel() == 0:
            continue  # transformers writes empty shared-expert weights when n_shared_experts = 0
        if native not in state:
            raise CheckpointError(f"{where}: unexpected tensor (the config builds no {native})")
        if not t.is_floating_point():
            raise CheckpointError(f"{where}: dtype {t.dtype} is not a floating-point weight")
        if expert is not None and expert >= state[native].shape[0]:
            raise CheckpointError(f"{where}: unexpected tensor (expert {expert} but the config has "
                                  f"{state[native].shape[0]} routed experts)")
        dst = state[native] if expert is None else state[native][expert]
        if tuple(t.shape) != tuple(dst.shape):
            raise CheckpointError(f"{where}: shape {tuple(t.shape)} does not match the config's {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(t.to(dst.dtype))
        seen[native].add(expert)
    missing = []
    for native, t in state.items():
        if native.endswith("tokens_per_expert"):
            continue
        got = seen.get(native, set())
        if re.search(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$", native):
            missing += [native_to_hf(native, L, e) for e in range(t.shape[0]) if e not in got]
        elif not got:
            missing.append(native_to_hf(native, L))
    if missing:
        raise CheckpointError(f"{missing[0]}: missing from {os.fspath(path)}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, fn, native, t in shared_copies:
        if not torch.equal(t.to(state[native].dtype), state[native]):
            raise CheckpointError(f"{name} in {os.path.basename(fn)}: differs from {native_to_hf(native, L)}; "
                                  "the MTP module shares the main embedding/head physically (paper §3.2.3)")


def _tensors(path):
    try:  # FP8-aware reader (dequantizes `weight_scale_inv` blocks) when present
        from .reader import iter_dequantized_tensors
    except ImportError:
        iter_dequantized_tensors = None
    if iter_dequantized_tensors is not None:
        yield from iter_dequantized_tensors(path)
        return
    for name, fn, t in iter_checkpoint_tensors(path):
        if t.element_size() == 1 and t.is_floating_point():
            raise CheckpointError(f"{name} in {os.path.basename(fn)}: FP8 weights need checkpoint.reader")
        yield name, fn, t


def load_pretrained(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    **config_overrides) -> "torch.nn.Module":
    """Build a `DSv3Model` from a released-format directory and load its weights (MTP included).

    `config_overrides` deep-merge into the derived `DSv3Config` (e.g. `parallel={"ep": 2}`)."""
    from ..model import DSv3Model
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{cfg_path}: missing")
    cfg = DSv3Config.from_hf(cfg_path, **config_overrides)
    model = DSv3Model(cfg)
    load_hf_state_into(model, path)
    return model.to(device=device, dtype=dtype)
