"""`DSv3Config` -> Megatron-Core `MLATransformerConfig` (one way only: the DSv3 config is the source of truth), and
the one `DSv3Config` of a Megatron-LM run.

`to_transformer_config(cfg)` returns a `DSv3TransformerConfig`: Megatron's `MLATransformerConfig` plus the field
`dsv3_config`, the `DSv3Config` it came from (our MLP adapter reads the MoE settings there). Field map:
docs/facts.md §4. A run's config is built once per process (`read_config_file` / `config_from_block`, by
`pretrain_gpt.parse_megatron_args`) and handed out by `run_config(args)`, as Megatron's own `get_args()`.

NOTE: Megatron's MTP loss divides each depth's summed CE by the unmasked tokens (T−k per sequence), ours (paper
eq. 24) by T: with λ unchanged the MTP gradient is T/(T−k) larger in Megatron's loop; the logits are identical.
Design notes (the field map, how Megatron's copies of the MoE fields are used): docs/design_notes.md#megatron-config
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from dsv3_plugin.config import ConfigError, DSv3Config, load_config
from dsv3_plugin.training.lora import bias_update_speed

__all__ = [
    "DSv3TransformerConfig",
    "to_transformer_config",
    "dsv3_config_of",
    "apply_schedules",
    "set_bias_update_rate",
    "follow_schedules",
    "read_config_file",
    "config_from_block",
    "set_run_config",
    "run_config",
    "config_source",
]


@dataclasses.dataclass
class DSv3TransformerConfig(MLATransformerConfig):
    """Megatron's MLA config carrying the `DSv3Config` it came from (survives `dataclasses.replace`)."""

    dsv3_config: Any | None = None


def _require_config(cfg: Any, what: str) -> DSv3Config:
    if not isinstance(cfg, DSv3Config):
        raise TypeError(
            f"{what}: takes a DSv3Config (got {type(cfg).__name__}); build it once with "
            "dsv3_plugin.config.load_config(path) and pass the object"
        )
    return cfg


def to_transformer_config(cfg: DSv3Config, tokens_seen: float = 0.0, **overrides: Any) -> DSv3TransformerConfig:
    """Megatron config for `cfg`. `overrides` are Megatron field names (parallel sizes, dtypes, recompute...)
    applied last; a model-shape override that contradicts `cfg` is a ConfigError naming the key."""
    _require_config(cfg, "to_transformer_config")
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
    return _require_config(cfg, "megatron config: dsv3_config")


def apply_schedules(config, tokens_seen: float) -> tuple[float, float]:
    """Set the schedules' current values on the Megatron config (paper §4.2: γ = 1e-3 then 0 for the last 500B
    tokens; λ = 0.3 for the first 10T tokens then 0.1): Megatron reads `moe_router_bias_update_rate` at every
    `finalize_model_grads` and `mtp_loss_scaling_factor` at every forward. Returns (γ, λ)."""
    cfg = dsv3_config_of(config)
    gamma, lam = bias_update_speed(cfg, tokens_seen), cfg.mtp.lam(tokens_seen)  # γ 0 under LoRA without bias_update
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


# How many DSv3Configs this process has built for a run (a file read, or a block derived from the flags validated):
# one per process (`run_config` hands the same object to every model chunk, the FP8 install, the schedules).
CONFIG_BUILDS = 0
# The run's config, with the `args` it belongs to. Not an attribute of `args`: Megatron pickles `args` into every
# checkpoint, and `--load` / `dsv3 export` read those without unpickling the plugin's classes.
_RUN: tuple[weakref.ref, DSv3Config] | None = None


def _block_config(block: dict) -> DSv3Config:
    """The one place the Megatron path validates a bare "dsv3" block."""
    return DSv3Config.from_block(block)


def read_config_file(path: str) -> DSv3Config:
    """The `DSv3Config` of `--dsv3-config`'s file (its "dsv3" block): read and validated here, once per process.

    Raises:
        ConfigError: unreadable file, bad block (the message names the file or the key)."""
    global CONFIG_BUILDS
    CONFIG_BUILDS += 1
    return load_config(path)


def config_from_block(block: dict) -> DSv3Config:
    """The `DSv3Config` of a "dsv3" block derived from Megatron's flags (`flags.block_from_args`), validated once.

    Raises:
        ConfigError: the block's first bad key (`dsv3.sec.key: why`)."""
    global CONFIG_BUILDS
    CONFIG_BUILDS += 1
    return _block_config(block)


def set_run_config(args, cfg: DSv3Config) -> None:
    """Make `cfg` the config `run_config(args)` returns (the entry point, once its flags are resolved)."""
    global _RUN
    _RUN = (weakref.ref(args), _require_config(cfg, "set_run_config"))


def run_config(args) -> DSv3Config:
    """The `DSv3Config` of the Megatron-LM run `args` belongs to: the one `pretrain_gpt.parse_megatron_args` built
    (`--dsv3-config`'s block, or the one derived from Megatron's own flags). Under Megatron-LM's own
    `pretrain_gpt.py` (patches/pretrain_gpt.diff: only `--dsv3-config` is added to its flags) the first call reads
    the file and later calls return the same object."""
    if _RUN is not None and _RUN[0]() is args:
        return _RUN[1]
    path = getattr(args, "dsv3_config", None)
    if not path:
        raise ConfigError(
            "megatron args: neither --dsv3-config nor a block derived from the flags (parse them with "
            "dsv3_plugin.megatron.pretrain_gpt.parse_megatron_args)"
        )
    cfg = read_config_file(path)
    set_run_config(args, cfg)
    return cfg


def config_source(args) -> str:
    """Where a run's dsv3 block came from, for messages: the `--dsv3-config` file or "the Megatron flags"."""
    return getattr(args, "dsv3_config", None) or "the Megatron flags"
