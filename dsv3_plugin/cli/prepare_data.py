"""`dsv3 prepare-data INPUT... --tokenizer DIR --out PREFIX [--chat] [--text-key K] [--workers N] [--max-tokens N]`:
a corpus -> Megatron's indexed dataset (`dsv3_plugin.data.prepare`)."""

from __future__ import annotations

import json
import sys

from dsv3_plugin.config import ConfigError
from dsv3_plugin.data.prepare import prepare

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="tokenize a corpus into Megatron's indexed dataset (PREFIX.bin/.idx; chat: + PREFIX_mask.bin/.idx)",
        description="Tokenize .jsonl / .txt / .parquet / .json / .arrow files (concatenated in order) with a "
        "checkpoint's tokenizer into PREFIX.bin/.idx (megatron-core's IndexedDatasetBuilder, one document per "
        "record). Plain text: BOS + text + EOS. --chat: 'messages' rendered by the tokenizer's chat template, "
        "with PREFIX_mask.bin/.idx (uint8, 1 = training target: the assistant's tokens and end-of-turn token). "
        "Writes PREFIX.json (the summary) and prints it as one JSON line. Bad input: exit 2, nothing written.",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl, .txt (one document), .parquet, .json, .arrow")
    p.add_argument("--tokenizer", required=True, help="tokenizer directory (e.g. the released checkpoint)")
    p.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    p.add_argument("--chat", action="store_true", help="records are conversations: {'messages': [{role, content}]}")
    p.add_argument("--text-key", default="text", help="the text field of plain-text records (default: text)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1: this process)")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="keep at most N tokens of a document (counted as truncated)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers: must be >= 1 (got {args.workers})")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ConfigError(f"--max-tokens: must be >= 1 (got {args.max_tokens})")
    summary = prepare(
        args.inputs,
        args.tokenizer,
        args.out,
        chat=args.chat,
        text_key=args.text_key,
        workers=args.workers,
        max_tokens=args.max_tokens,
        progress=not args.no_progress,
    )
    skipped = summary["skipped"]
    if skipped:
        print(
            "prepare-data: skipped " + ", ".join(f"{n} ({reason})" for reason, n in skipped.items()),
            file=sys.stderr,
        )
    print(json.dumps(summary))
    return 0
