"""Layer specs: Megatron-Core `TransformerLayer`s with MLA self-attention and our FFNs (dense / DeepSeekMoE).

`get_layer_spec(use_te=None)`: one `ModuleSpec` for every decoder and MTP layer (the FFN picks dense or MoE from
its layer number, `moe.DSv3FFN`); without Transformer Engine Megatron's `MLASelfAttention` with local linears and
our `SDPACoreAttention`, with TE Megatron's own TE MLA spec with our FFN swapped in. `get_mtp_block_spec(config)`:
Megatron's MTP block around the same layer spec, `mtp.DSv3MTPLayer` handing depth k+1 the paper's h^k.
`layer_spec`: the object for Megatron-LM's `--spec dsv3_plugin.megatron layer_spec`.

Megatron-Core 0.15–0.17 builds the MLP with `build_module(spec, config=...)`, 0.18+ through a builder callable
(the `MlpBuilder` protocol, `_build_ffn`). Tested: 0.16.1 and 0.19.2.

Design notes: docs/design_notes.md#megatron-spec
"""

from __future__ import annotations

import dataclasses
import functools

from megatron.core.package_info import __version__
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from dsv3_plugin.megatron.attention import SDPACoreAttention
from dsv3_plugin.megatron.moe import DSv3FFN
from dsv3_plugin.megatron.mtp import DSv3MTPLayer

MCORE_VERSION = __version__.split("+")[0]  # megatron-core adds "+<git hash>" when installed inside a git checkout


class LatentMLASelfAttention(MLASelfAttention):
    """Megatron's `MLASelfAttention`, told by the config whether the query has a latent (and so a q norm).

    One layer spec must serve every config (`--spec module name` hands Megatron a single object); the q-latent
    RMSNorm exists only when `q_lora_rank` is set, and Megatron-Core 0.19 rejects a q norm without it.
    """

    def __init__(self, config, submodules, *args, **kwargs):
        if config.q_lora_rank is None and submodules.q_layernorm not in (None, IdentityOp):
            submodules = dataclasses.replace(submodules, q_layernorm=IdentityOp)
        super().__init__(config, submodules, *args, **kwargs)

    def _resolve_qk_norm_config(self, submodules):
        """Megatron-Core >= 0.19 only (older versions never call it). Its resolver reads `qk_layernorm` without a
        query latent as "fuse a norm into linear_q_proj"; DeepSeek's MLA without a query latent has no query
        norm (only the kv latent is normed), so the spec's plain linear_q_proj is kept."""
        classes = super()._resolve_qk_norm_config(submodules)
        if self.config.q_lora_rank is None:
            classes["linear_q_proj"] = submodules.linear_q_proj
        return classes


__all__ = [
    "LatentMLASelfAttention",
    "get_layer_spec",
    "get_mtp_block_spec",
    "have_te",
    "mlp_submodule",
    "mtp_inner_layer_name",
    "MCORE_VERSION",
    "mcore_version_tuple",
]


def _version_tuple(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def mcore_version_tuple() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core."""
    return _version_tuple(MCORE_VERSION)


def have_te() -> bool:
    """Transformer Engine really importable (Megatron's fallbacks put MagicMocks in its place otherwise)."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _build_ffn(config, pg_collection=None, is_mtp_layer=False, name=None, **kw):
    return DSv3FFN(config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)


def mlp_submodule():
    """What goes into `TransformerLayerSubmodules.mlp` for the installed Megatron-Core."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if _version_tuple(MCORE_VERSION) >= (0, 18):
        return _build_ffn  # MlpBuilder protocol (>= 0.18)
    return ModuleSpec(module=DSv3FFN)  # build_module(spec, config=...) (0.15 - 0.17)


def _local_layer_spec():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    # NOTE: WrappedTorchNorm directly, not LocalSpecProvider.layer_norm(), which rebinds a Megatron global.
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=LatentMLASelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=ColumnParallelLinear,
                    linear_q_down_proj=ColumnParallelLinear,
                    linear_q_up_proj=ColumnParallelLinear,
                    linear_kv_down_proj=ColumnParallelLinear,
                    linear_kv_up_proj=ColumnParallelLinear,
                    core_attention=SDPACoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=WrappedTorchNorm,
                    kv_layernorm=WrappedTorchNorm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=mlp_submodule(),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _te_layer_spec():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=None, qk_layernorm=True, multi_latent_attention=True)
    spec.submodules.mlp = mlp_submodule()
    # The TE spec fuses the pre-MLP norm into its fused MLP; ours is a plain module, so it needs its own norm.
    from megatron.core.extensions.transformer_engine import TENorm

    spec.submodules.pre_mlp_layernorm = TENorm
    return spec


@functools.cache
def _cached(use_te: bool):
    return _te_layer_spec() if use_te else _local_layer_spec()


def get_layer_spec(use_te: bool | None = None):
    """The DeepSeek-V3 `TransformerLayer` spec: MLA self-attention and our FFN (`moe.DSv3FFN`, dense or
    DeepSeekMoE by layer number). One spec serves every decoder layer and the MTP layers' inner layer.

    Args:
        use_te: True: Megatron's Transformer Engine MLA spec with our FFN (and a TE norm before it); False: local
            (torch) linears and norms with our `SDPACoreAttention`; None: TE when it is really importable
            (`have_te`).

    Returns:
        A `ModuleSpec` of Megatron's `TransformerLayer`, built once per `use_te` and shared by later calls.
    """
    use_te = have_te() if use_te is None else use_te
    return _cached(bool(use_te))


def mtp_inner_layer_name() -> str:
    """Attribute (and state-dict) name of the transformer layer inside Megatron's MTP layer:
    `transformer_layer` up to 0.18, `mtp_model_layer` from 0.19 on."""
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayerSubmodules

    fields = MultiTokenPredictionLayerSubmodules.__dataclass_fields__
    return "mtp_model_layer" if "mtp_model_layer" in fields else "transformer_layer"


def get_mtp_block_spec(config, use_te: bool | None = None, layer_spec=None):
    """Megatron's multi-token-prediction block around `layer_spec`, one `mtp.DSv3MTPLayer` per depth (enorm,
    hnorm, eh_proj, the layer, final_layernorm = the released `shared_head.norm`).

    Args:
        config: the Megatron `TransformerConfig` (`to_transformer_config`); `config.mtp_num_layers` is the depth D.
        use_te: as in `get_layer_spec` (None: TE when it is really importable).
        layer_spec: the spec of the transformer layer inside each MTP layer (default: `get_layer_spec(use_te)`).

    Returns:
        Megatron's `MultiTokenPredictionBlockSubmodules` with D layer specs, or None when the config has no MTP
        (`mtp_num_layers` 0 or None).
    """
    if not config.mtp_num_layers:
        return None
    use_te = have_te() if use_te is None else use_te
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        block = get_gpt_mtp_block_spec(config, layer_spec or get_layer_spec(True), use_transformer_engine=True)
        for layer in block.layer_specs:
            layer.module = DSv3MTPLayer
        return block
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    layer = ModuleSpec(
        module=DSv3MTPLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=WrappedTorchNorm,
            hnorm=WrappedTorchNorm,
            eh_proj=ColumnParallelLinear,
            layer_norm=WrappedTorchNorm,
            **{mtp_inner_layer_name(): layer_spec or get_layer_spec(False)},
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)
