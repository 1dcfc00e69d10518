"""Make Megatron-Core's `get_forward_backward_func` return our pipeline schedule (DualPipeV or our 1F1B).

`apply(schedule)` replaces `get_forward_backward_func` in `megatron.core.pipeline_parallel.schedules`, in the
package `megatron.core.pipeline_parallel` (which re-exports it) and in `megatron.training.training` if that
module is already imported (it binds the name at import time). With a pipeline size > 1 the replacement returns
`dsv3_plugin.megatron.schedules.forward_backward_dualpipev` for "dualpipev" and `forward_backward_1f1b` for
"1f1b"; with pipeline size 1, or for "megatron", it defers to Megatron's original (its no-pipelining / 1F1B /
interleaved functions). `schedule` is that name, or a dsv3 config (DSv3Config, dict or path): its
`parallel.schedule` "dualpipev" selects ours, "1f1b" leaves Megatron's own. `revert()` restores the exact
original objects; `dualpipe_schedule(schedule)` is the context-manager form. Importing this module patches nothing.

Only megatron-core versions in TESTED_VERSIONS are patched; others are refused with a message naming the
version (pass force=True to try anyway). DualPipeV also needs the model laid out as two chunks per rank
(stages r and 2P-1-r): `dsv3_plugin.megatron.dualpipev` (docs/megatron.md).
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["TESTED_VERSIONS", "SCHEDULES", "apply", "revert", "is_applied", "dualpipe_schedule"]

TESTED_VERSIONS = ("0.16.1", "0.19.2")
SCHEDULES = ("dualpipev", "1f1b", "megatron")
_TARGETS = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel",
    "megatron.training.training",
)
_saved: dict | None = None


def _version() -> str:
    from megatron.core.package_info import __version__

    return __version__.split("+")[0]  # without the "+<git hash>" megatron-core adds inside a git checkout


def _schedule_of(schedule) -> str:
    from dsv3_plugin.config import ConfigError, load_config

    if isinstance(schedule, str) and schedule in SCHEDULES:
        return schedule
    if isinstance(schedule, str) and not schedule.endswith(".json"):
        raise ConfigError(f"pipeline schedule {schedule!r}: choose from {', '.join(SCHEDULES)}")
    cfg = load_config(schedule)
    if cfg.parallel.schedule == "dualpipe":
        raise ConfigError(
            "dsv3.parallel.schedule: the Megatron adapter runs 'dualpipev' or '1f1b' (or Megatron's "
            "own schedules); 'dualpipe' needs inputs on both pipeline ends, which Megatron's data "
            "path does not provide"
        )
    # a block's "1f1b" is any 1F1B: Megatron's own unless the name "1f1b" is passed (as --dsv3-pipeline-schedule does)
    return "dualpipev" if cfg.parallel.schedule == "dualpipev" else "megatron"


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
    _saved = saved
    return True


def revert() -> bool:
    global _saved
    if _saved is None:
        return False
    for target, fn in _saved.items():
        mod = sys.modules.get(target)
        if mod is not None:
            mod.get_forward_backward_func = fn
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
