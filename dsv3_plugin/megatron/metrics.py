"""`--dsv3-metrics FILE` of `python -m dsv3_plugin.megatron.pretrain_gpt`: one JSON line per iteration of Megatron's
`pretrain()` loop, at full precision, for tests and plots.

Written by global rank 0 from what every pipeline stage of data-parallel replica 0 holds after `train_step`:
`lm_loss` (Megatron's data-parallel reduction, on the last stage), `mtp_<k>_loss` (Megatron's MTP tracker, summed
over stages, averaged over data parallel, per micro-batch, as its log line), `router_bias_abs_sum` / `routers`
(all routers of all stages), `word_embedding_sums` (float64 sum of every copy of the word embedding: the
original and the copies MTP / tied heads keep on the last stage, which must stay identical).

Design notes: docs/design_notes.md#megatron-metrics
"""

from __future__ import annotations

import json

import torch.distributed as dist

from dsv3_plugin.megatron.dualpipev import copy_checksums, shared_weights
from dsv3_plugin.megatron.schedules import take_step_figures

__all__ = ["MetricsRecorder", "record_iteration"]


class MetricsRecorder:
    """Wraps Megatron's `train_step` to write one JSON line per iteration (global rank 0), gathered from every
    pipeline stage of data-parallel replica 0: the losses Megatron reduced over data parallel (computed on the
    last stage), the MTP losses (Megatron's tracker, before its logging clears it), the sum over all routers of
    |expert bias| (Megatron's finalize_model_grads steps it), and the float64 sum of every copy of the word
    embedding held for MTP / tied heads (the copies must stay identical)."""

    def __init__(self, path: str):
        self.path = path
        self._orig = None

    def __enter__(self):
        import megatron.training.training as tr

        self._orig = tr.train_step
        orig = self._orig
        path = self.path

        def train_step(forward_step_func, data_iterator, model, *a, **kw):
            out = orig(forward_step_func, data_iterator, model, *a, **kw)
            record_iteration(path, out[0], model)
            return out

        tr.train_step = train_step
        return self

    def __exit__(self, *exc):
        import megatron.training.training as tr

        tr.train_step = self._orig


def record_iteration(path: str, loss_dict: dict, model) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.training import get_args

    args = get_args()
    mirrored = getattr(args, "dsv3_pipeline_schedule", None) == "dualpipe" and len(model) == 2
    # DualPipe: copy B's routers are copy A's (identical: `copy_sums`), counted once as at PP = 1
    routers = [m for chunk in (model[:1] if mirrored else model) for m in chunk.modules() if hasattr(m, "expert_bias")]
    mtp = MTPLossLoggingHelper.tracker.get("loss_values")
    mine = {
        "dp": ps.get_data_parallel_rank(with_context_parallel=True),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "losses": {k.replace(" ", "_"): float(v) for k, v in loss_dict.items()},
        "bias": float(sum(r.expert_bias.detach().double().abs().sum() for r in routers)),
        "routers": len(routers),
        "mtp": [float(x) for x in mtp.detach().double()] if mtp is not None else None,
        "emb": [float(w.detach().double().sum()) for w in shared_weights(model)],
        "pipeline": take_step_figures(),
        "copies": copy_checksums(model, ps.get_pipeline_model_parallel_rank(), args.pipeline_model_parallel_size)
        if mirrored
        else None,
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() != 0:
        return
    line = {"iteration": args.curr_iteration + 1}
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
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
