"""Fine-tuning in `python -m dsv3_plugin.megatron.pretrain_gpt`: where the first weights come from, the vocabulary
rule of released checkpoints, and Megatron-LM settings whose absence would crash or silently start from random.

Public API: `add_finetune_args`, `check_weight_sources`, `init_source_kind`, `has_megatron_checkpoint`,
`model_vocab_size`, `default_eval_interval`, `load_initial_weights`, `DEFAULT_EVAL_INTERVAL`.

Design notes: docs/design_notes.md#megatron-finetune
"""

from __future__ import annotations

import os

from dsv3_plugin.checkpoint.convert import LAYOUT_NAME
from dsv3_plugin.checkpoint.hf import model_config, pretrained_config
from dsv3_plugin.checkpoint.integrity import load_json
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.megatron.weights import load_hf_checkpoint, load_megatron_checkpoint

__all__ = [
    "DEFAULT_EVAL_INTERVAL",
    "add_finetune_args",
    "check_weight_sources",
    "default_eval_interval",
    "has_megatron_checkpoint",
    "init_source_kind",
    "load_initial_weights",
    "model_vocab_size",
]

DEFAULT_EVAL_INTERVAL = 1000  # Megatron-LM's default for years (arguments.py, before core 0.19 made it None)
TRACKER = "latest_checkpointed_iteration.txt"  # what Megatron's load_checkpoint looks for

# Keys of the released config.json's model that shape the weights or change what they compute.
_MODEL_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "first_k_dense_replace",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_interleave",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_MOE_KEYS = (
    "n_routed_experts",
    "n_shared_experts",
    "intermediate_size",
    "top_k",
    "n_group",
    "topk_group",
    "route_scale",
    "score_func",
    "norm_topk_prob",
)


def add_finetune_args(parser):
    """Adds `--dsv3-init-from DIR` to Megatron-LM's parser (an `extra_args_provider` step). Returns the parser."""
    parser.add_argument(
        "--dsv3-init-from",
        type=str,
        default=None,
        help="start from the weights of a released-format checkpoint directory (config.json + safetensors; FP8 "
        "dequantized on load) or of `dsv3 convert --to megatron` output; each rank reads only its own layers and "
        "experts. Its config.json must match --dsv3-config. With --load holding a Megatron checkpoint, the run "
        "resumes from --load instead",
    )
    return parser


def has_megatron_checkpoint(path: str | None, ckpt_step: int | None = None) -> bool:
    """Whether `path` holds what Megatron's `load_checkpoint` loads: its tracker file, or with `--ckpt-step N`
    the directory `iter_NNNNNNN` (Megatron's naming, 7 digits)."""
    if not path:
        return False
    if ckpt_step:
        return os.path.isdir(os.path.join(path, f"iter_{int(ckpt_step):07d}"))
    return os.path.isfile(os.path.join(path, TRACKER))


def init_source_kind(path: str) -> str:
    """'megatron-layout' (`dsv3 convert --to megatron` output), 'released' (config.json + safetensors) or ''."""
    if os.path.isfile(os.path.join(path, LAYOUT_NAME)):
        return "megatron-layout"
    if os.path.isfile(os.path.join(path, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(path)):
        return "released"
    return ""


def _not_a_megatron_checkpoint(flag: str, path: str, ckpt_step) -> ConfigError:
    what = f"iter_{int(ckpt_step):07d}/" if ckpt_step else TRACKER
    kind = init_source_kind(path) if os.path.isdir(path) else ""
    if kind:
        shown = "`dsv3 convert --to megatron` output" if kind == "megatron-layout" else "a released-format checkpoint"
        return ConfigError(
            f"{flag} {path}: {shown}, not a Megatron training checkpoint (no {what}); start from its weights with "
            f"--dsv3-init-from {path}"
        )
    state = "does not exist" if not os.path.exists(path) else f"holds no Megatron checkpoint (no {what})"
    return ConfigError(
        f"{flag} {path}: {state}; Megatron would train from random weights. Drop {flag} for a fresh start, or "
        "start from released weights with --dsv3-init-from DIR"
    )


def check_weight_sources(args, cfg: DSv3Config, where: str, key_flags: dict | None = None) -> list[str]:
    """Refuse `--load` / `--pretrained-checkpoint` / `--dsv3-init-from` combinations that would not load what the
    user named; check the init checkpoint's config.json against `cfg` (from `where`). Returns notes to print.

    Raises:
        ConfigError: naming the flag, the directory and (for a config mismatch) the key and both values.
        CheckpointError: the init checkpoint's files are malformed (names the file)."""
    notes = []
    init = getattr(args, "dsv3_init_from", None)
    load, pretrained = getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None)
    step = getattr(args, "ckpt_step", None)
    if init and pretrained:
        raise ConfigError(
            f"--dsv3-init-from {init} and --pretrained-checkpoint {pretrained}: both give the starting weights; "
            "pass one"
        )
    lora = getattr(args, "dsv3_lora", None) is not None  # LoRA: the base from --dsv3-init-from, adapters from --load
    if init and load and not lora and os.path.abspath(load) != os.path.abspath(getattr(args, "save", None) or ""):
        raise ConfigError(
            f"--dsv3-init-from {init} and --load {load}: both give the starting weights; pass one (or make --load "
            "the --save directory: the first start reads --dsv3-init-from, a restart resumes from --save)"
        )
    if pretrained and not has_megatron_checkpoint(pretrained):
        raise _not_a_megatron_checkpoint("--pretrained-checkpoint", pretrained, None)
    resumes = has_megatron_checkpoint(load, step)
    if load and not resumes:
        fresh = not os.path.exists(load) or (os.path.isdir(load) and not os.listdir(load))
        restart_safe = fresh and (init or pretrained or os.path.abspath(load) == os.path.abspath(args.save or ""))
        if not restart_safe or step:
            raise _not_a_megatron_checkpoint("--load", load, step)
        if init or pretrained:  # (--load = --save alone is Megatron-LM's auto-resume idiom: a fresh start is meant)
            notes.append(f"--load {load}: no checkpoint there yet; this run starts from {init or pretrained}")
    if init:
        if not os.path.isdir(init):
            raise ConfigError(f"--dsv3-init-from {init}: not a directory")
        kind = init_source_kind(init)
        if not kind:
            raise ConfigError(
                f"--dsv3-init-from {init}: neither a released-format checkpoint (config.json + *.safetensors) "
                f"nor `dsv3 convert --to megatron` output ({LAYOUT_NAME})"
            )
        _check_same_model(init, kind, cfg, where, key_flags)
        if resumes and lora:
            notes.append(f"--dsv3-init-from {init}: the frozen base ({kind}); the adapters resume from --load {load}")
        elif resumes:
            notes.append(f"--dsv3-init-from {init}: not read, the run resumes from the checkpoint in --load {load}")
        else:
            notes.append(f"initial weights: --dsv3-init-from {init} ({kind}; each rank reads its own part)")
    return notes


def _check_same_model(init: str, kind: str, cfg: DSv3Config, where: str, key_flags: dict | None = None) -> None:
    """`key_flags` ("sec.key" -> flag): the block was derived from Megatron's flags; name the flag instead."""
    if kind == "released":
        theirs = pretrained_config(init)  # config.json, index, headers, tensor set: CheckpointError naming the file
    else:
        path = os.path.join(init, "config.json")
        if not os.path.lexists(path):  # (a FIFO or a link out is there: load_json names what it is)
            raise CheckpointError(f"{path}: missing (a `dsv3 convert --to megatron` directory carries config.json)")
        theirs = model_config(load_json(path, what="config.json"), path)
    ours_d, theirs_d = cfg.to_dict(), theirs.to_dict()
    keys = [("model", k) for k in _MODEL_KEYS] + [("moe", k) for k in _MOE_KEYS] + [("mtp", "depth")]
    for sec, k in keys:
        a, b = ours_d[sec].get(k), theirs_d[sec].get(k)
        if a != b and key_flags is not None:
            flag = key_flags.get(f"{sec}.{k}", f"the flag behind dsv3.{sec}.{k}")
            raise ConfigError(
                f"--dsv3-init-from {init}: its config.json gives dsv3.{sec}.{k} = {b!r} but {flag} gives {a!r}; "
                "the weights would not fit (make the Megatron flags describe the checkpoint's model)"
            )
        if a != b:
            raise ConfigError(
                f"--dsv3-init-from {init}: its config.json gives dsv3.{sec}.{k} = {b!r} but --dsv3-config {where} "
                f"has {a!r}; the weights would not fit (make the dsv3 block describe the checkpoint's model)"
            )


def model_vocab_size(args, cfg: DSv3Config, tokenizer_vocab: int, where: str) -> int:
    """Embedding/output rows for the model. With `--dsv3-init-from`: the checkpoint's, `dsv3.model.vocab_size`
    (released checkpoints have more rows than their tokenizers have entries). From scratch: Megatron's padded
    vocabulary (`args.padded_vocab_size`, e.g. `--make-vocab-size-divisible-by`), or the block's `vocab_size` when
    that is larger (a tokenizer smaller than the model). A tokenizer with more entries than `vocab_size` is a
    ConfigError naming it, except Megatron's NullTokenizer from scratch (its end-of-document id may lie past
    `--vocab-size`; Megatron's padding covers it)."""
    V = cfg.model.vocab_size
    init = getattr(args, "dsv3_init_from", None)
    null = getattr(args, "tokenizer_type", None) == "NullTokenizer"
    if tokenizer_vocab > V and not (null and not init):
        src = (
            f"--tokenizer-model {args.tokenizer_model}"
            if getattr(args, "tokenizer_model", None)
            else f"--tokenizer-type {args.tokenizer_type}"
        )
        rows = f"--dsv3-init-from {init} has" if init else f"{where} dsv3.model.vocab_size ="
        raise ConfigError(
            f"{src}: the tokenizer has {tokenizer_vocab} entries but {rows} {V} embedding rows: ids "
            f"{V}..{tokenizer_vocab - 1} have no row (a tokenizer may be smaller than the model, not larger)"
        )
    return V if init else max(args.padded_vocab_size, V)


def default_eval_interval(args, explicit: set[str]) -> list[str]:
    """Sets `--eval-interval` to `DEFAULT_EVAL_INTERVAL` when absent (megatron-core 0.19's None crashes its
    sample count with a TypeError). Returns the note to print."""
    if getattr(args, "eval_interval", 0) is not None or "eval_interval" in explicit:
        return []
    args.eval_interval = DEFAULT_EVAL_INTERVAL
    return [f"--eval-interval {DEFAULT_EVAL_INTERVAL} (Megatron-LM's default; not given)"]


def load_initial_weights(model, args) -> bool:
    """Fill this rank's `model` (a GPTModel chunk just built) from `--dsv3-init-from`, unless the run resumes from
    a Megatron checkpoint in `--load` (under LoRA the base always comes from `--dsv3-init-from`: `--load` holds the
    adapters). Returns whether weights were loaded."""
    init = getattr(args, "dsv3_init_from", None)
    resumes = has_megatron_checkpoint(getattr(args, "load", None), getattr(args, "ckpt_step", None))
    if not init or (resumes and getattr(args, "dsv3_lora", None) is None):
        return False
    if init_source_kind(init) == "megatron-layout":
        load_megatron_checkpoint(model, init)
    else:
        load_hf_checkpoint(model, init)
    return True
