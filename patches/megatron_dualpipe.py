"""Make Megatron-Core's `get_forward_backward_func` return DualPipeV when the dsv3 config asks for it.

`apply(cfg)` replaces `get_forward_backward_func` in `megatron.core.pipeline_parallel.schedules`, in the
package `megatron.core.pipeline_parallel` (which re-exports it) and in `megatron.training.training` if that
module is already imported (it binds the name at import time). The replacement returns
`dsv3_plugin.megatron.schedules.forward_backward_dualpipev` when `cfg.parallel.schedule == "dualpipev"` and
the pipeline size is > 1; otherwise it defers to the original. `revert()` restores the exact original
objects; `dualpipe_schedule(cfg)` is the context-manager form. Importing this module patches nothing.

Only megatron-core versions in TESTED_VERSIONS are patched; others are refused with a message naming the
version (pass force=True to try anyway). Megatron must also lay the model out as two chunks per rank
(stages r and 2P-1-r, like VPP=2) — see docs/pipeline.md.
"""
from __future__ import annotations

import contextlib
import sys

__all__ = ["TESTED_VERSIONS", "apply", "revert", "is_applied", "dualpipe_schedule"]

TESTED_VERSIONS = ("0.16.1",)
_TARGETS = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel",
            "megatron.training.training")
_saved: dict | None = None


def _version() -> str:
    from megatron.core.package_info import __version__
    return __version__.split("+")[0]      # without the "+<git hash>" megatron-core adds inside a git checkout


def _schedule_of(cfg) -> str:
    from dsv3_plugin.config import ConfigError, load_config
    cfg = load_config(cfg)
    if cfg.parallel.schedule == "dualpipe":
        raise ConfigError("dsv3.parallel.schedule: the Megatron adapter runs 'dualpipev' (or Megatron's own "
                          "'1f1b'); 'dualpipe' needs inputs on both pipeline ends, which Megatron's data path "
                          "does not provide")
    return cfg.parallel.schedule


def is_applied() -> bool:
    return _saved is not None


def apply(cfg, force: bool = False) -> bool:
    """Patch according to `cfg` (DSv3Config, dict or path). Returns True if patched now."""
    global _saved
    v = _version()
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(f"patches.megatron_dualpipe: megatron-core {v} is untested (tested: "
                           f"{', '.join(TESTED_VERSIONS)}); refusing to patch get_forward_backward_func. "
                           "Check its signature against this version and add it to TESTED_VERSIONS, or pass force=True.")
    if _saved is not None:
        return False
    schedule = _schedule_of(cfg)
    import importlib
    sched_mod = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    original = sched_mod.get_forward_backward_func
    from dsv3_plugin.megatron.schedules import forward_backward_dualpipev

    def get_forward_backward_func(pp_size=None, vp_size=None, *args, **kwargs):
        if schedule == "dualpipev":
            pp = pp_size
            if pp is None:
                from megatron.core import parallel_state
                pp = parallel_state.get_pipeline_model_parallel_world_size()
            if pp > 1:
                return forward_backward_dualpipev
        return original(pp_size, vp_size, *args, **kwargs)

    get_forward_backward_func.__wrapped__ = original
    saved = {}
    for name in _TARGETS:
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "get_forward_backward_func", None) is original:
            saved[name] = original
            mod.get_forward_backward_func = get_forward_backward_func
    _saved = saved
    return True


def revert() -> bool:
    global _saved
    if _saved is None:
        return False
    for name, fn in _saved.items():
        mod = sys.modules.get(name)
        if mod is not None:
            mod.get_forward_backward_func = fn
    _saved = None
    return True


@contextlib.contextmanager
def dualpipe_schedule(cfg, force: bool = False):
    applied = apply(cfg, force=force)
    try:
        yield
    finally:
        if applied:
            revert()
