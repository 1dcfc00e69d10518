"""`DSv3Config` -> Megatron-Core `MLATransformerConfig` (one way only: the DSv3 config is the source of truth).

The returned config is a `DSv3TransformerConfig`, i.e. Megatron's `MLATransformerConfig` plus one dataclass
field, `dsv3_config`, holding the `DSv3Config` it was derived from. The plugin's MLP adapter reads the MoE
settings from there, so Megatron's copies of the MoE fields (`num_moe_experts`, `moe_router_*`, ...) only
drive Megatron's own machinery: `finalize_model_grads` updates our router's bias at
`moe_router_bias_update_rate` when `moe_router_enable_expert_bias` is on, and the MTP block reads
`mtp_num_layers` / `mtp_loss_scaling_factor`.

Field map (docs/facts.md §4): q_lora_rank, kv_lora_rank, qk_nope_head_dim -> qk_head_dim,
qk_rope_head_dim -> qk_pos_emb_head_dim, v_head_dim, rope_scaling (YaRN) -> rotary_scaling_factor,
original_max_position_embeddings, beta_fast/slow, mscale, mscale_all_dim; first_k_dense_replace ->
moe_layer_freq = [0]*k + [1]*(L-k); route_scale -> moe_router_topk_scaling_factor; n_group/topk_group ->
moe_router_num_groups/group_topk; γ -> moe_router_bias_update_rate; α -> moe_aux_loss_coeff with
seq_aux_loss; MTP depth/λ -> mtp_num_layers / mtp_loss_scaling_factor.

NOTE: Megatron's MTP loss divides each depth's summed CE by the number of unmasked tokens (T−k per sequence);
ours (paper eq. 24) divides by T. With λ passed unchanged the MTP gradient is T/(T−k) larger in Megatron's
training loop; the logits are identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from dsv3_plugin.config import ConfigError, DSv3Config, load_config

__all__ = [
    "DSv3TransformerConfig",
    "to_transformer_config",
    "dsv3_config_of",
    "apply_schedules",
    "set_bias_update_rate",
    "follow_schedules",
    "run_config",
    "config_source",
]


@dataclasses.dataclass
class DSv3TransformerConfig(MLATransformerConfig):
    """Megatron's MLA config carrying the `DSv3Config` it came from (survives `dataclasses.replace`)."""

    dsv3_config: Any | None = None


def to_transformer_config(cfg: DSv3Config, tokens_seen: float = 0.0, **overrides: Any) -> DSv3TransformerConfig:
    """Megatron config for `cfg`. `overrides` are Megatron field names (parallel sizes, dtypes, recompute...)
    applied last; a model-shape override that contradicts `cfg` is a ConfigError naming the key."""
    m, e = cfg.model, cfg.moe
    L, k = m.num_hidden_layers, m.first_k_dense_replace
    rs = m.rope_scaling
    fields: dict[str, Any] = dict(
        num_layers=L,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.intermediate_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        init_method_std=m.initializer_range,
        qk_layernorm=True,
        # MLA
        multi_latent_attention=True,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_nope_head_dim,
        qk_pos_emb_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        kv_channels=m.qk_nope_head_dim + m.qk_rope_head_dim,
        rotary_base=m.rope_theta,
        rope_type="yarn" if rs is not None else "rope",
        # Without YaRN the softmax-scale correction must vanish: scaling factor 1 and mscale_all_dim 0.
        rotary_scaling_factor=rs.factor if rs is not None else 1.0,
        original_max_position_embeddings=rs.original_max_position_embeddings
        if rs is not None
        else m.max_position_embeddings,
        beta_fast=rs.beta_fast if rs is not None else 32.0,
        beta_slow=rs.beta_slow if rs is not None else 1.0,
        mscale=rs.mscale if rs is not None else 1.0,
        mscale_all_dim=rs.mscale_all_dim if rs is not None else 0.0,
        # MoE: what Megatron's own machinery (bias update in finalize_model_grads, logging) reads
        num_moe_experts=e.n_routed_experts,
        moe_router_topk=e.top_k,
        moe_ffn_hidden_size=e.intermediate_size,
        moe_shared_expert_intermediate_size=(e.intermediate_size * e.n_shared_experts if e.n_shared_experts else None),
        moe_layer_freq=[0] * k + [1] * (L - k),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=cfg.moe.gamma(tokens_seen),
        moe_router_num_groups=e.n_group if e.n_group > 1 else None,
        moe_router_group_topk=e.topk_group if e.n_group > 1 else None,
        moe_router_topk_scaling_factor=e.route_scale,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss" if e.seq_aux_alpha > 0 else "none",
        moe_aux_loss_coeff=e.seq_aux_alpha,
        mtp_num_layers=cfg.mtp.depth or None,
        mtp_loss_scaling_factor=cfg.mtp.lam(tokens_seen),
        params_dtype=torch.float32,
        dsv3_config=cfg,
    )
    model_keys = {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "num_moe_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "mtp_num_layers",
    }
    for key, val in overrides.items():
        if key in model_keys and val is not None and val != fields[key]:
            raise ConfigError(
                f"megatron.{key}: {val!r} contradicts the dsv3 config ({fields[key]!r}); change the dsv3 config instead"
            )
    fields.update(overrides)
    return DSv3TransformerConfig(**fields)


def dsv3_config_of(config) -> DSv3Config:
    """The `DSv3Config` a Megatron config was derived from, or a clear error."""
    cfg = getattr(config, "dsv3_config", None)
    if cfg is None:
        raise ConfigError(
            "megatron config: has no dsv3_config; build it with "
            "dsv3_plugin.megatron.to_transformer_config(cfg) (or pass --dsv3-config to "
            "pretrain_gpt.py with patches/pretrain_gpt.diff applied)"
        )
    return cfg


def apply_schedules(config, tokens_seen: float) -> tuple[float, float]:
    """Set the schedules' current values on the Megatron config (paper §4.2: γ = 1e-3 then 0 for the last 500B
    tokens; λ = 0.3 for the first 10T tokens then 0.1): Megatron reads `moe_router_bias_update_rate` at every
    `finalize_model_grads` and `mtp_loss_scaling_factor` at every forward. Returns (γ, λ)."""
    cfg = dsv3_config_of(config)
    gamma, lam = cfg.moe.gamma(tokens_seen), cfg.mtp.lam(tokens_seen)
    config.moe_router_bias_update_rate = gamma
    if config.mtp_num_layers:
        config.mtp_loss_scaling_factor = lam
    return gamma, lam


def set_bias_update_rate(config, tokens_seen: float) -> float:
    """γ only (see `apply_schedules`)."""
    return apply_schedules(config, tokens_seen)[0]


def follow_schedules(model, tokens_seen_fn) -> None:
    """Keep γ and λ on schedule without touching the training loop: before every forward of `model` (a GPTModel
    built from our spec), read `tokens_seen_fn()` and `apply_schedules`. Used for Megatron-LM runs, where
    tokens seen = consumed samples × sequence length."""

    def hook(module, args, kwargs=None):
        apply_schedules(module.config, float(tokens_seen_fn()))

    model.register_forward_pre_hook(hook)


def run_config(args) -> DSv3Config:
    """The `DSv3Config` of a Megatron-LM run: `--dsv3-config`'s block, or the one derived from Megatron's own flags
    (`flags.block_from_args`, kept on `args.dsv3_block` as plain values)."""
    src = getattr(args, "dsv3_config", None) or getattr(args, "dsv3_block", None)
    if src is None:
        raise ConfigError(
            "megatron args: neither --dsv3-config nor a block derived from the flags (parse them with "
            "dsv3_plugin.megatron.pretrain_gpt.parse_megatron_args)"
        )
    return load_config(src) if isinstance(src, str) else DSv3Config.from_block(src)


def config_source(args) -> str:
    """Where a run's dsv3 block came from, for messages: the `--dsv3-config` file or "the Megatron flags"."""
    return getattr(args, "dsv3_config", None) or "the Megatron flags"
