"""`dsv3 convert SRC DST --to {hf-bf16,hf,megatron} [--pp N] [--ep N] [--dtype bf16|fp32] [--allow-non-finite]`."""

from __future__ import annotations

import json

from dsv3_plugin.checkpoint.convert import convert
from dsv3_plugin.errors import CheckpointError

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint (FP8/BF16 released format <-> Megatron layout), streaming",
        description="Streaming, atomic checkpoint conversion; see docs/checkpoints.md.",
    )
    p.add_argument("src", help="source directory (released format, FP8 or BF16, or a Megatron-layout directory)")
    p.add_argument("dst", help="output directory (must not exist; written atomically)")
    p.add_argument(
        "--to",
        required=True,
        choices=["hf-bf16", "hf", "megatron"],
        help="hf-bf16: dequantized released format; hf: released format (from a Megatron-layout "
        "source: the exact inverse); megatron: per-(pp, ep)-rank state dicts",
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (--to megatron)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (--to megatron)")
    p.add_argument(
        "--dtype",
        choices=["bf16", "fp32"],
        default=None,
        help="dtype of dequantized FP8 weights; narrower floats are upcast to it (default bf16)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="copy NaN/Inf weights and scales (and FP8 NaN codes, as NaN) through instead of refusing "
        "them with exit 2; for inspecting damaged files",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        out = convert(
            args.src,
            args.dst,
            args.to,
            pp=args.pp,
            ep=args.ep,
            dtype=args.dtype,
            progress=not args.no_progress,
            allow_non_finite=args.allow_non_finite,
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(str(e)) from None
    print(json.dumps(out))
    return 0
