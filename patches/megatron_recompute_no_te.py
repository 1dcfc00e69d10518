"""Let Megatron's selective recompute of norms and MLA up-projections run without Transformer Engine.

`megatron.core.tensor_parallel.random.CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not None`
(True for False), so its forward always asks TE's `FP8GlobalStateManager` whether FP8 is on; without TE that name
does not exist and `--recompute-granularity selective --recompute-modules layernorm` (or `mla_up_proj`) ends in a
NameError. Without TE no TE FP8 can be on: `apply()` makes the constructor store `bool(fp8)` when TE is absent
(and does nothing when TE is there). Any device; version-guarded (0.19.2); `revert()` restores the original.
"""

from __future__ import annotations

__all__ = ["TESTED_VERSIONS", "apply", "revert", "is_applied"]

TESTED_VERSIONS = ("0.19.2",)
_saved = None


def is_applied() -> bool:
    return _saved is not None


def apply(force: bool = False) -> bool:
    """Install when Transformer Engine is absent. Returns True if installed now or already, False with TE."""
    global _saved
    if _saved is not None:
        return True
    import megatron.core.tensor_parallel.random as mrandom

    if mrandom.HAVE_TE:
        return False
    from megatron.core.package_info import __version__

    v = __version__.split("+")[0]
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"dsv3_plugin_patches.megatron_recompute_no_te: megatron-core {v} is untested (tested: "
            f"{', '.join(TESTED_VERSIONS)}); refusing to patch it (force=True to try anyway)"
        )
    cls = mrandom.CheckpointWithoutOutput
    original = cls.__dict__["__init__"]

    def __init__(self, fp8=False):
        original(self, fp8)
        self.fp8 = bool(fp8)  # TE is absent: its FP8 cannot be on

    cls.__init__ = __init__
    _saved = original
    return True


def revert() -> None:
    global _saved
    if _saved is None:
        return
    import megatron.core.tensor_parallel.random as mrandom

    mrandom.CheckpointWithoutOutput.__init__ = _saved
    _saved = None
