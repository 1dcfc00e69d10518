"""Layer specs: Megatron-Core `TransformerLayer`s with MLA self-attention and our FFNs (dense / DeepSeekMoE).

- `get_layer_spec(use_te=None)`: one `ModuleSpec` of a `TransformerLayer` for every decoder layer and the MTP
  layers (the FFN picks dense or MoE from its layer number, see `moe.DSv3FFN`). Without Transformer Engine the
  attention is Megatron's `MLASelfAttention` with local (torch) linears, torch RMSNorm for the q/kv latents and
  our `SDPACoreAttention`; with TE it is Megatron's own TE MLA spec with our FFN swapped in.
- `get_mtp_block_spec(config, use_te=None)`: Megatron's MTP block around the same layer spec (enorm, hnorm,
  eh_proj, the layer, final_layernorm — the released `shared_head.norm`), with `mtp.DSv3MTPLayer` handing
  depth k+1 the paper's h^k.
- `layer_spec`: the spec object for Megatron-LM's `--spec dsv3_plugin.megatron layer_spec` (Megatron-LM
  imports a module attribute, it does not call it); `dsv3_plugin.megatron` creates it on first access.

The MLP is plugged in the way Megatron-Core 0.15–0.17 builds it (`build_module(spec, config=...)`); from
0.18 on a layer's `mlp` is a builder callable `mlp(config=, pg_collection=, is_mtp_layer=, name=)`, which
`DSv3FFN.build` provides (written for that API from its description, not run here: only 0.16.1 is tested).
"""
from __future__ import annotations

import functools

from megatron.core.package_info import __version__ as MCORE_VERSION

from .attention import SDPACoreAttention
from .moe import DSv3FFN

__all__ = ["get_layer_spec", "get_mtp_block_spec", "have_te", "mlp_submodule", "MCORE_VERSION"]


def _version_tuple(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


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
        return _build_ffn                     # MlpBuilder protocol (>= 0.18)
    return ModuleSpec(module=DSv3FFN)         # build_module(spec, config=...) (0.15 - 0.17)


def _local_layer_spec():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    # NOTE: WrappedTorchNorm directly, not LocalSpecProvider.layer_norm(), which rebinds a Megatron global.
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=MLASelfAttention,
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
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=None, qk_layernorm=True,
                                                      multi_latent_attention=True)
    spec.submodules.mlp = mlp_submodule()
    # The TE spec fuses the pre-MLP norm into its fused MLP; ours is a plain module, so it needs its own norm.
    from megatron.core.extensions.transformer_engine import TENorm
    spec.submodules.pre_mlp_layernorm = TENorm
    return spec


@functools.lru_cache(maxsize=None)
def _cached(use_te: bool):
    return _te_layer_spec() if use_te else _local_layer_spec()


def get_layer_spec(use_te: bool | None = None):
    """The DeepSeek-V3 `TransformerLayer` spec (`use_te=None`: TE when it is really installed)."""
    use_te = have_te() if use_te is None else use_te
    return _cached(bool(use_te))


def get_mtp_block_spec(config, use_te: bool | None = None):
    """Megatron's MTP block around our layer spec (None when the config has no MTP): per depth enorm, hnorm,
    eh_proj, the layer, final_layernorm (= released `shared_head.norm`)."""
    if not config.mtp_num_layers:
        return None
    use_te = have_te() if use_te is None else use_te
    from .mtp import DSv3MTPLayer
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        block = get_gpt_mtp_block_spec(config, get_layer_spec(True), use_transformer_engine=True)
        for layer in block.layer_specs:
            layer.module = DSv3MTPLayer
        return block
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayerSubmodules)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    layer = ModuleSpec(module=DSv3MTPLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=WrappedTorchNorm, hnorm=WrappedTorchNorm, eh_proj=ColumnParallelLinear,
        transformer_layer=get_layer_spec(False), layer_norm=WrappedTorchNorm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * config.mtp_num_layers)
