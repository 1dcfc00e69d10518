"""Pipeline schedules on 4 gloo ranks: wall time and per-rank idle fraction of 1F1B vs DualPipeV vs DualPipe.

The same model (`--blocks` compute-bound MLP blocks, weight grads deferrable) is cut into 4 stages for 1F1B
and DualPipe (DualPipe holds each stage twice, mirror pairs synchronised) and into 8 half-size stages for
DualPipeV, and each schedule runs the same micro-batches. A rank's idle fraction is 1 - (time inside stage
compute) / (step wall time), where P2P waits count as idle. `ratio` is 1F1B's wall time over DualPipeV's
(> 1: DualPipeV faster); `idle_ratio` is 1F1B's mean idle fraction over DualPipeV's. `simulated_idle_fraction`
is what the simulator predicts for the same schedule, micro-batch count and the unit cell F=1, B=2, W=1
(F&B = F+B: the CPU runtime does not overlap), for comparison.
"""
from __future__ import annotations

import statistics

import torch
from torch import nn
from dsv3_plugin.bench import positive_int
from dsv3_plugin.parallel.pipeline.weight_grad import DeferrableLinear
from dsv3_plugin.parallel.distributed import init_distributed
from dsv3_plugin.parallel.pipeline import SCHEDULES, PipelineRuntime
from dsv3_plugin.parallel.distributed import spawn
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.simulate import Durations, simulate

RANKS = 4


def add_arguments(p):
    p.add_argument("--hidden", type=positive_int, default=256)
    p.add_argument("--tokens", type=positive_int, default=256, help="tokens per micro-batch")
    p.add_argument("--blocks", type=positive_int, default=8, help="MLP blocks in the whole model (multiple of 8)")
    p.add_argument("--chunks", type=positive_int, default=8, help="micro-batches per step (>= 8 for DualPipe(V) on 4 ranks)")
    p.add_argument("--steps", type=positive_int, default=4, help="measured steps per schedule (after one warm-up)")


class _Block(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up = DeferrableLinear(h, 4 * h, bias=False)
        self.down = DeferrableLinear(4 * h, h, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def _stages(n_stages: int, blocks: int, h: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    per = blocks // n_stages
    return [nn.Sequential(*[_Block(h) for _ in range(per)]) for _ in range(n_stages)]


def _criterion(out, y):
    return ((out - y) ** 2).mean()


def _rank_main(args_d: dict) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    r, world = init_distributed("gloo")
    h, T, C, blocks, steps = args_d["hidden"], args_d["tokens"], args_d["chunks"], args_d["blocks"], args_d["steps"]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(C, T, h, generator=g)
    y = torch.randn(C, T, h, generator=g)
    runtimes = {}
    for name in ("1f1b", "dualpipev", "dualpipe"):
        t = SCHEDULES[name]
        st = _stages(t.n_stages(RANKS), blocks, h)
        runtimes[name] = PipelineRuntime([st[i] for i in t.stage_ids(RANKS, r)], schedule=name)
    samples = {name: ([], []) for name in runtimes}
    # Rounds interleave the schedules so that load drift on a shared machine hits all of them alike.
    for i in range(steps + 1):
        for name, rt in runtimes.items():
            dist.barrier()
            rt.step(x, num_chunks=C, criterion=_criterion, labels=(y,))
            for m in rt.modules:
                m.zero_grad(set_to_none=True)
            if i:
                samples[name][0].append(rt.last_step["wall_s"])
                samples[name][1].append(rt.last_step["compute_s"])
    out = {name: {"wall_s": statistics.median(w), "compute_s": statistics.median(c)}
           for name, (w, c) in samples.items()}
    return out


def run(args) -> dict:
    import sys
    bad = None
    if args.blocks < 2 * RANKS or args.blocks % (2 * RANKS):
        bad = f"--blocks must be a positive multiple of {2 * RANKS} (got {args.blocks})"
    elif args.chunks < 2 * RANKS or args.chunks % 2:
        bad = f"--chunks must be even and >= {2 * RANKS} for DualPipe(V) on {RANKS} ranks (got {args.chunks})"
    elif min(args.hidden, args.tokens, args.steps) < 1:
        bad = "--hidden, --tokens and --steps must be >= 1"
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        raise SystemExit(2)
    a = {k: getattr(args, k) for k in ("hidden", "tokens", "blocks", "chunks", "steps")}
    per_rank = spawn(_rank_main, RANKS, a, timeout_s=1800)
    res: dict = {"ranks": RANKS, **a}
    for name in ("1f1b", "dualpipe", "dualpipev"):
        wall = max(pr[name]["wall_s"] for pr in per_rank)
        idle = [max(0.0, 1.0 - pr[name]["compute_s"] / wall) for pr in per_rank]
        res[name] = {"wall_s": wall, "idle_fraction": idle, "idle_fraction_mean": sum(idle) / len(idle)}
    for name in ("1f1b", "dualpipe", "dualpipev"):
        sim = simulate(build_schedule(name, RANKS, args.chunks), Durations(1.0, 2.0, 1.0))
        res[name]["simulated_idle_fraction"] = [i / sim.makespan for i in sim.idle]
    res["ratio"] = res["1f1b"]["wall_s"] / res["dualpipev"]["wall_s"]
    res["idle_ratio"] = res["1f1b"]["idle_fraction_mean"] / max(res["dualpipev"]["idle_fraction_mean"], 1e-9)
    return res
