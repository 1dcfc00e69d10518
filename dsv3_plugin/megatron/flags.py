"""Megatron-LM's command-line flags <-> the "dsv3" block: one table for both directions.

`dsv3_arg_values(cfg)` lists (Megatron-LM argument dest, dsv3 key, value) for every model flag the block fixes;
`reconcile_args` fills the flags from a block and refuses contradictions; `adapt_to_cpu` sets Megatron's CUDA-only
defaults to their CPU counterparts. Used by `pretrain_gpt.parse_megatron_args`.
"""

from __future__ import annotations

import math
from typing import Any

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.megatron.gpt import OUR_SPEC

__all__ = [
    "MEGATRON_MOE_ONLY_FLAGS",
    "dsv3_arg_values",
    "explicit_dests",
    "reconcile_args",
    "adapt_to_cpu",
    "flag_name",
    "flag_setting",
]

# Megatron-LM flags that configure Megatron's own MoELayer / router implementation; our DeepSeekMoE ignores them.
MEGATRON_MOE_ONLY_FLAGS = (
    "moe_grouped_gemm",
    "moe_router_fusion",
    "moe_permute_fusion",
    "moe_shared_expert_overlap",
    "moe_router_pre_softmax",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "moe_use_legacy_grouped_gemm",
)


def dsv3_arg_values(cfg: DSv3Config) -> list[tuple[str, str, Any]]:
    """(Megatron-LM argument dest, dsv3 key it comes from, value) for every model flag the dsv3 block fixes."""
    m, e, t = cfg.model, cfg.moe, cfg.mtp
    L, k, rs = m.num_hidden_layers, m.first_k_dense_replace, m.rope_scaling
    vals = [
        ("num_layers", "model.num_hidden_layers", L),
        ("hidden_size", "model.hidden_size", m.hidden_size),
        ("ffn_hidden_size", "model.intermediate_size", m.intermediate_size),
        ("num_attention_heads", "model.num_attention_heads", m.num_attention_heads),
        ("max_position_embeddings", "model.max_position_embeddings", m.max_position_embeddings),
        ("init_method_std", "model.initializer_range", m.initializer_range),
        ("multi_latent_attention", "model (MLA)", True),
        ("q_lora_rank", "model.q_lora_rank", m.q_lora_rank),
        ("kv_lora_rank", "model.kv_lora_rank", m.kv_lora_rank),
        ("qk_head_dim", "model.qk_nope_head_dim", m.qk_nope_head_dim),
        ("qk_pos_emb_head_dim", "model.qk_rope_head_dim", m.qk_rope_head_dim),
        ("v_head_dim", "model.v_head_dim", m.v_head_dim),
        ("rotary_base", "model.rope_theta", m.rope_theta),
        ("rope_type", "model.rope_scaling", "yarn" if rs is not None else "rope"),
        ("rotary_scaling_factor", "model.rope_scaling.factor", rs.factor if rs is not None else 1.0),
        ("mscale", "model.rope_scaling.mscale", rs.mscale if rs is not None else 1.0),
        ("mscale_all_dim", "model.rope_scaling.mscale_all_dim", rs.mscale_all_dim if rs is not None else 0.0),
        ("normalization", "model (RMSNorm)", "RMSNorm"),
        ("layernorm_epsilon", "model.rms_norm_eps", m.rms_norm_eps),
        ("swiglu", "model (SwiGLU)", True),
        ("add_bias_linear", "model (no linear biases)", False),
        ("untie_embeddings_and_output_weights", "model.tie_word_embeddings", not m.tie_word_embeddings),
        ("position_embedding_type", "model (RoPE inside MLA)", "none"),
        ("qk_layernorm", "model (q/kv latent RMSNorm)", True),
        ("hidden_dropout", "model (no dropout)", 0.0),
        ("attention_dropout", "model (no dropout)", 0.0),
        ("num_experts", "moe.n_routed_experts", e.n_routed_experts),
        ("moe_router_topk", "moe.top_k", e.top_k),
        ("moe_ffn_hidden_size", "moe.intermediate_size", e.intermediate_size),
        (
            "moe_shared_expert_intermediate_size",
            "moe.n_shared_experts x moe.intermediate_size",
            e.intermediate_size * e.n_shared_experts if e.n_shared_experts else None,
        ),
        ("moe_layer_freq", "model.first_k_dense_replace", [0] * k + [1] * (L - k)),
        ("moe_router_score_function", "moe (sigmoid gates)", "sigmoid"),
        ("moe_router_enable_expert_bias", "moe (aux-loss-free bias)", True),
        ("moe_router_bias_update_rate", "moe.bias_update_speed", e.gamma(0.0)),
        ("moe_router_num_groups", "moe.n_group", e.n_group if e.n_group > 1 else None),
        ("moe_router_group_topk", "moe.topk_group", e.topk_group if e.n_group > 1 else None),
        ("moe_router_topk_scaling_factor", "moe.route_scale", e.route_scale),
        ("moe_router_load_balancing_type", "moe.seq_aux_alpha", "seq_aux_loss" if e.seq_aux_alpha > 0 else "none"),
        ("moe_aux_loss_coeff", "moe.seq_aux_alpha", e.seq_aux_alpha),
        ("moe_router_dtype", "moe (fp32 router)", "fp32"),
        ("mtp_num_layers", "mtp.depth", t.depth or None),
        ("mtp_loss_scaling_factor", "mtp.loss_weight", t.lam(0.0)),
    ]
    par = cfg.parallel
    if "ep" in par.model_fields_set:
        vals.append(("expert_model_parallel_size", "parallel.ep", par.ep))
    if "pp" in par.model_fields_set:
        vals.append(("pipeline_model_parallel_size", "parallel.pp", par.pp))
    return vals


def _norm(dest: str, v: Any, L: int) -> Any:
    if dest == "moe_layer_freq" and isinstance(v, int):  # Megatron: every v-th layer is MoE
        return [1 if i % v == 0 else 0 for i in range(L)]
    if dest != "moe_layer_freq" and isinstance(v, (list, tuple)) and len(v) == 1:
        return v[0]  # nargs="+" flags (load balancing type, coeff)
    return v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def flag_name(parser, dest: str) -> str:
    for a in parser._actions:
        if a.dest == dest and a.option_strings:
            return a.option_strings[0]
    return "--" + dest.replace("_", "-")


def flag_setting(parser, dest: str, value: Any) -> str:
    """How a user would write `dest = value` on the command line (`--swiglu`, `--disable-bias-linear`, `--x 3`)."""
    for a in parser._actions:
        if a.dest == dest and a.option_strings and a.nargs == 0 and a.const == value:
            return a.option_strings[0]
    shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
    return f"{flag_name(parser, dest)} {shown}"


def explicit_dests(parser, argv: list[str]) -> set[str]:
    """Argument dests the command line sets (so a default can be told from a value the user asked for)."""
    out = set()
    for tok in argv:
        if tok.startswith("--"):
            action = parser._option_string_actions.get(tok.split("=", 1)[0])
            if action is not None:
                out.add(action.dest)
    return out


def reconcile_args(args, parser, explicit: set[str], cfg: DSv3Config, where: str) -> list[str]:
    """Fill Megatron-LM's model flags from the dsv3 block, refuse contradictions (ConfigError naming both), refuse
    flags that would do nothing with our layers. Returns notes on what was filled."""
    L = cfg.model.num_hidden_layers
    notes = []
    for dest, key, want in dsv3_arg_values(cfg):
        if not hasattr(args, dest):
            continue
        got = getattr(args, dest)
        if dest in explicit:
            if not _same(_norm(dest, got, L), want):
                raise ConfigError(
                    f"{flag_setting(parser, dest, got)}: contradicts {where} dsv3.{key} = {want!r}; "
                    "drop the flag or change the dsv3 block"
                )
        elif not _same(_norm(dest, got, L), want):
            setattr(args, dest, want)
            notes.append(f"{flag_setting(parser, dest, want)} (from dsv3.{key})")
    spec = getattr(args, "spec", None)
    if not spec or tuple(spec) == OUR_SPEC:
        for dest in MEGATRON_MOE_ONLY_FLAGS:
            if dest in explicit and hasattr(args, dest) and getattr(args, dest) != parser.get_default(dest):
                raise ConfigError(
                    f"{flag_name(parser, dest)}: configures Megatron's own MoE layer, which the dsv3 layer "
                    "spec replaces with DeepSeekMoE; drop the flag (or pass a Megatron --spec)"
                )
    if getattr(args, "tokenizer_type", None) == "NullTokenizer":
        if "vocab_size" in explicit and args.vocab_size != cfg.model.vocab_size:
            raise ConfigError(
                f"--vocab-size {args.vocab_size}: contradicts {where} dsv3.model.vocab_size = "
                f"{cfg.model.vocab_size}; drop the flag or change the dsv3 block"
            )
        if args.vocab_size is None:
            args.vocab_size = cfg.model.vocab_size
            notes.append(f"--vocab-size {cfg.model.vocab_size} (from dsv3.model.vocab_size)")
    return notes


_CPU_DEFAULTS = (
    ("distributed_backend", "gloo", "NCCL needs CUDA"),
    ("gradient_accumulation_fusion", False, "the fused weight-gradient kernel is CUDA-only"),
    ("transformer_impl", "local", "Transformer Engine layers need CUDA"),
)
_CPU_REFUSED = (
    ("bf16", "Megatron's mixed-precision optimizer asserts CUDA tensors"),
    ("fp16", "Megatron's mixed-precision optimizer asserts CUDA tensors"),
)


def adapt_to_cpu(args, parser, explicit: set[str]) -> list[str]:
    notes = []
    for dest, cpu_value, why in _CPU_DEFAULTS:
        if not hasattr(args, dest) or getattr(args, dest) == cpu_value:
            continue
        if dest in explicit:
            raise ConfigError(f"{flag_name(parser, dest)} {getattr(args, dest)}: no CUDA on this machine ({why})")
        setattr(args, dest, cpu_value)
        notes.append(f"{flag_setting(parser, dest, cpu_value)} on CPU ({why})")
    for dest, why in _CPU_REFUSED:
        if getattr(args, dest, None):
            raise ConfigError(f"{flag_name(parser, dest)}: not on CPU ({why})")
    return notes
