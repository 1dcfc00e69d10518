"""Released DeepSeek-V3 checkpoints (HF layout) <-> `DSv3Model`.

Names come from the one table in `names.py` (released <-> native <-> Megatron): routed experts stored per
expert are stacked here into `[E, …]` parameters; the MTP module k at `model.layers.{num_hidden_layers + k}`
is loaded too (transformers drops that layer), its copies of the main embedding and head (`embed_tokens`,
`shared_head.head`) checked to equal the main ones, which the model shares. Data comes through the one
checkpoint reader (`reader.CheckpointReader`: lazy, FP8 block dequantization, integrity checks).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterator

import torch

from dsv3_plugin.checkpoint.names import is_runtime_state, native_to_released, parse_native, released_to_native
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local
from dsv3_plugin.training.transforms import build_model

__all__ = ["native_state_to_hf", "load_pretrained", "load_hf_state_into", "pretrained_config", "model_config"]


def _is_stacked_expert(native: str) -> bool:
    try:
        return parse_native(native, expert=0).row.is_expert
    except KeyError:
        return False


def _stored(native: str, cfg: DSv3Config) -> bool:
    """Whether a `DSv3Model` state-dict entry is a checkpoint tensor: not runtime state, and not `lm_head.weight`
    when it is the embedding itself (`tie_word_embeddings`: released files then hold no head)."""
    return not is_runtime_state(native) and not (cfg.model.tie_word_embeddings and native == "lm_head.weight")


def native_state_to_hf(state: dict[str, torch.Tensor], cfg: DSv3Config) -> dict[str, torch.Tensor]:
    """Our state dict -> released names (experts unstacked; the MTP module gets its own copies of the shared
    embedding / head, as in the release: clones, since safetensors refuses tensors that share storage)."""
    L = cfg.model.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not _stored(name, cfg):
            continue
        if _is_stacked_expert(name):
            for e in range(t.shape[0]):
                out[native_to_released(name, L, e)] = t[e]
        else:
            out[native_to_released(name, L)] = t
    for k in range(cfg.mtp.depth):
        head = state["embed_tokens.weight" if cfg.model.tie_word_embeddings else "lm_head.weight"]
        out[f"model.layers.{L + k}.embed_tokens.weight"] = state["embed_tokens.weight"].clone()
        out[f"model.layers.{L + k}.shared_head.head.weight"] = head.clone()
    return out


def _load_plan(
    names_shapes: Iterator[tuple[str, str, tuple, bool]], state_shapes: dict[str, tuple], L: int, where_dir: str
) -> tuple[list[tuple[str, str, int | None]], list[tuple[str, str]]]:
    """Match stored tensors (name, file, shape, is_float) to the model's state (native name -> shape) from the
    headers alone: raises on anything unexpected, mis-shaped, non-floating or missing. Returns
    ([(name, native, expert)], [(name, native of a shared MTP copy)])."""
    plan: list[tuple[str, str, int | None]] = []
    shared: list[tuple[str, str]] = []
    seen: dict[str, set] = defaultdict(set)
    for name, fn, shape, is_float in names_shapes:
        where = f"{name} in {os.path.basename(fn)}"
        try:
            native, expert, is_copy = released_to_native(name, L)
        except CheckpointError:
            raise CheckpointError(f"{where}: unexpected tensor (not part of a DeepSeek-V3 model)") from None
        if is_copy:
            # with tied embeddings the head copy is checked against the embedding, which is the head
            want = state_shapes[native if native in state_shapes else "embed_tokens.weight"]
            if tuple(shape) != tuple(want):
                raise CheckpointError(f"{where}: shape {tuple(shape)} does not match the config's {tuple(want)}")
            shared.append((name, native))
            continue
        if native not in state_shapes and math.prod(shape) == 0:
            continue  # transformers writes empty shared-expert weights when n_shared_experts = 0
        if native not in state_shapes:
            raise CheckpointError(f"{where}: unexpected tensor (the config builds no {native})")
        if not is_float:
            raise CheckpointError(f"{where}: not a floating-point weight")
        full = tuple(state_shapes[native])
        if expert is not None and expert >= full[0]:
            raise CheckpointError(
                f"{where}: unexpected tensor (expert {expert} but the config has {full[0]} routed experts)"
            )
        want = full if expert is None else full[1:]
        if tuple(shape) != want:
            raise CheckpointError(f"{where}: shape {tuple(shape)} does not match the config's {want}")
        seen[native].add(expert)
        plan.append((name, native, expert))
    missing = []
    for native, shape in state_shapes.items():
        got = seen.get(native, set())
        if _is_stacked_expert(native):
            missing += [native_to_released(native, L, e) for e in range(shape[0]) if e not in got]
        elif not got:
            missing.append(native_to_released(native, L))
    if missing:
        raise CheckpointError(
            f"{missing[0]}: missing from {where_dir}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return plan, shared


def _reader_plan(reader: CheckpointReader, state_shapes: dict[str, tuple], L: int):
    items = (
        (n, reader.info(n).file, reader.shape(n), reader.is_fp8(n) or reader.info(n).torch_dtype.is_floating_point)
        for n in reader.names()
    )
    return _load_plan(items, state_shapes, L, reader.path)


def _load_from_reader(model: torch.nn.Module, reader: CheckpointReader) -> None:
    L = model.cfg.model.num_hidden_layers
    state = model.state_dict()
    layout = getattr(model, "rank_layout", None)
    if layout is None:
        shapes = {k: tuple(v.shape) for k, v in state.items() if _stored(k, model.cfg)}
    else:  # the plan is checked against the full model's shapes; only the owned tensors are read
        shapes = _state_shapes(model.cfg)
    plan, shared = _reader_plan(reader, shapes, L)
    with torch.no_grad():
        for name, native, expert in plan:
            dst = state[native]
            if dst.is_meta:
                continue  # another rank's tensor: never read
            if expert is not None:
                er = getattr(layout, "expert_range", None) if layout is not None and layout.ep > 1 else None
                if er is not None and expert not in er:
                    continue  # another EP rank's expert: never read
                dst = dst[expert - (er.start if er is not None else 0)]
            # FP8 -> fp32: the exact product of DeepSeek's formula, then the model's dtype (one tensor at a time)
            t = reader.get(name, torch.float32 if reader.is_fp8(name) else None)
            dst.copy_(t.to(dst.dtype))
            del t
        if layout is not None:
            # NOTE: a rank-local load does not read the MTP module's copies of the embedding/head: the model
            # shares the main tensors (paper §3.2.3), and the full load checks the copies equal them.
            return
        for name, native in shared:
            t = reader.get(name, torch.float32 if reader.is_fp8(name) else None)
            if not torch.equal(t.to(state[native].dtype), state[native]):
                raise CheckpointError(
                    f"{name} in {os.path.basename(reader.info(name).file)}: differs from "
                    f"{native_to_released(native, L)}; the MTP module shares the main embedding/head "
                    "physically (paper §3.2.3)"
                )


def load_hf_state_into(
    model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None, allow_non_finite: bool = False
) -> None:
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
        # from_hf of a dict names the file "config.json": say which one instead of prefixing it twice
        msg = msg.removeprefix("config.json: ")
        raise CheckpointError(f"{cfg_path}: {msg}") from None
    return DSv3Config.from_hf(hf_config, **overrides) if overrides else cfg


def _config_of(reader: CheckpointReader, overrides: dict) -> DSv3Config:
    return model_config(reader.config, reader.config_path, overrides)


def _state_shapes(cfg: DSv3Config) -> dict[str, tuple]:
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        return {k: tuple(v.shape) for k, v in DSv3Model(cfg).state_dict().items() if _stored(k, cfg)}


def pretrained_config(path: str | os.PathLike, **config_overrides) -> DSv3Config:
    """The `DSv3Config` a released directory builds, after checking everything that can be checked without
    reading tensor data: config.json, index, every safetensors header, FP8 scale pairing, and the tensor set
    and shapes against the model the config implies.

    Args:
        path: a released-format checkpoint directory (config.json and the safetensors files).
        **config_overrides: `"dsv3"` sections deep-merged into the config derived from config.json (e.g.
            `parallel={"ep": 2}`).

    Returns:
        The validated config (what `load_pretrained` with the same arguments builds its model from).

    Raises:
        CheckpointError: the directory, config.json, index or a shard is missing or malformed, or a tensor is
            missing, unexpected or of the wrong shape; the message names the file and the tensor or key.
        ConfigError: an override is invalid (the message names its key).
    """
    with CheckpointReader(path) as reader:
        cfg = _config_of(reader, config_overrides)
        _reader_plan(reader, _state_shapes(cfg), cfg.model.num_hidden_layers)
    return cfg


def load_pretrained(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_non_finite: bool = False,
    layout: RankLayout | None = None,
    **config_overrides,
) -> torch.nn.Module:
    """Build a `DSv3Model` from a released-format directory and load its weights (MTP included).

    The directory is checked as `pretrained_config` does before the model is allocated; FP8 weights are
    dequantized with their block scales as they are read.

    Args:
        path: a released-format checkpoint directory (config.json and the safetensors files).
        dtype: dtype of the model's parameters.
        device: device of the model's parameters.
        allow_non_finite: load NaN/Inf in weights or scales instead of raising (to inspect such a file).
        layout: a `training.rank_local.RankLayout`: build that rank's rank-local model (`build_rank_local`:
            owned parameters created directly in `dtype` on `device`, the rest on `meta`) and read only the
            tensors the rank owns (its stages' layers, its experts; FP8 blocks dequantized one tensor at a
            time). None: the whole model.
        **config_overrides: `"dsv3"` sections deep-merged into the config derived from config.json (e.g.
            `parallel={"ep": 2}`, `fp8={"enabled": True}`).

    Returns:
        The model, with the transforms its config asks for (`training.transforms.build_model`: FP8, recompute)
        and `checkpoint_bytes_read` set (safetensors headers plus tensor data read).

    Raises:
        CheckpointError: as `pretrained_config`, and NaN/Inf in a weight or scale unless `allow_non_finite`;
            the message names the file and the tensor.
        ConfigError: an override is invalid (the message names its key), or a `lora` section (LoRA's base is
            `checkpoint.frozen_base.load_frozen_base`).
    """
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as reader:
        cfg = _config_of(reader, config_overrides)
        if cfg.lora is not None:  # (the transforms would add adapters the release does not hold: a KeyError)
            raise ConfigError(
                "dsv3.lora: load_pretrained loads the released model itself; a frozen base with LoRA adapters is "
                "checkpoint.frozen_base.load_frozen_base(path, lora=...), a trained adapter "
                "checkpoint.adapted_model.load_adapted(path, adapter)"
            )
        _reader_plan(reader, _state_shapes(cfg), cfg.model.num_hidden_layers)  # before allocating the model
        if layout is None:
            model = build_model(cfg)
            _load_from_reader(model, reader)
            model = model.to(device=device, dtype=dtype)
        else:
            model = build_rank_local(cfg, layout, dtype=dtype, device=device, init=False)
            _load_from_reader(model, reader)
        model.checkpoint_bytes_read = reader.bytes_read
    return model
