"""Train the tiny model with MTP (D = 1, λ = 0.3) on the synthetic Markov task with a plain torch loop, save it
as a released-format FP8 checkpoint, then decode greedily with and without MTP speculative decoding and
report the MTP acceptance rate against chance (1/vocab).

    PYTHONPATH=. OMP_NUM_THREADS=2 python examples/mtp_speculative/train_and_decode.py [--steps 300] [--out DIR]

Prints one JSON object: acceptance rate, tokens per forward pass, chance level, losses, and whether the
speculative output equals plain greedy decoding. Takes ~1-2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts to decode")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default=None, help="keep the FP8 checkpoint here (default: a temp dir, removed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from tqdm import tqdm

    from dsv3_plugin.checkpoint.hf import load_pretrained, native_state_to_hf
    from dsv3_plugin.checkpoint.synthetic import quantize_checkpoint
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.data.synthetic import MarkovData
    from dsv3_plugin.model.generate import greedy_generate
    from dsv3_plugin.model.moe.balancing import update_expert_bias
    from dsv3_plugin.training.transforms import build_model

    torch.manual_seed(args.seed)
    cfg = DSv3Config.from_block({"preset": "tiny", "train": {"seq_len": args.seq_len}})
    model = build_model(cfg)
    model.reset_parameters(seed=args.seed)
    data = MarkovData(cfg.model.vocab_size, args.seq_len, seed=args.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    first = last = None
    for step in tqdm(range(args.steps), desc="train (MTP)", file=sys.stderr):
        ids, labels = data.batch(step, 0, 0, args.batch)
        out = model(ids, labels=labels, tokens_seen=step * ids.numel())
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        update_expert_bias(model, cfg.moe.gamma(step * ids.numel()))
        rec = {"lm_loss": float(out.lm_loss), "mtp_loss": float(out.mtp_loss)}
        first = first or rec
        last = rec

    tmp = tempfile.TemporaryDirectory(prefix="dsv3-mtp-")
    path = args.out or os.path.join(tmp.name, "fp8")
    hf_tensors = {k: v.detach().float() for k, v in native_state_to_hf(model.state_dict(), cfg).items()}
    quantize_checkpoint(hf_tensors, path, cfg.to_hf())
    fp8 = load_pretrained(path).eval()

    prompts = [data.batch(10_000 + i, 0, 0, 1)[0][0, :8].tolist() for i in range(args.prompts)]
    acc = drafts = fwd_spec = fwd_plain = ntok = 0
    identical = True
    for p in prompts:
        plain = greedy_generate(fp8, p, args.new_tokens)
        spec = greedy_generate(fp8, p, args.new_tokens, speculative="mtp")
        identical &= plain.tokens == spec.tokens
        acc, drafts = acc + spec.accepted, drafts + spec.drafts
        fwd_spec, fwd_plain, ntok = (
            fwd_spec + spec.forward_passes,
            fwd_plain + plain.forward_passes,
            ntok + len(spec.tokens),
        )
    # Acceptance on held-out *data* prefixes (not only on greedy continuations): how often the MTP head's
    # guess for token i+2 equals the main model's greedy choice there, given the true token i+1.
    with torch.no_grad():
        ids, _ = data.batch(20_000, 0, 0, 16)
        out = fp8(ids)
        agree = (out.mtp_logits[0][:, :-1].argmax(-1) == out.logits[:, 1:-1].argmax(-1)).float().mean()
    print(
        json.dumps(
            {
                "steps": args.steps,
                "first_losses": first,
                "last_losses": last,
                "entropy_rate_nats": data.entropy_rate,
                "checkpoint": "FP8 released format (128x128 blocks)" + (f" at {path}" if args.out else ""),
                "acceptance_rate": acc / max(1, drafts),
                "drafts": drafts,
                "acceptance_on_data_prefixes": float(agree),
                "chance_acceptance": 1.0 / cfg.model.vocab_size,
                "tokens_per_forward_speculative": ntok / fwd_spec,
                "tokens_per_forward_plain": ntok / fwd_plain,
                "speculative_equals_plain_greedy": identical,
            }
        )
    )
    tmp.cleanup()
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
