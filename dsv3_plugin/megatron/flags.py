"""Megatron-LM's command-line flags <-> the "dsv3" block: one table for both directions.

`dsv3_arg_values(cfg)` lists (Megatron-LM argument dest, dsv3 key, value) for every model flag the block fixes;
`reconcile_args` fills the flags from a block and refuses contradictions; `adapt_to_cpu` sets Megatron's CUDA-only
defaults to their CPU counterparts. Used by `pretrain_gpt.parse_megatron_args`.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

from dsv3_plugin.checkpoint.hf import model_config, pretrained_config
from dsv3_plugin.checkpoint.integrity import load_json
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.megatron.config import config_from_block
from dsv3_plugin.megatron.finetune import init_source_kind
from dsv3_plugin.megatron.gpt import OUR_SPEC

__all__ = [
    "MEGATRON_MOE_FLAGS",
    "megatron_moe_flags",
    "recompute_module_notes",
    "block_from_args",
    "FLAGS_SOURCE",
    "flags_config",
    "flag_names_of_keys",
    "derived_vocab_size",
    "dsv3_arg_values",
    "explicit_dests",
    "reconcile_args",
    "refuse_deepspeed_only_keys",
    "adapt_to_cpu",
    "attention_notes",
    "GPU_ONLY_FLAGS",
    "flag_name",
    "flag_setting",
]

# Megatron-LM flags that configure Megatron's own MoELayer / router implementation; our DeepSeekMoE ignores them.
# Megatron-LM flags that tune Megatron's own MoELayer. With the plugin's layers each is mapped to what runs instead
# (one printed line) or, where it would change the model's math and the plugin cannot do it, refused.
# dest -> ("map" | "refuse", what runs instead / why not)
MEGATRON_MOE_FLAGS: dict[str, tuple[str, str]] = {
    "moe_grouped_gemm": ("map", "the plugin's grouped expert GEMM runs (one GEMM per local expert group, always on)"),
    "moe_use_legacy_grouped_gemm": ("map", "the plugin's grouped expert GEMM runs"),
    "moe_single_grouped_weight": ("map", "the plugin's grouped expert GEMM runs on its own weight layout"),
    "moe_single_grouped_bias": ("map", "the plugin's experts have no biases"),
    "moe_token_dispatcher_type": ("map", "DISPATCH"),
    "moe_enable_deepep": ("map", "DISPATCH"),
    "moe_flex_dispatcher_backend": ("map", "DISPATCH"),
    "moe_flex_dispatcher_num_sms": ("map", "DISPATCH"),
    "moe_deepep_num_sms": ("map", "DISPATCH"),
    "moe_hybridep_num_sms": ("map", "DISPATCH"),
    "moe_hybridep_num_blocks_permute": ("map", "DISPATCH"),
    "moe_hybridep_num_blocks_unpermute": ("map", "DISPATCH"),
    "moe_hybridep_num_sms_preprocessing": ("map", "DISPATCH"),
    "moe_hybridep_pad_uneven_dispatch_inputs": ("map", "DISPATCH"),
    "moe_permute_fusion_into_hybridep": ("map", "DISPATCH"),
    "moe_ncclep_static_shape": ("map", "DISPATCH"),
    "moe_ncclep_zero_copy": ("map", "DISPATCH"),
    "moe_permute_fusion": ("map", "n/a: the plugin's dispatch sorts tokens by expert itself (no permute kernel)"),
    "moe_router_fusion": ("map", "n/a: the plugin's router runs unfused in fp32"),
    "moe_router_pre_softmax": ("map", "no effect with sigmoid scores (in Megatron neither)"),
    "moe_shared_expert_overlap": ("map", "n/a: the plugin runs the shared experts in the MoE layer's stream"),
    "moe_router_padding_for_fp8": ("map", "n/a: the plugin's FP8 expert kernel pads each expert's rows itself"),
    "moe_router_padding_for_quantization": ("map", "n/a: the plugin's FP8 expert kernel pads each expert's rows"),
    "moe_per_layer_logging": ("map", "n/a: the plugin's balance loss is not reported per layer to Megatron's log"),
    "moe_paged_stash": ("map", "n/a: Megatron's paged activation stash is for its MoELayer"),
    "moe_pad_experts_for_cuda_graph_inference": ("map", "n/a: inference-only"),
    "moe_expert_capacity_factor": ("refuse", "token dropping changes the model (DeepSeek-V3 drops no tokens)"),
    "moe_expert_rank_capacity_factor": ("refuse", "token dropping changes the model (DeepSeek-V3 drops none)"),
    "moe_pad_expert_input_to_capacity": ("refuse", "token dropping / padding to capacity is not DeepSeek-V3's"),
    "moe_z_loss_coeff": ("refuse", "a router z-loss is not part of DeepSeek-V3's objective"),
    "moe_input_jitter_eps": ("refuse", "router input jitter is not part of DeepSeek-V3's router"),
    "moe_router_force_biased": ("refuse", "biased random routing is a Megatron benchmark mode"),
    "moe_shared_expert_gate": ("refuse", "DeepSeek-V3's shared experts have no gate"),
    "moe_latent_size": ("refuse", "latent MoE projections are not DeepSeek-V3's"),
    "moe_apply_probs_on_input": ("refuse", "DeepSeek-V3 weights the expert outputs, not the inputs"),
    "moe_use_upcycling": ("refuse", "upcycling a dense checkpoint: start from one with --dsv3-init-from"),
    "moe_enable_routing_replay": ("refuse", "routing replay is not implemented by the plugin's router"),
    "moe_routing_trace_path": ("refuse", "routing traces are written by Megatron's router only"),
    "moe_router_force_load_balancing": (
        "map",
        "the plugin's router scores random logits (Megatron's benchmark mode: balanced loads, no learned routing)",
    ),
    "moe_layer_recompute": ("refuse", "use --recompute-granularity selective --recompute-modules mlp"),
    "moe_token_drop_policy": ("map", "n/a: no token is dropped (no capacity factor)"),
    "moe_paged_stash_page_size": ("map", "n/a: Megatron's paged activation stash is for its MoELayer"),
    "moe_paged_stash_buffer_size_factor_cuda": ("map", "n/a: Megatron's paged activation stash is for its MoELayer"),
    "moe_paged_stash_buffer_size_factor_cpu": ("map", "n/a: Megatron's paged activation stash is for its MoELayer"),
    "moe_router_quantile_balancing_ema": ("refuse", "quantile balancing is not DeepSeek-V3's balancing"),
    "moe_upcycling_granularity": ("refuse", "upcycling a dense checkpoint: start from one with --dsv3-init-from"),
    "moe_routing_trace_max_training_iters": ("refuse", "routing traces are written by Megatron's router only"),
    "moe_routing_trace_capture_logits": ("refuse", "routing traces are written by Megatron's router only"),
    "moe_routing_trace_capture_hidden_states": ("refuse", "routing traces are written by Megatron's router only"),
    "moe_routing_trace_dump_weights": ("refuse", "routing traces are written by Megatron's router only"),
    "use_megatron_fsdp": (
        "refuse",
        "Megatron-FSDP with the dsv3 layers is not built yet (their expert parameters reduce over the expert-data-"
        "parallel group, which Megatron-FSDP's sharding does not know); run with Megatron's DDP",
    ),
    "moe_shared_expert_glu_interleave_size": ("refuse", "the plugin's gate/up weights are not interleaved"),
    "moe_mlp_glu_interleave_size": ("refuse", "the plugin's gate/up weights are not interleaved"),
}


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


# --recompute-modules entries Megatron applies inside its own MoELayer: with the dsv3 layers the whole FFN (dense or
# DeepSeekMoE) is Megatron's "mlp" module, recomputed by "mlp".
_MOE_LAYER_RECOMPUTE = ("moe", "moe_act", "shared_experts")


def recompute_module_notes(args) -> list[str]:
    """What Megatron's selective recompute of MoELayer parts does with the dsv3 layers (they are "mlp" modules):
    covered by "mlp" when it is listed too (a note), else refused (it would recompute nothing).

    Raises:
        ConfigError: `--recompute-modules moe` (or moe_act, shared_experts) without mlp, naming it.
    """
    spec = getattr(args, "spec", None)
    mods = getattr(args, "recompute_modules", None) or []
    if (spec and tuple(spec) != OUR_SPEC) or getattr(args, "recompute_granularity", None) != "selective":
        return []
    moe = [m for m in mods if m in _MOE_LAYER_RECOMPUTE]
    if not moe:
        return []
    if "mlp" not in mods:
        raise ConfigError(
            f"--recompute-modules {' '.join(moe)}: recomputes parts of Megatron's MoELayer, which the dsv3 layers "
            "replace; their FFNs (dense and DeepSeekMoE) are Megatron 'mlp' modules: list mlp instead"
        )
    return [f"--recompute-modules {' '.join(moe)}: covered by mlp (the dsv3 FFNs, dense and DeepSeekMoE, are 'mlp')"]


def megatron_moe_flags(args, parser, explicit: set[str]) -> list[str]:
    """What runs instead of each Megatron MoE-implementation flag the command line sets (`MEGATRON_MOE_FLAGS`),
    with the plugin's layer spec. Returns one note per mapped flag.

    Raises:
        ConfigError: a flag that would change the model's math, naming it and why.
    """
    spec = getattr(args, "spec", None)
    if spec and tuple(spec) != OUR_SPEC:
        return []  # another layer spec: Megatron's own MoE layer reads these flags
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    dispatch = (
        f"the plugin's all-to-all over EP = {ep} runs instead (node-limited: a token crosses to each node once)"
        if ep > 1
        else "EP = 1: every expert is local, no dispatch runs"
    )
    notes = []
    for dest, (kind, what) in MEGATRON_MOE_FLAGS.items():
        if dest not in explicit or not hasattr(args, dest) or getattr(args, dest) == parser.get_default(dest):
            continue
        shown = flag_setting(parser, dest, getattr(args, dest))
        if kind == "refuse":
            raise ConfigError(f"{shown}: {what}; not with the dsv3 layers (drop the flag)")
        notes.append(f"{shown}: {dispatch if what == 'DISPATCH' else what}")
        if dest != "moe_router_force_load_balancing":  # (the one our router reads)
            # consumed here: Megatron's own checks of its MoE layer (e.g. a CUDA capability query for
            # --moe-grouped-gemm) do not apply to the layer that runs
            setattr(args, dest, parser.get_default(dest))
    return notes


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


# Values that build the same model as the block's: with MLA, RoPE is applied inside attention whatever Megatron's
# position-embedding type says, as long as it adds no position embedding of its own.
_EQUIVALENT = {"position_embedding_type": ("rope", "yarn", "none")}


# YaRN's settings that change nothing at scaling factor 1 (the model without YaRN): YaRN's frequencies are RoPE's
# (the interpolated and extrapolated ones coincide) and its mscale is 1 for factor <= 1 (Peng et al. 2023, eq. 22;
# Megatron's `_yarn_get_mscale`), whatever --mscale / --mscale-all-dim say.
_YARN_ONLY = ("rope_type", "mscale", "mscale_all_dim")
_NO_YARN_NOTE = "no effect at --rotary-scaling-factor 1 (no YaRN: plain RoPE, attention scale 1/sqrt(d))"


def _no_op_without_yarn(args, cfg: DSv3Config, dest: str) -> bool:
    """Whether `dest`'s value changes nothing: a YaRN-only setting of a model without YaRN, at factor 1."""
    if dest not in _YARN_ONLY or cfg.model.rope_scaling is not None:
        return False
    if dest == "rope_type" and getattr(args, dest) not in ("rope", "yarn"):
        return False
    return float(getattr(args, "rotary_scaling_factor", 1.0) or 1.0) == 1.0


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
            if not _same(_norm(dest, got, L), want) and _no_op_without_yarn(args, cfg, dest):
                notes.append(f"{flag_setting(parser, dest, got)}: {_NO_YARN_NOTE}")
            elif not _same(_norm(dest, got, L), want) and got not in _EQUIVALENT.get(dest, ()):
                raise ConfigError(
                    f"{flag_setting(parser, dest, got)}: contradicts {where} dsv3.{key} = {want!r}; "
                    "drop the flag or change the dsv3 block"
                )
        elif not _same(_norm(dest, got, L), want):
            setattr(args, dest, want)
            notes.append(f"{flag_setting(parser, dest, want)} (from dsv3.{key})")
    notes += megatron_moe_flags(args, parser, explicit)
    notes += recompute_module_notes(args)
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


# The "memory" keys only `dsv3 train` reads (its model transforms, its DeepSpeed engine): in a Megatron run they would
# be accepted and do nothing, so a value other than the default is refused, saying what Megatron has instead.
_DEEPSPEED_ONLY_MEMORY = {
    "recompute": "Megatron's pretrain() takes activation recompute from its flags: --recompute-granularity selective "
    "--recompute-modules mlp mla_up_proj layernorm, or --recompute-granularity full",
    "ema": "the parameter EMA is dsv3 train's; Megatron's pretrain() keeps none",
    "ema_decay": "the parameter EMA is dsv3 train's; Megatron's pretrain() keeps none",
    "bf16_moments": "dsv3 train's AdamW; Megatron's optimizer keeps its own moments",
    "flat_grads": "a DeepSpeed ZeRO-1 setting; Megatron's DDP keeps its own contiguous gradient buffer",
    "grad_norm": "a DeepSpeed ZeRO-1 setting; Megatron's optimizer takes its gradient norm in FP32 already",
    "chunked_step": "a DeepSpeed ZeRO-1 setting; Megatron's optimizer has its own step",
}


def refuse_deepspeed_only_keys(cfg: DSv3Config, where: str) -> None:
    """ConfigError naming the first `memory` key of the block (`where`: the --dsv3-config file) set to anything but
    its default: those keys configure `dsv3 train` only (`_DEEPSPEED_ONLY_MEMORY` says what Megatron has instead)."""
    default = type(cfg.memory)()
    for key, why in _DEEPSPEED_ONLY_MEMORY.items():
        got = getattr(cfg.memory, key)
        if got != getattr(default, key):
            raise ConfigError(f"dsv3.memory.{key} = {got!r} in {where}: not read by the Megatron path ({why})")


_CPU_DEFAULTS = (
    ("distributed_backend", "gloo", "NCCL needs CUDA"),
    ("gradient_accumulation_fusion", False, "the fused weight-gradient kernel is CUDA-only"),
    ("transformer_impl", "local", "Transformer Engine layers need CUDA"),
)
_CPU_REFUSED = (
    ("bf16", "Megatron's mixed-precision optimizer asserts CUDA tensors"),
    ("fp16", "Megatron's mixed-precision optimizer asserts CUDA tensors"),
    ("use_distributed_optimizer", "Megatron's distributed optimizer asserts CUDA tensors (and reduce-scatters)"),
    ("overlap_param_gather", "it needs Megatron's distributed optimizer, which asserts CUDA tensors"),
)


# The switches `adapt_to_cpu` refuses when a command line sets them on a machine without CUDA (the ones to take out of
# a GPU launch script to run it on CPU).
GPU_ONLY_FLAGS = tuple(d for d, _, _ in _CPU_DEFAULTS) + tuple(d for d, _ in _CPU_REFUSED)


def attention_notes(args) -> list[str]:
    """What `--use-flash-attn` runs with the plugin's layer spec when Transformer Engine's attention is not used."""
    if getattr(args, "use_flash_attn", False) and getattr(args, "transformer_impl", None) == "local":
        return [
            "--use-flash-attn: with --transformer-impl local, MLA's core attention is torch's "
            "scaled_dot_product_attention (its flash kernel where torch has one for the device)"
        ]
    return []


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


# --- the other direction: the flags -> a "dsv3" block (no --dsv3-config) ------------------------------------------

FLAGS_SOURCE = "the Megatron flags"  # what messages name as the block's source when it was derived

# Flags read one to one (the same rows as `dsv3_arg_values`, read backwards): dest -> dsv3 key.
_SAME_BACKWARDS = {
    "num_layers": "model.num_hidden_layers",
    "hidden_size": "model.hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "init_method_std": "model.initializer_range",
    "q_lora_rank": "model.q_lora_rank",
    "kv_lora_rank": "model.kv_lora_rank",
    "qk_head_dim": "model.qk_nope_head_dim",
    "qk_pos_emb_head_dim": "model.qk_rope_head_dim",
    "v_head_dim": "model.v_head_dim",
    "rotary_base": "model.rope_theta",
    "layernorm_epsilon": "model.rms_norm_eps",
    "num_experts": "moe.n_routed_experts",
    "moe_router_topk": "moe.top_k",
}
# Megatron's MLATransformerConfig fixes these YaRN settings (no flags); the block states them.
_MEGATRON_YARN = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _put(block: dict, key: str, value: Any) -> None:
    sec, _, name = key.partition(".")
    block.setdefault(sec, {})[name] = value


def block_from_args(args, parser, vocab_size: int) -> tuple[dict, list[str]]:
    """The "dsv3" block Megatron-LM's own DeepSeek-V3 flags describe (`--dsv3-config` absent): the rows of
    `dsv3_arg_values` read backwards, so that `reconcile_args` with the result changes no flag that was given.

    Args:
        args: Megatron-LM's parsed arguments (before `validate_args`).
        parser: the parser (for flag names in messages).
        vocab_size: embedding/output rows (the release's with `--dsv3-init-from`, else Megatron's padded
            vocabulary).

    Returns:
        (block, notes): a plain dict (`{"preset": None, "model": ..., "moe": ..., "mtp": ...}`; it travels in
        Megatron's saved args, so plain values only) and lines saying what was derived.

    Raises:
        ConfigError: a flag the plugin's model cannot honour, or a width the flags leave open, naming the flag.
    """
    g = lambda dest: getattr(args, dest, None)  # noqa: E731
    block: dict = {"preset": None, "model": {"vocab_size": int(vocab_size)}, "moe": {}, "mtp": {}}
    for dest, key in _SAME_BACKWARDS.items():
        if g(dest) is not None:
            _put(block, key, g(dest))
    if not g("num_experts"):
        raise ConfigError(f"{flag_name(parser, 'num_experts')}: not given; a DeepSeek-V3 model has routed experts")
    L = g("num_layers")
    if not g("ffn_hidden_size"):
        raise ConfigError(f"{flag_name(parser, 'ffn_hidden_size')}: not given (the dense layers' FFN width)")
    _put(block, "model.intermediate_size", g("ffn_hidden_size"))
    moe_ffn = g("moe_ffn_hidden_size") or g("ffn_hidden_size")  # Megatron's own default
    _put(block, "moe.intermediate_size", moe_ffn)
    # positions: Megatron's default (None) is --seq-length
    _put(block, "model.max_position_embeddings", g("max_position_embeddings") or g("seq_length"))
    _put(block, "model.tie_word_embeddings", not g("untie_embeddings_and_output_weights"))
    # RoPE: MLA takes YaRN unless --rope-type rope; a factor of 1 is plain RoPE (every YaRN correction is 1)
    rope_type = g("rope_type") or "yarn"
    if rope_type == "yarn" and float(g("rotary_scaling_factor") or 1.0) != 1.0:
        _put(
            block,
            "model.rope_scaling",
            {
                "type": "yarn",
                "factor": float(g("rotary_scaling_factor")),
                "mscale": float(g("mscale")),
                "mscale_all_dim": float(g("mscale_all_dim")),
                **_MEGATRON_YARN,
            },
        )
    else:
        _put(block, "model.rope_scaling", None)
    # dense layers first, then MoE: the only --moe-layer-freq pattern DeepSeek-V3 has
    freq = _norm("moe_layer_freq", g("moe_layer_freq"), L)
    k = next((i for i, f in enumerate(freq) if f), L)
    if list(freq) != [0] * k + [1] * (L - k) or len(freq) != L:
        raise ConfigError(
            f"{flag_setting(parser, 'moe_layer_freq', g('moe_layer_freq'))}: the dsv3 layers need the first k layers "
            "dense and every later one MoE (e.g. [0]*3+[1]*58)"
        )
    _put(block, "model.first_k_dense_replace", k)
    shared = g("moe_shared_expert_intermediate_size")
    if shared and shared % moe_ffn:
        raise ConfigError(
            f"--moe-shared-expert-intermediate-size {shared}: not a multiple of the expert width {moe_ffn} "
            "(DeepSeek-V3's shared experts have the routed experts' width)"
        )
    _put(block, "moe.n_shared_experts", shared // moe_ffn if shared else 0)
    groups = g("moe_router_num_groups") or 1
    _put(block, "moe.n_group", groups)
    _put(block, "moe.topk_group", g("moe_router_group_topk") or groups)
    _put(block, "moe.route_scale", float(g("moe_router_topk_scaling_factor") or 1.0))
    # the aux-loss-free bias: its rate when enabled, else a bias that never moves
    gamma = float(g("moe_router_bias_update_rate")) if g("moe_router_enable_expert_bias") else 0.0
    _put(block, "moe.bias_update_speed", gamma)
    _put(block, "moe.bias_update_schedule", [])
    kind = _norm("moe_router_load_balancing_type", g("moe_router_load_balancing_type"), L)
    alpha = float(_norm("moe_aux_loss_coeff", g("moe_aux_loss_coeff"), L) or 0.0)
    if alpha > 0 and kind != "seq_aux_loss":
        raise ConfigError(
            f"--moe-router-load-balancing-type {kind}: DeepSeek-V3 balances with the sequence-wise loss "
            "(seq_aux_loss) and the bias; the plugin's router has no other"
        )
    _put(block, "moe.seq_aux_alpha", alpha)
    depth = g("mtp_num_layers") or 0
    _put(block, "mtp.depth", depth)
    _put(block, "mtp.loss_weight", float(g("mtp_loss_scaling_factor")))
    _put(block, "mtp.loss_weight_schedule", [])
    par = {"ep": g("expert_model_parallel_size") or 1, "pp": g("pipeline_model_parallel_size") or 1}
    block["parallel"] = par
    # a node = the ranks the launcher starts per host (torchrun's LOCAL_WORLD_SIZE); node-limited routing counts them
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    _put(block, "moe.ranks_per_node", math.gcd(par["ep"], per_host) if per_host else par["ep"])
    m, e = block["model"], block["moe"]
    notes = [
        f"no --dsv3-config: the model from {FLAGS_SOURCE}: {L} layers ({k} dense, {L - k} MoE), hidden "
        f"{m['hidden_size']}, {e['n_routed_experts']} routed experts top-{e['top_k']} in {groups} groups "
        f"(≤ {e['topk_group']} per token; EP nodes of {e['ranks_per_node']} ranks), {e['n_shared_experts']} shared, "
        f"MTP depth {depth}, "
        f"vocabulary {vocab_size} rows"
    ]
    return block, notes


# dsv3 keys -> the flag a user would change (messages about a derived block name flags, not JSON keys)
_KEY_FLAGS = {key: dest for dest, key in _SAME_BACKWARDS.items()} | {
    "model.intermediate_size": "ffn_hidden_size",
    "model.max_position_embeddings": "max_position_embeddings",
    "model.first_k_dense_replace": "moe_layer_freq",
    "model.rope_scaling": "rotary_scaling_factor",
    "moe.intermediate_size": "moe_ffn_hidden_size",
    "moe.n_shared_experts": "moe_shared_expert_intermediate_size",
    "moe.n_group": "moe_router_num_groups",
    "moe.topk_group": "moe_router_group_topk",
    "moe.route_scale": "moe_router_topk_scaling_factor",
    "moe.bias_update_speed": "moe_router_bias_update_rate",
    "moe.seq_aux_alpha": "moe_aux_loss_coeff",
    "mtp.depth": "mtp_num_layers",
    "mtp.loss_weight": "mtp_loss_scaling_factor",
    "parallel.ep": "expert_model_parallel_size",
    "parallel.pp": "pipeline_model_parallel_size",
}


def flag_names_of_keys(parser) -> dict[str, str]:
    """ "sec.key" of the dsv3 block -> the Megatron flag it is derived from (for messages)."""
    return {key: flag_name(parser, dest) for key, dest in _KEY_FLAGS.items()}


def flags_config(block: dict, parser) -> DSv3Config:
    """The `DSv3Config` of a derived block (`config.config_from_block`: validated once); a value out of range is
    reported under the flag it came from.

    Raises:
        ConfigError: `--flag (dsv3.key): why`.
    """
    try:
        return config_from_block(block)
    except ConfigError as e:
        msg = str(e)
        for key in sorted(_KEY_FLAGS, key=len, reverse=True):
            if msg.startswith(f"dsv3.{key}"):
                raise ConfigError(f"{flag_name(parser, _KEY_FLAGS[key])} ({msg})") from None
        raise ConfigError(f"{FLAGS_SOURCE}: {msg}") from None


def derived_vocab_size(args) -> int:
    """Embedding rows of a model derived from the flags: the checkpoint's `vocab_size` with `--dsv3-init-from`
    (released checkpoints have more rows than tokenizer entries), else the vocabulary Megatron pads from its
    tokenizer (`--make-vocab-size-divisible-by`; the tokenizer is built here, on a copy of `args`)."""
    init = getattr(args, "dsv3_init_from", None)
    if init and os.path.isdir(init):
        kind = init_source_kind(init)
        if kind == "released":
            return pretrained_config(init).model.vocab_size
        if kind:
            path = os.path.join(init, "config.json")
            return model_config(load_json(path, what="config.json"), path).model.vocab_size
    # (no usable --dsv3-init-from: check_weight_sources names what is wrong with it after parsing)
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer, vocab_size_with_padding

    probe = copy.copy(args)
    probe.padded_vocab_size = None
    return vocab_size_with_padding(build_tokenizer(probe).vocab_size, probe, logging_enabled=False)
