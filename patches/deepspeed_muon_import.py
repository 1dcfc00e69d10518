"""No import of DeepSpeed's Muon optimizer when the optimizer is one ZeRO already supports (deepspeed 0.19.x).

Why: `deepspeed.initialize` checks the optimizer with `zero.utils.is_zero_supported_optimizer`, which first imports
`deepspeed.runtime.zero.muon.muon_optimizer` to add `MuonWithAuxAdam` to `ZERO_SUPPORTED_OPTIMIZERS`. That module's
`torch.compile` decorators import torch._dynamo and torch._inductor: ~6 s of CPU in every rank process that starts
an engine, for an AdamW run that never touches Muon.

How: the engine module's `is_zero_supported_optimizer` (the name `DeepSpeedEngine` calls) answers True at once for
an optimizer whose type is already in `ZERO_SUPPORTED_OPTIMIZERS` (the original would answer True for it too, the
list only grows), and calls DeepSpeed's original for any other type (Muon included), which then imports Muon as
before. Applies to deepspeed 0.19.x; `revert()` restores the original.
"""

from __future__ import annotations

__all__ = ["applies", "apply", "revert"]

_saved: dict = {}


def applies() -> bool:
    import deepspeed

    return deepspeed.__version__.startswith("0.19.")


def _known_first(original):
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    def is_zero_supported_optimizer(optimizer):
        return type(optimizer) in ZERO_SUPPORTED_OPTIMIZERS or original(optimizer)

    is_zero_supported_optimizer.__wrapped__ = original
    return is_zero_supported_optimizer


def apply() -> bool:
    """Patch (idempotent). True when it changed something."""
    if _saved or not applies():
        return False
    import deepspeed.runtime.engine as engine

    _saved["engine"] = engine.is_zero_supported_optimizer
    engine.is_zero_supported_optimizer = _known_first(_saved["engine"])
    return True


def revert() -> None:
    if _saved:
        import deepspeed.runtime.engine as engine

        engine.is_zero_supported_optimizer = _saved.pop("engine")
