"""Megatron-Core adapter: DeepSeek-V3 layer specs (MLA + our DeepSeekMoE / MTP), config bridge, weight loading.

Importing this package imports nothing from Megatron and patches nothing; the submodules import Megatron-Core
when first used. Megatron-LM usage: `python -m dsv3_plugin.megatron.pretrain_gpt <flags> --dsv3-config ds.json`
(megatron-core >= 0.19), or Megatron-LM 0.16's `pretrain_gpt.py` with `patches/pretrain_gpt.diff` applied;
`--spec dsv3_plugin.megatron layer_spec` names our layer spec (the attribute is created on first access).
See docs/megatron.md.
"""

from __future__ import annotations

import importlib

__all__ = [
    "layer_spec",
    "get_layer_spec",
    "get_mtp_block_spec",
    "to_transformer_config",
    "DSv3TransformerConfig",
    "build_gpt_model",
    "gpt_builder",
    "forward_logits",
    "DSv3FFN",
    "MegatronRouter",
    "SDPACoreAttention",
    "load_hf_checkpoint",
    "load_megatron_checkpoint",
]

_WHERE = {
    "get_layer_spec": "spec",
    "get_mtp_block_spec": "spec",
    "to_transformer_config": "config",
    "DSv3TransformerConfig": "config",
    "build_gpt_model": "gpt",
    "gpt_builder": "gpt",
    "forward_logits": "gpt",
    "DSv3FFN": "moe",
    "MegatronRouter": "moe",
    "SDPACoreAttention": "attention",
    "load_hf_checkpoint": "weights",
    "load_megatron_checkpoint": "weights",
}


def __getattr__(name):
    """The package's public names, each imported from its submodule (`_WHERE`) on first access, and `layer_spec`.

    `layer_spec` is `spec.get_layer_spec()` (Transformer Engine when it is really importable), built on first
    access and then kept in the module's dict: Megatron-LM's `--spec dsv3_plugin.megatron layer_spec` imports
    the name (which calls this) and then reads `vars(module)["layer_spec"]`.

    Args:
        name: the attribute looked up.

    Returns:
        The object (a `ModuleSpec` for `layer_spec`).

    Raises:
        AttributeError: `name` is none of `__all__`.
    """
    if name == "layer_spec":
        # Megatron-LM's `--spec module name` reads vars(module)[name]: cache the spec in the module dict.
        spec = importlib.import_module(".spec", __name__).get_layer_spec()
        globals()["layer_spec"] = spec
        return spec
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
