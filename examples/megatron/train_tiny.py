"""Train a tiny DeepSeek-V3 Megatron-Core GPTModel built from the dsv3_plugin spec, with Megatron's DDP, optimizer
and `finalize_model_grads` (which also applies the aux-loss-free bias update to our routers).

    PYTHONPATH=$PWD python examples/megatron/train_tiny.py --nproc 2 --steps 20
    torchrun --nproc-per-node 2 examples/megatron/train_tiny.py --steps 20      # same, launched externally

CPU (gloo, with patches/megatron_cpu.py applied automatically) or GPU (NCCL, unpatched). Prints one JSON line per
step: step, loss (LM loss; Megatron adds λ·MTP and α·balance through its loss auto-scalers in backward),
maxvio (mean over MoE layers of max load / mean load − 1), bias_update_rate; then the LM loss on a held-out
batch before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def synthetic_batch(step: int, rank: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Learnable synthetic tokens: each sequence counts up by a per-sequence stride (mod vocab)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)[None]) % vocab  # [B, T+1]


def train(args) -> list[dict]:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from dsv3_plugin.config import DSv3Config, load_config
    from dsv3_plugin.megatron.config import apply_schedules
    from dsv3_plugin.megatron.gpt import build_gpt_model, causal_inputs
    from dsv3_plugin.megatron.runtime import init_megatron, shutdown_megatron, wrap_ddp
    from dsv3_plugin.megatron.weights import load_hf_checkpoint
    from dsv3_plugin.model.moe.balancing import maxvio

    rank, world = init_megatron(ep=args.ep, seed=args.seed)
    if args.config.endswith(".json"):
        cfg = load_config(args.config)
    else:
        cfg = DSv3Config.from_block({"preset": args.config})
    model = build_gpt_model(cfg)
    if args.load:
        load_hf_checkpoint(model, args.load)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    ddp = wrap_ddp(model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=False),
        [ddp],
    )
    routers = [m for m in model.modules() if hasattr(m, "expert_bias")]
    seq, bsz = args.seq_len, args.micro_batch

    def held_out_loss() -> float:
        """LM loss on a fixed batch no step trains on (mean over ranks)."""
        data = synthetic_batch(0, 10_000 + rank, bsz, seq, cfg.model.vocab_size).to(device)
        ddp.eval()
        with torch.no_grad():
            val = ddp(data[:, :-1], *causal_inputs(data[:, :-1]), labels=data[:, 1:]).float().mean()
        if world > 1:
            torch.distributed.all_reduce(val)
            val /= world
        return round(float(val), 6)

    eval_before = held_out_loss()
    lines = []
    for step in range(1, args.steps + 1):
        tokens_seen = (step - 1) * seq * bsz * world
        rate, _ = apply_schedules(model.config, tokens_seen)
        ddp.train()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        data = synthetic_batch(step, rank, bsz, seq, cfg.model.vocab_size).to(device)
        ids, labels = data[:, :-1], data[:, 1:]
        pos, mask = causal_inputs(ids)
        loss_BT = ddp(ids, pos, mask, labels=labels)  # per-token LM loss [B, T]
        loss = loss_BT.float().mean()
        loss.backward()
        # Global-batch loads for telemetry (finalize_model_grads all-reduces and zeroes its own copy).
        loads = torch.stack([r.local_tokens_per_expert.detach().clone() for r in routers]) if routers else None
        if loads is not None and world > 1:
            torch.distributed.all_reduce(loads)
        finalize_model_grads([ddp])
        ok, grad_norm, _ = opt.step()
        lm = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(lm)
            lm /= world
        line = {
            "step": step,
            "loss": round(float(lm), 6),
            "grad_norm": float(grad_norm or 0.0),
            "maxvio": (sum(maxvio(l) for l in loads) / len(loads)) if loads is not None else 0.0,
            "bias_update_rate": rate,
        }
        lines.append(line)
        if rank == 0:
            print(json.dumps(line), flush=True)
    summary = {"held_out_loss_before": eval_before, "held_out_loss_after": held_out_loss(), "steps": args.steps}
    lines.append(summary)
    if rank == 0:
        print(json.dumps(summary), flush=True)
    shutdown_megatron()
    return lines


def _worker(args):
    return train(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help='dsv3 preset name or a JSON file with a "dsv3" block')
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ep", type=int, default=1, help="Megatron expert-parallel size")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--load", default=None, help="released-format checkpoint dir to start from")
    p.add_argument("--nproc", type=int, default=None, help="self-spawn N gloo/NCCL ranks (else torchrun env)")
    args = p.parse_args(argv)
    if args.nproc:
        from dsv3_plugin.parallel.distributed import spawn

        spawn(_worker, args.nproc, args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
