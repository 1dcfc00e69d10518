"""Make Megatron-Core's `get_forward_backward_func` return our pipeline schedule (DualPipeV, DualPipe or our 1F1B).

Only megatron-core versions in TESTED_VERSIONS are patched; others are refused with a message naming the
version (pass force=True to try anyway). DualPipeV and DualPipe also need the model laid out as two chunks per
rank (stages r and 2P-1-r of the V: `dsv3_plugin.megatron.dualpipev`; stage r of copy A and P-1-r of copy B:
`dsv3_plugin.megatron.dualpipev`; docs/megatron.md). For "dualpipe" the patch also lets Megatron's MTP block be
built on virtual chunk 0: its constructor asserts the last virtual stage (`is_vp_last_stage`, true for the V's
stage 2P-1), but copy A's last stage, where its MTP layers belong, is chunk 0 of rank P-1; the name
`is_vp_last_stage` in `megatron.core.transformer.multi_token_prediction` (used there only by that assertion)
answers True while patched.

Design notes: docs/design_notes.md#patches-megatron-dualpipe
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["TESTED_VERSIONS", "SCHEDULES", "apply", "revert", "is_applied", "dualpipe_schedule"]

TESTED_VERSIONS = ("0.16.1", "0.19.2")
SCHEDULES = ("dualpipev", "dualpipe", "1f1b", "megatron")
_TARGETS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel",
    "megatron.training.training",
)
_saved: dict | None = None
_MTP_MODULE = "megatron.core.transformer.multi_token_prediction"


def _version() -> str:
    from megatron.core.package_info import __version__

    return __version__.split("+")[0]  # without the "+<git hash>" megatron-core adds inside a git checkout


def _schedule_of(schedule) -> str:
    from dsv3_plugin.config import ConfigError, DSv3Config, load_config

    if isinstance(schedule, str) and schedule in SCHEDULES:
        return schedule
    if isinstance(schedule, str) and not schedule.endswith(".json"):
        raise ConfigError(f"pipeline schedule {schedule!r}: choose from {', '.join(SCHEDULES)}")
    cfg = DSv3Config.from_block(schedule) if isinstance(schedule, dict) else load_config(schedule)
    # a block's "1f1b" is any 1F1B: Megatron's own unless the name "1f1b" is passed (as --dsv3-pipeline-schedule does)
    return cfg.parallel.schedule if cfg.parallel.schedule in ("dualpipev", "dualpipe") else "megatron"


def is_applied() -> bool:
    return _saved is not None


def apply(schedule, force: bool = False) -> bool:
    """Patch for `schedule` (a name in SCHEDULES, or a dsv3 config). Returns True if patched now."""
    global _saved
    v = _version()
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"dsv3_plugin_patches.megatron_dualpipe: megatron-core {v} is untested (tested: "
            f"{', '.join(TESTED_VERSIONS)}); refusing to patch get_forward_backward_func. "
            "Check its signature against this version and add it to TESTED_VERSIONS, or pass force=True."
        )
    if _saved is not None:
        return False
    name = _schedule_of(schedule)
    import importlib

    sched_mod = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = sched_mod.get_forward_backward_func
    from dsv3_plugin.megatron.schedules import SCHEDULE_FUNCS

    ours = SCHEDULE_FUNCS.get(name)

    def get_forward_backward_func(pp_size=None, vp_size=None, *args, **kwargs):
        if ours is not None:
            pp = pp_size
            if pp is None:
                from megatron.core import parallel_state

                pp = parallel_state.get_pipeline_model_parallel_world_size()
            if pp > 1:
                return ours
        return original(pp_size, vp_size, *args, **kwargs)

    get_forward_backward_func.__wrapped__ = original
    get_forward_backward_func.dsv3_schedule = name
    saved = {}
    for target in _TARGETS:
        mod = sys.modules.get(target)
        if mod is not None and getattr(mod, "get_forward_backward_func", None) is original:
            saved[target] = original
            mod.get_forward_backward_func = get_forward_backward_func
    if name == "dualpipe":
        mtp_mod = importlib.import_module(_MTP_MODULE)
        if hasattr(mtp_mod, "is_vp_last_stage"):
            saved[(_MTP_MODULE, "is_vp_last_stage")] = mtp_mod.is_vp_last_stage
            mtp_mod.is_vp_last_stage = _mtp_on_either_chunk
    _saved = saved
    return True


def _mtp_on_either_chunk(vp_stage=None, vp_size=None) -> bool:
    """DualPipe: Megatron builds the MTP block only where the layout puts MTP layers (each copy's last stage, chunk 0
    of rank P-1 or chunk 1 of rank 0), so its last-virtual-stage assertion holds for both."""
    return True


def revert() -> bool:
    global _saved
    if _saved is None:
        return False
    for target, fn in _saved.items():
        attr = "get_forward_backward_func"
        if isinstance(target, tuple):
            target, attr = target
        mod = sys.modules.get(target)
        if mod is not None:
            setattr(mod, attr, fn)
    _saved = None
    return True


@contextlib.contextmanager
def dualpipe_schedule(schedule, force: bool = False):
    applied = apply(schedule, force=force)
    try:
        yield
    finally:
        if applied:
            revert()
