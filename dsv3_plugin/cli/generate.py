"""`dsv3 generate --model DIR [--adapter DIR] (--prompt TEXT [--chat] | --prompt-ids IDS)`: decoding from a
released-format checkpoint (with LoRA adapters applied unmerged: `checkpoint.adapted_model`), text in and text
out (streamed as it is produced) or token ids in and out.

Text goes through the checkpoint directory's own tokenizer (`data.tokenizer.load_tokenizer`); `--chat` applies
that tokenizer's `chat_template` (never a re-implementation) to one user turn with the generation prompt.
Decoding is `model.generate.generate`: greedy (optionally MTP-speculative) or sampled (`model.sampling`).
Streaming decodes incrementally (`TextStream`), the windowed scheme detokenizers of serving engines use: only
the new text is printed, and text ending in an incomplete UTF-8 character is held back until it completes.

Public API: `register`, `run`, `TextStream`. Design notes: docs/design_notes.md#cli-generate
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import sys

from dsv3_plugin.checkpoint.adapted_model import load_adapted
from dsv3_plugin.checkpoint.hf import load_pretrained, model_config, pretrained_config
from dsv3_plugin.checkpoint.integrity import load_json
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.data.tokenizer import check_vocab_fits, load_tokenizer
from dsv3_plugin.errors import CheckpointError, DataError
from dsv3_plugin.model.generate import generate
from dsv3_plugin.model.sampling import check_sampling
from dsv3_plugin.training.memory_estimate import available_memory_bytes, format_bytes, load_bytes

__all__ = ["TextStream", "register", "run", "check_load_memory"]

_REPLACEMENT = "\ufffd"  # what a byte-level decoder shows for an incomplete UTF-8 sequence


class TextStream:
    """Incremental detokenization: `push(ids)` returns the text the new ids add, `finish()` the rest; the
    pieces joined equal `tokenizer.decode(all ids)` (for byte-level BPE tokenizers such as DeepSeek-V3's).

    Only a window is re-decoded per push: the ids since the last point where the text ended on a whole
    character (`_prefix`), so the cost per token does not grow with the output.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # window start: everything before it is printed and ends on a character boundary
        self._read = 0  # ids up to here are printed

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def push(self, ids: list[int]) -> str:
        """Add generated ids; returns the new printable text ('' while a character is incomplete)."""
        self.ids.extend(ids)
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        if len(text) > len(done) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(done) :]
        return ""

    def finish(self) -> str:
        """The text not yet returned (an incomplete character at the very end comes out as U+FFFD, as in
        `decode`)."""
        done = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return text[len(done) :]


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="text or token ids from a released-format checkpoint: greedy (optionally MTP-speculative) or sampled",
        description="Decode from a released-format checkpoint. --prompt TEXT is tokenized with the checkpoint "
        "directory's tokenizer (--chat: its chat_template, one user turn plus the assistant prompt); the reply "
        "is streamed to stdout as it is produced and stops at the tokenizer's EOS or --max-new-tokens; "
        "statistics go to stderr. With a tokenizer only its len(tokenizer) ids are produced (the embedding's "
        "padding rows beyond it have no text). --prompt-ids IDS: ids in, ids out, the whole vocabulary, no "
        "stop token. Greedy unless --temperature > 0; sampling (temperature, top-p nucleus, --seed) decodes "
        "one token per forward, without MTP speculation. See docs/finetune.md and docs/checkpoints.md.",
    )
    p.add_argument("--model", required=True, help="released-format checkpoint directory (FP8, BF16 or FP32)")
    p.add_argument(
        "--adapter",
        metavar="DIR",
        help="LoRA adapters applied to --model without merging: a PEFT adapter directory (dsv3 export --to peft, or "
        "peft's save_pretrained) or a dsv3 train LoRA run directory (refused unless trained on --model)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, tokenized with the tokenizer files in --model")
    src.add_argument("--prompt-ids", help="comma-separated token ids (no tokenizer used)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="with --prompt: apply the tokenizer's chat_template to [{role: user, content: TEXT}] with "
        "add_generation_prompt",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="the most tokens to generate (default 128); prompt + this must fit in max_position_embeddings",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1] (default 1)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (a torch.Generator): the same seed gives the same output; default: a fresh one, printed",
    )
    p.add_argument(
        "--speculative",
        choices=["mtp"],
        default=None,
        help="self-speculative greedy decoding with the depth-1 MTP module (same output; not with sampling)",
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object (no streaming)")
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="load NaN/Inf weights and scales instead of refusing them with exit 2 (for inspection)",
    )
    p.set_defaults(func=run)


def _check_flags(args) -> None:
    """Flag combinations that have no meaning are refused, not ignored."""
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be >= 1 (got {args.max_new_tokens})")
    if args.chat and args.prompt is None:
        raise ConfigError("--chat: needs --prompt TEXT (the chat template applies to text, not to --prompt-ids)")
    try:
        check_sampling(args.temperature, 1.0 if args.top_p is None else args.top_p)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.temperature == 0:
        for flag, value in (("--top-p", args.top_p), ("--seed", args.seed)):
            if value is not None:
                raise ConfigError(f"{flag}: only applies to sampling (--temperature > 0); temperature 0 is greedy")
    elif args.speculative:
        raise ConfigError("--speculative mtp: greedy decoding only; sampling (--temperature > 0) has no speculation")


def _prompt_from_text(args, tokenizer) -> list[int]:
    """The prompt's ids: the tokenizer on the text (BOS as its post-processor adds it), or its chat template."""
    if not args.chat:
        return list(tokenizer(args.prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{args.model}: --chat needs a chat_template in tokenizer_config.json (the tokenizer has none)")
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding, 4.x a plain list
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def _check_length(args, n_prompt: int, max_pos: int) -> None:
    config = os.path.join(args.model, "config.json")
    if n_prompt > max_pos:
        flag, how = ("--prompt-ids", "") if args.prompt is None else ("--prompt", " after tokenization")
        err = DataError if args.prompt is not None else ConfigError
        raise err(f"{flag}: {n_prompt} tokens{how}, more than max_position_embeddings {max_pos} of {config}")
    if n_prompt + args.max_new_tokens > max_pos:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens}: the prompt's {n_prompt} tokens + {args.max_new_tokens} "
            f"exceed max_position_embeddings {max_pos} of {config} (at most {max_pos - n_prompt} new tokens fit)"
        )


def check_load_memory(cfg: DSv3Config, model_dir: str, dtype_bytes: int, device: str) -> None:
    """Refuse a model that cannot fit before anything is allocated for it.

    Args:
        cfg: the checkpoint's config; model_dir: the directory (for the message).
        dtype_bytes: bytes per element of the compute dtype (--dtype); device: the torch device (--device).

    Raises:
        ConfigError: one line naming --model (host memory: the FP32 build) or --device (the accelerator's free
            memory for the cast model), with the bytes needed and the bytes available.
    """
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ConfigError(f"--device {device}: not a torch device ({e})") from None
    need = load_bytes(cfg, dtype_bytes, on_host=dev.type == "cpu")
    avail = available_memory_bytes()
    if need["host"] > avail:
        raise ConfigError(
            f"--model {model_dir}: loading needs at least {format_bytes(need['host'])} of host memory "
            f"({need['params']:,} parameters, built in FP32 before the weights are read), but only "
            f"{format_bytes(avail)} is available on this host"
        )
    if need["device"] and dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        if need["device"] > free:
            raise ConfigError(
                f"--device {device}: the model needs at least {format_bytes(need['device'])} there "
                f"({need['params']:,} parameters x {dtype_bytes} B), but only {format_bytes(free)} of it is free"
            )


def run(args) -> int:
    import torch

    _check_flags(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    # config.json alone, before the index or any shard is opened: a model that cannot fit is refused first
    early = None
    cfg_path = os.path.join(args.model, "config.json")
    if os.path.isdir(args.model) and os.path.lexists(cfg_path):
        try:
            early = model_config(load_json(cfg_path, what="released config.json"), cfg_path)
        except (CheckpointError, ConfigError):
            pass  # a defective config.json: pretrained_config just below refuses it, worded as every entry point does
    if early is not None:
        check_load_memory(early, args.model, dtype.itemsize, device)
    cfg = pretrained_config(args.model)  # headers only: a bad directory or prompt fails before any weight is read
    if early is None:  # (only if config.json changed in between: the check still comes before any allocation)
        check_load_memory(cfg, args.model, dtype.itemsize, device)
    tokenizer = None
    if args.prompt is None:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"--prompt-ids: expected comma-separated integers (got {args.prompt_ids!r})") from None
    else:
        tokenizer = load_tokenizer(args.model)
        check_vocab_fits(tokenizer, cfg.model.vocab_size, args.model)
        prompt = _prompt_from_text(args, tokenizer)
    _check_length(args, len(prompt), cfg.model.max_position_embeddings)

    load = load_pretrained if args.adapter is None else functools.partial(load_adapted, adapter=args.adapter)
    model = load(args.model, dtype=dtype, device=device, allow_non_finite=args.allow_non_finite)
    sampling = args.temperature > 0
    seed = (args.seed if args.seed is not None else secrets.randbits(63)) if sampling else None
    top_p = 1.0 if args.top_p is None else args.top_p
    generator = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed) if sampling else None
    eos = getattr(tokenizer, "eos_token_id", None)
    stream = TextStream(tokenizer) if tokenizer is not None and not args.json else None

    def show(ids: list[int]) -> None:
        if ids[0] == eos:  # the stop token ends the reply; it is not part of the text
            return
        piece = stream.push(ids)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()

    try:
        res = generate(
            model,
            prompt,
            args.max_new_tokens,
            speculative=args.speculative,
            temperature=args.temperature,
            top_p=top_p,
            generator=generator,
            stop_ids=() if eos is None else (eos,),
            vocab_limit=None if tokenizer is None else len(tokenizer),
            on_tokens=show if stream is not None else None,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    d = {"prompt_ids": prompt, **res.to_dict(), "speculative": args.speculative}
    d.update(temperature=args.temperature, top_p=top_p if sampling else None, seed=seed)
    if tokenizer is not None:
        reply = res.tokens[:-1] if res.stop == "eos" else res.tokens
        d["text"] = tokenizer.decode(reply, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if args.json:
        print(json.dumps(d))
        return 0
    if stream is not None:
        sys.stdout.write(stream.finish() + "\n")
        sys.stdout.flush()
        log = sys.stderr
    else:
        print("tokens:", ",".join(map(str, res.tokens)))
        log = sys.stdout
    print(
        f"{len(res.tokens)} tokens (stop: {res.stop})  forward passes: {res.forward_passes}  "
        f"tokens per forward pass: {res.tokens_per_forward:.3f}",
        file=log,
    )
    if sampling:
        print(f"sampling: temperature {args.temperature}, top-p {top_p}, seed {seed}", file=log)
    if args.speculative:
        rate = res.acceptance_rate
        print(
            f"MTP acceptance rate: {rate:.3f} ({res.accepted}/{res.drafts} drafts)"
            if rate is not None
            else "MTP acceptance rate: n/a (no drafts)",
            file=log,
        )
    return 0
