"""One model-parallel all-reduce per gradient norm in DeepSpeed's ZeRO-1/2 optimizer (deepspeed 0.19.x).

How: on one optimizer instance, `scaled_global_norm` runs DeepSpeed's own code with the per-group
model-parallel all-reduce skipped (each group's norm then covers this stage: summed over the data-parallel group,
expert groups averaged over their expert-data-parallel group, as DeepSpeed does), combines the groups as DeepSpeed
does, and sums the squared stage norm over the model-parallel group once: sqrt(sum over stages of sum over groups
of n^2), the same quantity as DeepSpeed's sqrt(sum over groups of sum over stages of n^2), added in another order
(in float64, then rounded to float32 like DeepSpeed's result). An invalid group norm (inf / NaN) still makes the
whole norm inf, on every rank. `revert(optimizer)` restores DeepSpeed's method.

Design notes: docs/design_notes.md#patches-deepspeed-zero-pipeline-norm
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["applies", "apply", "revert"]

_ATTR = "_dsv3_stage_norm_patch"


def applies(optimizer) -> bool:
    """deepspeed 0.19.x, a ZeRO-1/2 optimizer (the one `scaled_global_norm` / `_model_parallel_all_reduce` belong
    to) with a model-parallel group of more than one rank."""
    import deepspeed
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    group = getattr(optimizer, "model_parallel_group", None)
    return (
        deepspeed.__version__.startswith("0.19.")
        and isinstance(optimizer, DeepSpeedZeroOptimizer)
        and group is not None
        and dist.get_world_size(group=group) > 1
    )


def _skip_model_parallel_all_reduce(tensor, op):  # the signature of the method it shadows
    return None


def apply(optimizer) -> bool:
    """Patch this optimizer instance (idempotent). True when it changed something."""
    if getattr(optimizer, _ATTR, False) or not applies(optimizer):
        return False
    stage_norm_of = optimizer.scaled_global_norm  # DeepSpeed's bound method

    def scaled_global_norm(norm_type=2):
        optimizer._model_parallel_all_reduce = _skip_model_parallel_all_reduce
        try:
            stage_norm = stage_norm_of(norm_type)  # [] float32; inf when a group's norm is invalid
        finally:
            del optimizer._model_parallel_all_reduce  # the class's method again
        sq = stage_norm.double().pow(2)
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=optimizer.model_parallel_group)
        return sq.sqrt().to(stage_norm.dtype)

    optimizer.scaled_global_norm = scaled_global_norm
    setattr(optimizer, _ATTR, True)
    return True


def revert(optimizer) -> None:
    if getattr(optimizer, _ATTR, False):
        del optimizer.scaled_global_norm
        delattr(optimizer, _ATTR)
