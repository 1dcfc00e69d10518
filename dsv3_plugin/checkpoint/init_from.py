"""Start a training run from a released checkpoint (`--init-from DIR`), or build its model from scratch, on this
rank only.

`init_from_config` merges the released `config.json` (the model's shape) with the user's "dsv3" block (training
knobs); `build_train_model` builds this rank's model in the training dtype, reading only the tensors it owns.
"""

from __future__ import annotations

import os

import torch

from dsv3_plugin.checkpoint.frozen_base import load_frozen_base
from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local
from dsv3_plugin.training.transforms import build_model

__all__ = ["build_train_model", "init_from_config", "with_model_shape"]


def build_train_model(
    cfg,
    init_from: str | None,
    allow_non_finite: bool = False,
    rank: int = 0,
    world: int = 1,
    dtype: torch.dtype = torch.float32,
):
    """This rank's model, its parameters created directly in `dtype` (DeepSpeed's bf16/fp16 dtype: the same values
    DeepSpeed's own cast of an FP32 build gives, since every tensor is drawn or dequantized in FP32 and rounded
    once; router weight, bias and counts FP32, see `engine.prepare_mixed_precision`). With pp > 1 or ep > 1 only
    what this rank owns (`training.rank_local`: its stages' layers, its experts; built on `meta`), and with
    `init_from` only its tensors read. With `cfg.lora` (already `training.lora.lora_model_config`'s) the release is
    the frozen base (`checkpoint.frozen_base.load_frozen_base`: FP8 storage under fp8.enabled) with adapters."""
    layout = RankLayout.for_rank(cfg, rank, world)
    direct = not layout.is_full or dtype != torch.float32  # the FP32 full build is the plain one
    if cfg.lora is not None:
        if not init_from:  # (RunConfig refuses it first; a direct caller gets the same line)
            raise ConfigError("dsv3.lora: LoRA trains adapters on a released base: pass --init-from DIR")
        d = cfg.to_dict()
        return load_frozen_base(
            init_from,
            layout=layout,
            dtype=dtype,
            device="cpu",
            allow_non_finite=allow_non_finite,
            **{sec: d[sec] for sec in ("moe", "mtp", "parallel", "fp8", "memory", "train", "lora")},
        )
    if init_from:
        # Shape from the released config.json, training knobs from the "dsv3" block (see init_from_config).
        d = cfg.to_dict()
        return load_pretrained(
            init_from,
            dtype=dtype,
            device="cpu",
            allow_non_finite=allow_non_finite,
            layout=layout if direct else None,
            **{sec: d[sec] for sec in ("moe", "mtp", "parallel", "fp8", "memory", "train")},
        )
    return build_rank_local(cfg, layout, dtype) if direct else build_model(cfg)


def with_model_shape(ds: dict, shape: DSv3Config, keep_user_model_keys: bool = False) -> dict:
    """The DeepSpeed JSON `ds` with its "dsv3" block's model shape taken from `shape` (a released config.json's,
    or a built model's `cfg`) and the training knobs (γ, λ, α schedules, parallel, fp8, memory, train.*, lora) from
    the block: the JSON need not repeat a checkpoint's shape.

    Args:
        ds: the DeepSpeed JSON as a dict, with a "dsv3" block.
        shape: where `model`, `moe` and `mtp` come from; moe/mtp keys the block sets explicitly win (training-time
            knobs such as the bias update speed).
        keep_user_model_keys: also let explicit `model` keys of the block win (so a caller can then compare them
            with the model and name a mismatch).

    Returns:
        A new dict whose "dsv3" block is complete (`"preset": None`).
    """
    if not isinstance(ds.get("dsv3"), dict):
        raise ConfigError('dsv3: the DeepSpeed JSON has no "dsv3" block')
    user = ds["dsv3"]
    asked = DSv3Config.from_block(user)
    have = shape.to_dict()
    block = {"preset": None, "model": dict(have["model"]), "moe": dict(have["moe"]), "mtp": dict(have["mtp"])}
    for sec in ("model", "moe", "mtp") if keep_user_model_keys else ("moe", "mtp"):
        for k, v in (user.get(sec) or {}).items():
            block[sec][k] = v
    for sec in ("parallel", "fp8", "memory", "train"):
        block[sec] = asked.to_dict()[sec]
    if asked.lora is not None:
        block["lora"] = asked.to_dict()["lora"]
    out = dict(ds)
    out["dsv3"] = block
    return out


def init_from_config(ds: dict, init_from: str) -> dict:
    """Model shape from the released config.json; training knobs (γ, λ, α schedules, train.*) from the JSON."""
    if not isinstance(ds.get("dsv3"), dict):
        raise ConfigError('dsv3: the DeepSpeed JSON has no "dsv3" block')
    hf_path = os.path.join(init_from, "config.json")
    if not os.path.lexists(hf_path):  # (present but a FIFO, a directory or a link out: the reader names it)
        raise CheckpointError(f"{hf_path}: not found (--init-from needs a released-format checkpoint dir)")
    DSv3Config.from_block(ds["dsv3"])  # the block's own errors first, named by key
    return with_model_shape(ds, pretrained_config(init_from))  # config.json, index, headers: CheckpointError
