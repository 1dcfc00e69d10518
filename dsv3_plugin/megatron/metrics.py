"""The plugin's per-iteration figures in Megatron's `pretrain()` loop: `--dsv3-metrics FILE` (one JSON line per
iteration, global rank 0, full precision) and Megatron's own TensorBoard / W&B writers (scalars under `dsv3/`, from
the rank Megatron writes from, at its `--tensorboard-log-interval`).

Gathered from every pipeline stage after `train_step`: the losses, `router_bias_abs_sum`, the word-embedding copies'
sums, the plugin schedules' pipeline figures, and MaxVio = max_i load_i / mean load − 1 (paper §4.5.2) per MoE layer
from the whole global batch's expert loads (read before Megatron's `finalize_model_grads` zeroes them).

Design notes: docs/design_notes.md#megatron-metrics
"""

from __future__ import annotations

import importlib
import json

import torch
import torch.distributed as dist

from dsv3_plugin.megatron.dualpipev import copy_checksums, shared_weights
from dsv3_plugin.megatron.schedules import take_step_figures
from dsv3_plugin.model.moe.balancing import maxvio

__all__ = ["MetricsRecorder", "tracker_scalars"]

# pipeline figures of one rank written to the trackers (the rest of a `pipeline_ranks` record is bookkeeping)
_PIPELINE_SCALARS = ("idle_fraction", "idle_s", "busy_s", "a2a_wait_s", "grad_sync_s", "wall_s")


class MetricsRecorder:
    """Wraps Megatron's `train_step` (and its `reset_model_temporary_tensors`, to read each router's expert loads
    before they are zeroed) to record the plugin's figures of every iteration: a JSON line to `path` (global rank
    0; None: no file) and, when `trackers` is True, scalars to Megatron's TensorBoard / W&B writers (whichever
    exist on this rank) at Megatron's `--tensorboard-log-interval` iterations."""

    def __init__(self, path: str | None, trackers: bool = False):
        self.path = path
        self.trackers = trackers
        self._saved = None
        self._loads: dict[int, torch.Tensor] = {}  # id(router) -> this iteration's local loads [E]

    def __enter__(self):
        import megatron.training.training as tr

        fmg = _finalize_module()

        self._saved = (tr.train_step, fmg.reset_model_temporary_tensors)
        orig_step, orig_reset = self._saved

        def train_step(forward_step_func, data_iterator, model, *a, **kw):
            self._loads = {}
            out = orig_step(forward_step_func, data_iterator, model, *a, **kw)
            self.record(out[0], model)
            return out

        def reset_model_temporary_tensors(config, model):
            # (the counts are one global batch's only where Megatron zeroes them: with its expert-bias update on)
            for chunk in model if config.moe_router_enable_expert_bias else ():
                for m in chunk.modules():
                    if hasattr(m, "expert_bias") and hasattr(m, "local_tokens_per_expert"):
                        self._loads[id(m)] = m.local_tokens_per_expert.detach().double().clone()
            return orig_reset(config, model)

        tr.train_step = train_step
        fmg.reset_model_temporary_tensors = reset_model_temporary_tensors
        return self

    def __exit__(self, *exc):
        import megatron.training.training as tr

        fmg = _finalize_module()

        tr.train_step, fmg.reset_model_temporary_tensors = self._saved

    def record(self, loss_dict: dict, model) -> None:
        from megatron.training import get_args
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

        args = get_args()
        iteration = args.curr_iteration + 1
        # the same decision on every rank (the gather below is collective): Megatron's own tracker condition
        to_trackers = (
            self.trackers
            and bool(args.tensorboard_dir or args.wandb_project)
            and iteration % args.tensorboard_log_interval == 0
        )
        if self.path is None and not to_trackers:
            return
        line = gather_iteration(loss_dict, model, self._loads)
        line = {"iteration": iteration, **line}
        if self.path is not None and dist.get_rank() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")
        if to_trackers:
            scalars = tracker_scalars(line)
            writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
            if writer is not None:
                for name, value in scalars.items():
                    writer.add_scalar(name, value, iteration)
            if wandb_writer is not None:
                wandb_writer.log(scalars, iteration)


def _finalize_module():
    # (the package `megatron.core.distributed` exports a function of the module's name, which shadows it)
    return importlib.import_module("megatron.core.distributed.finalize_model_grads")


def tracker_scalars(line: dict) -> dict[str, float]:
    """The scalars of one recorded line that Megatron's writers do not log themselves (it logs the losses):
    `dsv3/router-bias-abs-sum`, `dsv3/maxvio-batch`, `dsv3/maxvio/layer<i>` (i: the i-th entry of
    `maxvio_per_layer`: pipeline-rank order, then module order on the rank; the MTP layer's MoE counts), and per
    pipeline rank `dsv3/pp<p>/<figure>` (`_PIPELINE_SCALARS`) when one of the plugin's schedules ran."""
    out = {"dsv3/router-bias-abs-sum": line["router_bias_abs_sum"]}
    if line.get("maxvio_batch") is not None:
        out["dsv3/maxvio-batch"] = line["maxvio_batch"]
    for i, v in enumerate(line.get("maxvio_per_layer") or []):
        out[f"dsv3/maxvio/layer{i}"] = v
    for rec in line.get("pipeline_ranks") or []:
        for k in _PIPELINE_SCALARS:
            if rec.get(k) is not None:
                out[f"dsv3/pp{rec['pp']}/{k.replace('_', '-')}"] = rec[k]
    return out


def _maxvio_per_router(every: list[dict]) -> list[float] | None:
    """MaxVio of each router (pipeline-stage order, then module order) from the loads every rank counted for its own
    tokens, summed over the ranks of that stage (tensor-parallel rank 0: TP peers count the same tokens)."""
    out = []
    every = [e for e in every if e["routers"]]  # (a stage of dense layers only has none)
    for pp in sorted({e["pp"] for e in every}):
        per_rank = [e["loads"] for e in every if e["pp"] == pp and e["tp"] == 0]
        if any(x is None for x in per_rank):
            return None
        for loads in zip(*per_rank):
            out.append(maxvio(torch.tensor(loads, dtype=torch.float64).sum(dim=0)))
    return out


def gather_iteration(loss_dict: dict, model, loads: dict) -> dict:
    """One iteration's line (every rank takes part; all ranks get it): see the module docstring."""
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training import get_args

    args = get_args()
    mirrored = getattr(args, "dsv3_pipeline_schedule", None) == "dualpipe" and len(model) == 2
    # DualPipe: copy B's routers are copy A's (identical: `copy_sums`), counted once as at PP = 1
    routers = [m for chunk in (model[:1] if mirrored else model) for m in chunk.modules() if hasattr(m, "expert_bias")]
    mtp = MTPLossLoggingHelper.tracker.get("loss_values")
    have_loads = bool(routers) and all(id(r) in loads for r in routers)
    mine = {
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "losses": {k.replace(" ", "_"): float(v) for k, v in loss_dict.items()},
        "bias": float(sum(r.expert_bias.detach().double().abs().sum() for r in routers)),
        "routers": len(routers),
        "loads": [loads[id(r)].tolist() for r in routers] if have_loads else None,
        "mtp": [float(x) for x in mtp.detach().double()] if mtp is not None else None,
        "emb": [float(w.detach().double().sum()) for w in shared_weights(model)],
        "pipeline": take_step_figures(),
        "copies": copy_checksums(model, ps.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size)
        if mirrored
        else None,
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    line = {}
    replica0 = sorted((e for e in every if e["tp"] == 0 and e["dp"] == 0), key=lambda e: e["pp"])
    for e in replica0:
        line.update(e["losses"])
    dps = sorted({e["dp"] for e in every if e["tp"] == 0})
    mtp_dp = []
    for d in dps:  # Megatron's own MTP logging: sum over stages, mean over data parallel, per micro-batch
        parts = [e["mtp"] for e in every if e["tp"] == 0 and e["dp"] == d and e["mtp"] is not None]
        if parts:
            mtp_dp.append([sum(col) for col in zip(*parts)])
    if mtp_dp:
        for k, col in enumerate(zip(*mtp_dp)):
            line[f"mtp_{k + 1}_loss"] = sum(col) / len(col) / get_num_microbatches()
    line["router_bias_abs_sum"] = sum(e["bias"] for e in replica0)
    line["routers"] = sum(e["routers"] for e in replica0)
    per_layer = _maxvio_per_router(every) if line["routers"] else None
    if per_layer:
        line["maxvio_per_layer"] = per_layer
        line["maxvio_batch"] = sum(per_layer) / len(per_layer)
    line["word_embedding_sums"] = [x for e in replica0 for x in e["emb"]]
    copies = [c for e in replica0 if e["copies"] for c in e["copies"]]
    if copies:
        n = len(replica0)
        line["copy_sums"] = {
            name: [next(t for k, s, t in copies if k == name and s == stage) for stage in range(n)] for name in "AB"
        }
    figures = [e for e in replica0 if e["pipeline"] is not None]
    if figures:
        line["pipeline_schedule"] = figures[0]["pipeline"]["schedule"]
        line["pipeline_ranks"] = [
            {"pp": e["pp"], **{k: v for k, v in e["pipeline"].items() if k != "schedule"}} for e in figures
        ]
    return line
