"""Building a Megatron-Core `GPTModel` for a `DSv3Config`, and reading its logits (main and MTP heads).

`build_gpt_model(cfg)` is the Python entry point; `gpt_builder(args, pre_process, post_process, ...)` has the
signature of Megatron-LM's `gpt_builders.gpt_builder`: `python -m dsv3_plugin.megatron.pretrain_gpt` (megatron-core
>= 0.19) builds its model with it, and `patches/pretrain_gpt.diff` swaps it into Megatron-LM 0.16's
`pretrain_gpt.py` when `--dsv3-config ds.json` is given. Megatron-LM's parallel/precision flags are kept, the model
shape comes from the dsv3 config (a contradicting shape flag is an error naming it), the layers from `--spec`,
the vocabulary is Megatron's padded one.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.megatron.config import (
    DSv3TransformerConfig,
    config_source,
    follow_schedules,
    run_config,
    to_transformer_config,
)
from dsv3_plugin.megatron.dualpipev import DualPipeVLayout, stage_ends, stage_layer_counts, tie_embedding_copy
from dsv3_plugin.megatron.spec import get_layer_spec, get_mtp_block_spec, have_te

__all__ = [
    "build_gpt_model",
    "gpt_builder",
    "selected_layer_spec",
    "transformer_config_from_args",
    "megatron_base_config",
    "forward_logits",
    "causal_inputs",
    "add_dsv3_args",
    "select_builder",
    "check_megatron_version",
    "TESTED_MEGATRON_LM",
    "dualpipev_selected",
    "dualpipev_layout",
]


def build_gpt_model(
    cfg: DSv3Config | DSv3TransformerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    use_te: bool | None = None,
    vp_stage: int | None = None,
    pg_collection=None,
    layer_spec=None,
    vocab_size: int | None = None,
    **overrides: Any,
):
    """A `GPTModel` with MLA + our FFNs (+ Megatron's MTP block around our layer) for `cfg` (a `DSv3Config`, or the
    Megatron config `to_transformer_config` made of one; `overrides` go to `to_transformer_config`).

    `layer_spec`: the decoder layer (or block) spec, default ours (`get_layer_spec(use_te)`); the MTP layers use
    the same layer. `vocab_size`: the embedding/output rows, default the config's; Megatron-LM passes its padded
    vocabulary (>= the config's). Megatron's model-parallel state must be initialized."""
    from megatron.core.models.gpt import GPTModel

    config = cfg if isinstance(cfg, DSv3TransformerConfig) else to_transformer_config(cfg, **overrides)
    m = config.dsv3_config.model
    if vocab_size is not None and vocab_size < m.vocab_size:
        raise ConfigError(
            f"megatron vocabulary {vocab_size} is smaller than dsv3.model.vocab_size "
            f"{m.vocab_size}; the tokenizer must cover the model's vocabulary"
        )
    spec = get_layer_spec(use_te) if layer_spec is None else layer_spec
    mtp_layer = spec.layer_specs[-1] if hasattr(spec, "layer_specs") else spec
    mtp_spec = get_mtp_block_spec(config, use_te, layer_spec=mtp_layer) if post_process else None
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size or m.vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=m.tie_word_embeddings,
        position_embedding_type="none",  # MLA applies its own (YaRN) RoPE inside attention
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


# Megatron-LM flags that fix the model shape: they must agree with the dsv3 config (or be left unset).
_ARG_CHECKS = {
    "num_layers": lambda c: c.model.num_hidden_layers,
    "hidden_size": lambda c: c.model.hidden_size,
    "ffn_hidden_size": lambda c: c.model.intermediate_size,
    "num_attention_heads": lambda c: c.model.num_attention_heads,
    "num_experts": lambda c: c.moe.n_routed_experts,
    "moe_router_topk": lambda c: c.moe.top_k,
    "mtp_num_layers": lambda c: c.mtp.depth or None,
}
# Megatron-LM config fields kept from its own flags (parallelism, precision, recompute, ...).
_KEEP = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "fp16",
    "bf16",
    "params_dtype",
    "pipeline_dtype",
    "autocast_dtype",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
    "distribute_saved_activations",
    "timers",
    "barrier_with_L1_time",
    "deterministic_mode",
    "gradient_accumulation_fusion",
    "async_tensor_model_parallel_allreduce",
    "use_cpu_initialization",
    "perform_initialization",
    "calculate_per_token_loss",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "variable_seq_lengths",
    "moe_token_dispatcher_type",
    "moe_router_force_load_balancing",
    "fp8",
    "fp8_recipe",
    "fp8_param",
    "first_last_layers_bf16",
)


def dualpipev_selected(args) -> bool:
    """The run lays the model out as two chunks per rank, ours: DualPipeV's V or DualPipe's two mirrored copies
    (`--dsv3-pipeline-schedule dualpipev` / `dualpipe`, pipeline size > 1)."""
    return (
        getattr(args, "dsv3_pipeline_schedule", None) in ("dualpipev", "dualpipe")
        and getattr(args, "pipeline_model_parallel_size", 1) > 1
    )


def dualpipev_layout(args, cfg: DSv3Config) -> DualPipeVLayout:
    """The layout for these flags: the V (2P stages) or, for DualPipe, one copy's P stages (`DualPipeLayout`);
    `--decoder-first/last-pipeline-num-layers` fix the first and last stage."""
    schedule = getattr(args, "dsv3_pipeline_schedule", None)
    if schedule == "dualpipe":
        counts = stage_layer_counts(
            cfg.model.num_hidden_layers,
            args.pipeline_model_parallel_size,
            getattr(args, "decoder_first_pipeline_num_layers", None),
            getattr(args, "decoder_last_pipeline_num_layers", None),
            n_stages=args.pipeline_model_parallel_size,  # one copy's stages
            schedule="DualPipe",
        )
        return DualPipeVLayout.for_schedule(schedule, counts, cfg.mtp.depth or None)
    counts = stage_layer_counts(
        cfg.model.num_hidden_layers,
        args.pipeline_model_parallel_size,
        getattr(args, "decoder_first_pipeline_num_layers", None),
        getattr(args, "decoder_last_pipeline_num_layers", None),
    )
    return DualPipeVLayout(counts, cfg.mtp.depth or None)


def transformer_config_from_args(args, base_config=None) -> DSv3TransformerConfig:
    """Megatron-LM `args` (+ the config it built from them) -> our config for the run's `DSv3Config`
    (`config.run_config`); with DualPipeV the config carries the V layout (the first/last-stage layer counts are
    folded into it)."""
    cfg = run_config(args)
    for key, want in _ARG_CHECKS.items():
        got = getattr(args, key, None)
        if got is not None and got != want(cfg):
            raise ConfigError(
                f"--{key.replace('_', '-')}: {got} contradicts {config_source(args)} ({want(cfg)}); "
                "drop the flag or change the dsv3 config"
            )
    keep = {}
    if base_config is not None:
        names = {f.name for f in dataclasses.fields(base_config)}
        keep = {k: getattr(base_config, k) for k in _KEEP if k in names}
    if dualpipev_selected(args):
        for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            keep.pop(k, None)
        keep.update(virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_layout=dualpipev_layout(args, cfg))
    return to_transformer_config(cfg, **keep)


OUR_SPEC = ("dsv3_plugin.megatron", "layer_spec")


def selected_layer_spec(args, config, use_te: bool, vp_stage: int | None = None):
    """The layer spec Megatron-LM's `--spec MODULE NAME` names (ours when absent).

    `--spec dsv3_plugin.megatron layer_spec` is ours for the `--transformer-impl` given. Any other spec is
    imported the way Megatron does it (`import_module`); a callable (not a `ModuleSpec`) is called with the
    config (and `vp_stage` if it takes one), as Megatron-Core 0.19's GPT builder does."""
    spec = getattr(args, "spec", None)
    if not spec or tuple(spec) == OUR_SPEC:
        return get_layer_spec(use_te)
    import inspect

    from megatron.core.transformer.spec_utils import ModuleSpec, import_module

    try:
        obj = import_module(tuple(spec))
    except (ImportError, AttributeError) as e:
        obj, why = None, f" ({e})"
    else:
        why = ""
    if obj is None:  # Megatron's import_module logs the failure and returns None
        raise ConfigError(f"--spec {' '.join(spec)}: cannot import it{why}")
    if callable(obj) and not isinstance(obj, ModuleSpec):
        params = inspect.signature(obj).parameters
        obj = obj(config, vp_stage=vp_stage) if "vp_stage" in params else obj(config)
    return obj


def megatron_base_config(args):
    """Megatron-LM's own transformer config of its flags (`core_transformer_config_from_args`), whose parallel and
    precision fields `transformer_config_from_args` keeps."""
    from megatron.training.arguments import core_transformer_config_from_args

    # NOTE: the dsv3 model applies RoPE unfused whatever --no-rope-fusion says (to_transformer_config sets
    # apply_rope_fusion False; _KEEP does not take it), so Megatron's check that its fused RoPE with MLA needs YaRN
    # (a ValueError with --rope-type rope, e.g. Megatron-LM's flags without a scaling factor) checks nothing that runs
    base_args = copy.copy(args)
    base_args.apply_rope_fusion = False
    if dualpipev_selected(args):
        # the first/last-stage layer counts shape the V (dualpipev_layout), not Megatron's per-rank split,
        # which its config would check against the two virtual chunks
        base_args.decoder_first_pipeline_num_layers = base_args.decoder_last_pipeline_num_layers = None
    return core_transformer_config_from_args(base_args)


def gpt_builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
    """Drop-in for Megatron-LM's `gpt_builders.gpt_builder` (patches/pretrain_gpt.diff) and the model builder of
    `python -m dsv3_plugin.megatron.pretrain_gpt`: the model shape from `--dsv3-config`, the layers from
    `--spec` (ours by default), the vocabulary padded as Megatron pads it (`args.padded_vocab_size`)."""
    if not isinstance(config, DSv3TransformerConfig):
        if config is None:  # Megatron-LM's own config from its flags, for the parallel/precision fields
            config = megatron_base_config(args)
        config = transformer_config_from_args(args, config)
    use_te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if use_te and not have_te():
        raise ConfigError(
            "--transformer-impl transformer_engine: Transformer Engine is not installed (pass --transformer-impl local)"
        )
    spec = selected_layer_spec(args, config, use_te, vp_stage)
    v = dualpipev_selected(args)
    if v:  # Megatron asked for interleaved chunk `vp_stage`; build model stage r or 2P-1-r (V) / P-1-r (DualPipe)
        from megatron.core import parallel_state as ps

        pre_process, post_process = stage_ends(
            ps.get_pipeline_model_parallel_rank(),
            vp_stage,
            args.pipeline_model_parallel_size,
            schedule=args.dsv3_pipeline_schedule,
        )
        _check_v_embedding_group(ps)
    model = build_gpt_model(
        config,
        pre_process=pre_process,
        post_process=post_process,
        use_te=use_te,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        layer_spec=spec,
        vocab_size=getattr(args, "padded_vocab_size", None),
    )
    if v:  # DualPipe: copy B (chunk 1) made equal to copy A and marked as its replica
        tie_embedding_copy(model, pre_process, post_process, vp_stage=vp_stage, schedule=args.dsv3_pipeline_schedule)
    follow_schedules(model, lambda: _megatron_lm_tokens_seen(args))
    return model


def _check_v_embedding_group(ps) -> None:
    """In the V the embedding and its copies are all on pipeline rank 0; Megatron's default embedding group
    (first and last pipeline rank) would pair them with a rank that holds none. DualPipe keeps its copies equal
    itself (`dualpipev.py`), so it needs the same group: rank 0 alone."""
    import torch.distributed as dist

    group = ps.get_embedding_group(check_initialized=False)
    if group is None:
        return
    ranks = dist.get_process_group_ranks(group)
    first = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[0]
    if dist.get_rank() in ranks and ranks != [first]:
        raise ConfigError(
            f"DualPipeV: Megatron's embedding group is ranks {ranks}; in the V it must be pipeline "
            "rank 0 alone (pass get_embedding_ranks=dsv3_plugin.megatron.dualpipev.embedding_ranks "
            "to pretrain() / initialize_model_parallel)"
        )


def _megatron_lm_tokens_seen(args) -> float:
    """Tokens consumed so far in a Megatron-LM run (its `args` is updated by the training loop)."""
    return float(getattr(args, "consumed_train_samples", 0) or 0) * float(getattr(args, "seq_length", 0) or 0)


def causal_inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, T] and the causal `attention_mask` [1, 1, T, T] (True = masked) for `GPTModel`."""
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device).unsqueeze(0).expand(B, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
    return pos, mask


def forward_logits(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(logits [B, T, V], MTP logits: k-th [B, T−k, V], row i predicting token i+k+1) — the layout of our
    `DSv3Output`. Megatron's GPTModel returns MTP logits only through its loss, so this runs it with dummy
    labels and reads the MTP block's hidden states with a forward hook."""
    model_config = model.config
    pos, mask = causal_inputs(input_ids)
    D = model_config.mtp_num_layers or 0
    if not D:
        logits = model(input_ids, pos, mask)
        return logits, []
    captured = {}
    handle = model.mtp.register_forward_hook(lambda mod, inp, out: captured.__setitem__("h", out))
    try:
        model(input_ids, pos, mask, labels=torch.zeros_like(input_ids))
    finally:
        handle.remove()
    chunks = torch.chunk(captured["h"], 1 + D, dim=0)  # [(1+D)·s, b, h] -> 1+D × [s, b, h]
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    outs = []
    for h_SBH in chunks:
        lg, _ = model.output_layer(h_SBH, weight=weight)
        outs.append(lg.transpose(0, 1).contiguous())  # [b, s, V]
    T = input_ids.shape[1]
    return outs[0], [outs[k][:, : T - k] for k in range(1, D + 1)]


# --- Megatron-LM integration (patches/pretrain_gpt.diff calls these) -----------------------------------------

TESTED_MEGATRON_LM = ("0.16.1",)


def check_megatron_version(what: str = "patches/pretrain_gpt.diff") -> str:
    """Refuse an untested megatron-core (set DSV3_ALLOW_UNTESTED_MEGATRON=1 to try anyway)."""
    import os

    from megatron.core.package_info import __version__

    v = __version__.split("+")[0]  # without the "+<git hash>" megatron-core adds inside a git checkout
    if v not in TESTED_MEGATRON_LM and os.environ.get("DSV3_ALLOW_UNTESTED_MEGATRON") != "1":
        raise RuntimeError(
            f"{what}: megatron-core {v} is untested (tested: {', '.join(TESTED_MEGATRON_LM)}); "
            "set DSV3_ALLOW_UNTESTED_MEGATRON=1 to run it anyway"
        )
    return v


def add_dsv3_args(parser, other=None):
    """Megatron-LM `extra_args_provider`: adds `--dsv3-config`; chains `other` (e.g. modelopt's) if given."""
    if other is not None:
        parser = other(parser)
    group = parser.add_argument_group(title="dsv3_plugin")
    group.add_argument(
        "--dsv3-config",
        type=str,
        default=None,
        help='JSON file with a "dsv3" block: the DeepSeek-V3 model (MLA, DeepSeekMoE, MTP) to build; the '
        "model flags are filled from it or must agree with it. Without it (python -m "
        "dsv3_plugin.megatron.pretrain_gpt), the block is derived from Megatron's own model flags",
    )
    return parser


def select_builder(default_builder):
    """The model builder Megatron-LM should use: ours when `--dsv3-config` was given, else `default_builder`."""

    def builder(args, pre_process, post_process, vp_stage=None, config=None, pg_collection=None):
        if getattr(args, "dsv3_config", None):
            check_megatron_version()
            return gpt_builder(
                args, pre_process, post_process, vp_stage=vp_stage, config=config, pg_collection=pg_collection
            )
        return default_builder(
            args, pre_process, post_process, vp_stage=vp_stage, config=config, pg_collection=pg_collection
        )

    return builder
