"""DeepSpeed checkpoints loaded without unpickling arbitrary objects (deepspeed 0.19.x).

Why: DeepSpeed's `TorchCheckpointEngine.load` calls `torch.load(path, weights_only=False)`, so a crafted `.pt`
file in a run directory (checkpoints are copied between teams) runs any code its pickle names the moment
`--resume` reads it. torch's `weights_only=True` unpickler builds only tensors, containers and plain values,
plus the classes allowlisted for the call.

How: `apply()` replaces `TorchCheckpointEngine.load` with a `weights_only=True` load that allowlists exactly the
DeepSpeed classes a ZeRO-1 checkpoint of this plugin holds (found by loading every checkpoint the tests write:
`LossScaler` in the optimizer state, `ZeroStageEnum`, `fragment_address` in the parameter-slice mappings). A file
naming any other global is refused with `CheckpointError` (`<file>: refused to unpickle ...`, exit 2 in the
CLI), never loaded the unsafe way. Applies to deepspeed 0.19.x only; `revert()` restores DeepSpeed's method.
"""

from __future__ import annotations

import pickle

__all__ = ["apply", "revert", "applies", "safe_globals"]

_saved: dict = {}


def applies() -> bool:
    import deepspeed

    return deepspeed.__version__.startswith("0.19.")


def safe_globals() -> list:
    """The DeepSpeed classes a ZeRO-1 checkpoint holds besides tensors and plain values."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _safe_load(self, path: str, map_location=None):
    import torch

    from dsv3_plugin.errors import CheckpointError

    with torch.serialization.safe_globals(safe_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            # torch's message: a preamble, then the line that names the global ("Unsupported global: GLOBAL x.y"
            # for a class not allowlisted, "Trying to load unsupported GLOBAL posix.system ..." for a blocked module)
            why = next((ln for ln in str(e).splitlines() if "GLOBAL" in ln), str(e).splitlines()[0])
            raise CheckpointError(
                f"{path}: refused to unpickle ({why.strip()}); DeepSpeed checkpoints are loaded with "
                "torch.load(weights_only=True)"
            ) from None
        except (RuntimeError, EOFError) as e:  # not a torch file (bad magic number, truncated zip)
            raise CheckpointError(f"{path}: not a readable torch checkpoint file ({e})") from None


def apply() -> bool:
    if not applies() or "load" in _saved:
        return False
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    _saved["load"] = TorchCheckpointEngine.load
    TorchCheckpointEngine.load = _safe_load
    return True


def revert() -> None:
    if "load" in _saved:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        TorchCheckpointEngine.load = _saved.pop("load")
