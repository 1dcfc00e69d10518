"""`dsv3 generate --model DIR --prompt-ids 1,2,3 --max-new-tokens N [--speculative mtp]`: greedy decoding."""

from __future__ import annotations

import json

from dsv3_plugin.checkpoint.hf import load_pretrained
from dsv3_plugin.config import ConfigError
from dsv3_plugin.model.generate import greedy_generate

__all__ = ["register", "run"]


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="greedy decoding from a released-format checkpoint (optionally MTP-speculative)",
        description="Greedy decoding; --speculative mtp drafts with the MTP module and verifies "
        "with the main model (identical output). See docs/checkpoints.md.",
    )
    p.add_argument("--model", required=True, help="released-format checkpoint directory (FP8, BF16 or FP32)")
    p.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument(
        "--speculative", choices=["mtp"], default=None, help="self-speculative decoding with the depth-1 MTP module"
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="load NaN/Inf weights and scales instead of refusing them with exit 2 (for inspection)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected comma-separated integers (got {args.prompt_ids!r})") from None
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: must be >= 1 (got {args.max_new_tokens})")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_pretrained(
        args.model,
        dtype=torch.float32 if args.dtype == "fp32" else torch.bfloat16,
        device=device,
        allow_non_finite=args.allow_non_finite,
    )
    try:
        res = greedy_generate(model, prompt, args.max_new_tokens, speculative=args.speculative)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    d = {"prompt_ids": prompt, **res.to_dict(), "speculative": args.speculative}
    if args.json:
        print(json.dumps(d))
    else:
        print("tokens:", ",".join(map(str, res.tokens)))
        print(f"forward passes: {res.forward_passes}  tokens per forward pass: {res.tokens_per_forward:.3f}")
        if args.speculative:
            rate = res.acceptance_rate
            print(
                f"MTP acceptance rate: {rate:.3f} ({res.accepted}/{res.drafts} drafts)"
                if rate is not None
                else "MTP acceptance rate: n/a (no drafts)"
            )
    return 0
