"""`dsv3 export SRC DST --to hf-bf16|hf|peft [--tag TAG] [--tokenizer DIR] [--config FILE] [--base DIR]
[--no-progress]`: a `dsv3 train` run (or a Megatron-LM / Megatron-layout checkpoint) to the released format, or a
LoRA run's adapters merged into its base or as a PEFT adapter directory (`checkpoint.export`)."""

from __future__ import annotations

import json
import sys

from dsv3_plugin.checkpoint.export import EXPORT_TARGETS, export

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a dsv3 train run (or a Megatron-layout checkpoint) to the released HF format, BF16 or FP8",
        description="Streaming, atomic export of the weights a run trains (its latest complete checkpoint, any "
        "pp x ep x dp layout; FP32 master weights for BF16/FP8 runs) to DeepSeek-V3's released format: "
        "safetensors shards + index, config.json, the MTP layer at index num_hidden_layers, the tokenizer.",
    )
    p.add_argument(
        "src",
        help="a dsv3 train run dir (--out), its ckpt/ or a tag dir; a Megatron-LM --save dir (torch_dist) of "
        "pretrain_gpt; or a Megatron-layout dir (layout.json)",
    )
    p.add_argument("dst", help="output directory (must not exist; written atomically)")
    p.add_argument(
        "--to",
        required=True,
        choices=list(EXPORT_TARGETS),
        help="hf-bf16: BF16 weights; hf: FP8 E4M3 + 128x128 weight_scale_inv where the release has them (a LoRA "
        "run: its base merged with the adapters); peft: a LoRA run's adapters as a PEFT adapter directory",
    )
    p.add_argument(
        "--tag",
        help="checkpoint tag of the run (default: 'latest' if complete, else the newest complete); for a Megatron-LM "
        "checkpoint the iteration (default: latest_checkpointed_iteration.txt's)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="Megatron-LM checkpoint only (required there): the --dsv3-config JSON it was trained with, or the "
        "released config.json it started from",
    )
    p.add_argument(
        "--base",
        metavar="DIR",
        help="LoRA run only: its released base directory (default: the --init-from directory the run recorded); "
        "refused unless its fingerprint is the one the adapters were trained on",
    )
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory to ship (default: RUN/tokenizer/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args) -> int:
    out = export(
        args.src,
        args.dst,
        args.to,
        tag=args.tag,
        tokenizer=args.tokenizer,
        progress=not args.no_progress,
        config=args.config,
        base=args.base,
    )
    for note in out["notes"]:
        print(f"dsv3 export: {note}", file=sys.stderr)
    print(json.dumps(out))
    return 0
