"""The training-loop tax: `dsv3 train`'s tokens/s against the bare model step in one process, same config and batch.

Bare step (`--child bare`): `DSv3Model` + `torch.optim.AdamW`, forward + backward + clipping + optimizer step.
`dsv3 train` (`--child train`, on 1 rank and on 2): the real entry, each rank its own process as torchrun starts it,
with timers around what the loop adds (collectives, the router bias update, routing telemetry, the save).
Reported: `tax_1rank` = bare tokens/s / dsv3 train's (1 rank) − 1, `tax_1rank_steady` against the run summary's
tokens/s, `phases_1rank` (forward, backward, optimizer step on both sides) and the 2-rank run's parts per step.

Design notes (what each side runs, the timers, every reported figure): docs/design_notes.md#bench-train-overhead
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from benchmarks import ROOT, run_child
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.deepspeed import engine as ds_engine
from dsv3_plugin.model.moe import balancing
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.parallel.distributed import free_port
from dsv3_plugin.training.run_dir import RunDir
from dsv3_plugin.training.telemetry import RoutingTelemetry

__all__ = ["train_tax", "ds_json", "install_timers", "TIMED"]

TIMED = ("collectives", "bias_update", "telemetry", "save")  # parts the timers attribute time to
# the step's phases, timed in the bare step and (1 rank) around DeepSpeed's engine calls: what ZeRO-1 adds to
# autograd's backward (gradient hooks copying into its buckets and partition) and to the optimizer step
# (flattening, the gradient norm, copying the partition back into the parameters)
PHASES = ("forward", "backward", "optimizer")
CLIP = 1.0  # gradient clipping of both sides
PATCHES = ("flat_grads", "chunked_step")  # the engine's decisions on its runtime patches of DeepSpeed's optimizer


def ds_json(
    block: dict,
    batch: int,
    seq_len: int,
    steps: int,
    lr: float = 1e-3,
    fused: bool = False,
    flat_grads: bool = True,
    grad_norm: str = "fp64",
    chunked_step: bool = True,
) -> dict:
    """The DeepSpeed JSON of both measurements: micro-batch `batch`, no accumulation, ZeRO-1, torch AdamW at a
    constant `lr` (torch's fused kernel with `fused`, in both), gradient clipping at 1.0 (DeepSeek-V3's, and
    `dsv3 train`'s default; in both), `steps` steps of `seq_len` tokens on synthetic data, one save at the end;
    `flat_grads`: `memory.flat_grads` of `dsv3 train` (false: DeepSpeed's own ZeRO-1 gradient copies); `grad_norm`:
    its `memory.grad_norm` (fp64: DeepSpeed's norm; fp32: FP32 pieces of the flat gradients, as the bare step's
    `clip_grad_norm_`); `chunked_step`: its `memory.chunked_step` (false: DeepSpeed's own optimizer step)."""
    train = {**block.get("train", {}), "seq_len": seq_len, "steps": steps, "seed": 0, "log_every": 1}
    params = {"lr": lr, "weight_decay": 0.0, "torch_adam": True, **({"fused": True} if fused else {})}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": params},
        "dsv3": {
            **block,
            "train": train,
            "memory": {
                **block.get("memory", {}),
                "flat_grads": flat_grads,
                "grad_norm": grad_norm,
                "chunked_step": chunked_step,
            },
        },
    }


# --- children ---------------------------------------------------------------------------------------------------


def _bare(ds: dict, warmup: int) -> dict:
    cfg = DSv3Config.from_block(ds["dsv3"])
    torch.manual_seed(0)
    model = DSv3Model(cfg).train()
    p = ds["optimizer"]["params"]
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=p["lr"], weight_decay=p["weight_decay"], fused=p.get("fused"))
    clip = float(ds.get("gradient_clipping", 0.0))
    B, T, steps = ds["train_micro_batch_size_per_gpu"], cfg.train.seq_len, cfg.train.steps
    g = torch.Generator().manual_seed(0)
    times, phases = [], {k: [] for k in PHASES}
    for _ in range(steps):
        ids = torch.randint(0, cfg.model.vocab_size, (B, T + 1), generator=g)
        t0 = time.perf_counter()
        out = model(ids[:, :-1], labels=ids[:, 1:])
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        times.append(t3 - t0)
        for k, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            phases[k].append(dt)
    step_s = statistics.median(times[warmup:])
    return {
        "step_s": step_s,
        "tokens_per_s": B * T / step_s,
        "phases_s": {k: statistics.median(v[warmup:]) for k, v in phases.items()},
    }


class _Timers:
    """Seconds per part of this rank; a collective inside another timed part counts in that part only. Apart from
    those: the seconds of each call of DeepSpeed's forward / backward / step (`phases`, a list per phase)."""

    def __init__(self):
        self.s = dict.fromkeys(TIMED, 0.0)
        self.phases = {k: [] for k in PHASES}
        self.depth = 0
        # per patch decision (`memory.flat_grads`, `memory.chunked_step`): whether it applied to this rank's optimizer
        self.applied: dict[str, bool] = {}

    def wrap_phase(self, fn, phase: str):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.phases[phase].append(time.perf_counter() - t0)

        return timed

    def wrap(self, fn, part: str):
        def timed(*a, **kw):
            if self.depth:  # inside a timed part: counted there
                return fn(*a, **kw)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s[part] += time.perf_counter() - t0
                self.depth -= 1

        return timed


def _recorded(t: _Timers, name: str, decide):
    def recorded(*a, **kw):
        t.applied[name] = decide(*a, **kw)
        return t.applied[name]

    return recorded


def install_timers() -> _Timers:
    """In a `dsv3 train` rank, before the run: the timers (torch.distributed's functions are looked up at each call;
    the bias update also where the DeepSpeed engine bound its name)."""
    t = _Timers()
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, t.wrap(getattr(dist, name), "collectives"))
    timed_update = t.wrap(balancing.update_expert_bias, "bias_update")
    balancing.update_expert_bias = ds_engine.update_expert_bias = timed_update
    RoutingTelemetry.record = t.wrap(RoutingTelemetry.record, "telemetry")
    RunDir.save = t.wrap(RunDir.save, "save")
    for name in PATCHES:
        setattr(ds_engine, name, _recorded(t, name, getattr(ds_engine, name)))
    from deepspeed.runtime.engine import DeepSpeedEngine

    for phase, name in zip(PHASES, ("forward", "backward", "step")):
        setattr(DeepSpeedEngine, name, t.wrap_phase(getattr(DeepSpeedEngine, name), phase))
    return t


# one rank of `dsv3 train` as torchrun starts it (RANK etc. in the environment), timed: the CLI imported after the
# timers are installed
_RANK_CODE = """
from benchmarks import _train_overhead as o
t = o.install_timers()
from dsv3_plugin.cli import main
rc = main(["train", "--config", {config!r}, "--out", {out!r}, "--overwrite", "--no-progress", "--json"])
import json, os
with open({timers!r} + "." + os.environ["RANK"], "w") as f:
    json.dump({{**t.s, "phases": t.phases, "applied": t.applied}}, f)
raise SystemExit(rc)
"""


_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_gather_into_tensor",
    "all_gather",
    "broadcast",
    "reduce",
    "barrier",
    "all_to_all_single",
)


def _launch_train(ds: dict, nproc: int, tmp: str) -> dict:
    """`dsv3 train` on `nproc` ranks (one process each, torchrun's environment); its summary and every rank's
    timers."""
    tag = f"train{nproc}"
    config, out, timers = (os.path.join(tmp, f"{tag}{s}") for s in (".json", "_run", "_timers"))
    with open(config, "w") as f:
        json.dump(ds, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH", "")] if p)}
    env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1", DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"))
    code = _RANK_CODE.format(config=config, out=out, timers=timers)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nproc)
    ]
    outs = [p.communicate() for p in procs]
    for r, (p, (so, se)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"dsv3 train rank {r} of {nproc} failed (exit {p.returncode}):\n{se[-4000:]}")
    summary = next(json.loads(line)["summary"] for line in outs[0][0].splitlines() if line.startswith('{"summary"'))
    ranks = []
    for r in range(nproc):
        with open(f"{timers}.{r}") as f:
            ranks.append(json.load(f))
    return {"summary": summary, "timers": ranks}


def _child(argv: list[str]) -> None:
    kind, ds_path, warmup = argv[0], argv[1], int(argv[2])
    with open(ds_path) as f:
        ds = json.load(f)
    if kind != "bare":
        raise SystemExit(f"_train_overhead: unknown child {kind!r}")
    print(json.dumps(_bare(ds, warmup)))


# --- the measurement --------------------------------------------------------------------------------------------


def train_tax(
    block: dict,
    batch: int,
    seq_len: int,
    steps: int,
    warmup: int,
    fused: bool = False,
    flat_grads: bool = True,
    grad_norm: str = "fp64",
    chunked_step: bool = True,
) -> dict:
    """Measure the training-loop tax (module docstring) for the "dsv3" `block` at micro-batch `batch`, sequence
    `seq_len`, `steps` steps (the bare step leaves the first `warmup` out); `fused`: torch's fused AdamW kernel on
    both sides (`"fused": true` in the JSON's optimizer params); `flat_grads`, `grad_norm` and `chunked_step`:
    `memory.flat_grads`, `memory.grad_norm` and `memory.chunked_step` of the `dsv3 train` runs.

    Returns:
        {"config", "optimizer", "flat_grads", "chunked_step", "grad_norm", "bare", "train_1rank",
        "train_2ranks", "tax_1rank", "tax_1rank_steady", "phases_1rank", "two_ranks"}; `flat_grads` = {"asked",
        "applied": per run (1 and 2 ranks), whether every rank's ZeRO-1 optimizer took the patch}, `chunked_step`
        likewise; `grad_norm` = the runs' memory.grad_norm; bare / train figures in tokens/s (`train_2ranks` also
        per rank), `phases_1rank` = per phase (forward, backward, optimizer) the median seconds of the bare step,
        of DeepSpeed's call in the 1-rank run and their difference, `two_ranks` = per-rank seconds per step of each
        timed part and of the rest.
    """
    ds = ds_json(
        block, batch, seq_len, steps, fused=fused, flat_grads=flat_grads, grad_norm=grad_norm, chunked_step=chunked_step
    )
    tokens_step = batch * seq_len
    with tempfile.TemporaryDirectory(prefix="dsv3-bench-train-") as tmp:
        ds_path = os.path.join(tmp, "ds.json")
        with open(ds_path, "w") as f:
            json.dump(ds, f)
        bare = run_child("benchmarks._train_overhead", "bare", [ds_path, str(warmup)])
        runs = {n: _launch_train(ds, n, tmp) for n in (1, 2)}
    res = {"config": {"batch": batch, "seq_len": seq_len, "steps": steps, "warmup": warmup}, "bare": bare}
    res["optimizer"] = ds["optimizer"]
    res["grad_norm"] = grad_norm  # dsv3 train's memory.grad_norm (the bare step: torch's FP32 clip_grad_norm_)
    for name, asked in zip(PATCHES, (flat_grads, chunked_step)):
        res[name] = {
            "asked": asked,
            "applied": {
                f"{n}rank" + ("s" if n > 1 else ""): all(t["applied"].get(name, False) for t in r["timers"])
                for n, r in runs.items()
            },
        }
    for n, r in runs.items():
        s = r["summary"]
        wall, done = float(s["wall_s"]), int(s["steps"])
        tps = tokens_step * n * done / wall
        res[f"train_{n}rank" + ("s" if n > 1 else "")] = {
            "tokens_per_s": tps,
            "tokens_per_s_per_rank": tps / n,
            "wall_s": wall,
            "steps": done,
            "summary_tokens_per_s": s["tokens_per_s"],  # the summary's own (last steps, step time only)
        }
    res["tax_1rank"] = bare["tokens_per_s"] / res["train_1rank"]["tokens_per_s"] - 1
    # the same against the summary's steady figure (its last steps: data read + step, no first steps, no saves)
    res["tax_1rank_steady"] = bare["tokens_per_s"] / res["train_1rank"]["summary_tokens_per_s"] - 1
    # the same phases of the 1-rank run's steps (DeepSpeed's engine calls; the same warm-up steps left out)
    one = {k: statistics.median(v[warmup:]) for k, v in runs[1]["timers"][0]["phases"].items()}
    res["phases_1rank"] = {
        k: {"bare_s": bare["phases_s"][k], "dsv3_train_s": one[k], "added_s": one[k] - bare["phases_s"][k]}
        for k in PHASES
    }
    two = runs[2]
    wall2, steps2 = float(two["summary"]["wall_s"]), int(two["summary"]["steps"])
    per_rank = []
    for t in two["timers"]:
        parts = {k: t[k] / steps2 for k in TIMED}  # (the phases are reported for 1 rank)
        parts["rest"] = wall2 / steps2 - sum(parts.values())
        per_rank.append(parts)
    res["two_ranks"] = {
        "seconds_per_step": per_rank,
        "bare_step_s": bare["step_s"],
        "per_rank_slowdown": bare["tokens_per_s"] / res["train_2ranks"]["tokens_per_s_per_rank"] - 1,
    }
    return res


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m benchmarks._train_overhead --child bare DS_JSON WARMUP")
