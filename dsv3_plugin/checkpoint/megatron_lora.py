"""A Megatron-LM LoRA run's `--save` read for export: its record (`dsv3_lora.json`: the base's fingerprint and
directory, the LoRA settings) and its adapters, renamed from the plugin's Megatron modules to `DSv3Model` names.

The chunks of a LoRA run save their adapters only (`megatron.lora.LoRAChunk`): `decoder.layers.{g}.{module}.lora_A`
/ `.lora_B` ([r, d_in] / [d_out, r]; g the global layer), the routed experts' stacked `…mlp.moe.experts.w1_lora_A`
([E, r, H], ...), and under `lora.bias_update` the routing biases. The FP32 master (`optimizer.state.fp32_param.*`)
is read where the run kept one. Files are read through `megatron_dist.MegatronDistReader` (weights_only).
"""

from __future__ import annotations

import json
import os

import torch

from dsv3_plugin.checkpoint.megatron_dist import MegatronDistReader
from dsv3_plugin.checkpoint.names import LAYER
from dsv3_plugin.checkpoint.run_checkpoint import RunLoRA
from dsv3_plugin.config import LoRAConfig
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.training.lora import is_adapter

__all__ = ["RECORD_NAME", "read_lora_record", "megatron_native_name", "megatron_lora"]

RECORD_NAME = "dsv3_lora.json"  # in a LoRA run's --save: what the adapters there sit on

# the plugin's Megatron module (below `decoder.layers.{i}.`) -> its `DSv3Model` module (below `layers.{g}.`), for
# every weight and buffer of a decoder layer (the routed experts' stack: `mlp.moe.experts` -> `mlp.experts`)
_MODULES = {
    r.megatron.removesuffix(".weight"): r.native.removesuffix(".weight")
    for r in LAYER
    if r.megatron is not None and r.native is not None and not r.is_expert
} | {"mlp.moe.experts": "mlp.experts"}


def read_lora_record(path: str) -> dict | None:
    """`path/dsv3_lora.json` (None when absent): {"base_fingerprint", "lora": LoRAConfig fields[, "base_path"]}.

    Raises:
        CheckpointError: unreadable, or not a LoRA record.
    """
    f = os.path.join(path, RECORD_NAME)
    if not os.path.isfile(f):
        return None
    try:
        with open(f) as fh:
            rec = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: not a readable LoRA record ({e})") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("lora"), dict):
        raise CheckpointError(f"{f}: not a LoRA record (no lora settings)")
    return rec


def megatron_native_name(name: str, offset: int = 0) -> str | None:
    """The `DSv3Model` name of a chunk's tensor or module `decoder.layers.{i}.{module}[.{leaf}]` (layer i of a chunk
    whose first global layer is `offset`; a saved name has the global layer, offset 0). None outside the decoder
    layers' modules in the name table."""
    parts = name.split(".", 3)
    if len(parts) < 4 or parts[:2] != ["decoder", "layers"] or not parts[2].isdigit():
        return None
    layer, sub = f"layers.{offset + int(parts[2])}.", parts[3]
    for module, leaf in ((sub, ""), tuple(sub.rsplit(".", 1)) if "." in sub else (sub, "")):
        if module in _MODULES:
            return layer + _MODULES[module] + (f".{leaf}" if leaf else "")
    return None


def megatron_lora(reader: MegatronDistReader, save_dir: str) -> RunLoRA | None:
    """The LoRA state of a Megatron-LM `--save` (None without its record): every saved model tensor must be an
    adapter (or, under `lora.bias_update`, a routing bias), under `DSv3Model` names, as FP32.

    Raises:
        CheckpointError: a saved tensor that is no adapter of a decoder layer, or no adapter at all.
    """
    rec = read_lora_record(save_dir)
    if rec is None:
        return None
    where = os.path.join(save_dir, RECORD_NAME)
    try:
        lora = LoRAConfig(**rec["lora"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: invalid lora settings ({str(e).splitlines()[0]})") from None
    adapters: dict[str, torch.Tensor] = {}
    bias: dict[str, torch.Tensor] = {}
    for key in reader.tensor_keys():
        if key.startswith("optimizer."):
            continue
        native = megatron_native_name(key)
        if native is None or not (is_adapter(key) or (lora.bias_update and key.endswith("e_score_correction_bias"))):
            raise CheckpointError(f"{key} in {reader.path}: not an adapter of a decoder layer (a LoRA run saves those)")
        master = f"optimizer.state.fp32_param.{key}"
        t = reader.get(master if reader.has(master) else key).detach().float().clone()
        (adapters if is_adapter(key) else bias)[native] = t
    if not adapters:
        raise CheckpointError(f"{reader.path}: no LoRA adapters (its {RECORD_NAME} says it is a LoRA run)")
    fp, bp = rec.get("base_fingerprint"), rec.get("base_path")
    return RunLoRA(adapters, lora, fp if isinstance(fp, str) else None, bp if isinstance(bp, str) else None, bias)
