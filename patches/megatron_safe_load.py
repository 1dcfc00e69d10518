"""Megatron-LM checkpoints loaded without unpickling arbitrary objects (megatron-core 0.19.2, torch 2.13).

Why: what `--load` reads runs any code a crafted checkpoint names. torch.distributed.checkpoint's
`FileSystemReader.read_metadata` unpickles `.metadata` with `pickle.load`; its `DefaultLoadPlanner.load_bytes` (the
byte items of every `__<rank>_<k>.distcp`, Megatron's `common_state` among them) calls
`torch.load(weights_only=False)`; Megatron's legacy `common.pt` and `--ckpt-format torch` files
(`model_optim_rng.pt`, `distrib_optim.pt`) go through `torch.load` with torch's default, which an environment
variable (`TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`) turns unsafe.

Design notes: docs/design_notes.md#patches-megatron-safe-load
"""

from __future__ import annotations

import io
import os
import pickle

__all__ = ["TESTED_VERSIONS", "apply", "revert", "is_applied", "safe_globals", "refusal"]

TESTED_VERSIONS = {"megatron-core": ("0.19.2",), "torch": ("2.13.",)}
_saved: dict = {}
_refused: list = []


def _versions() -> dict[str, str]:
    import torch
    from megatron.core.package_info import __version__

    return {"megatron-core": __version__.split("+")[0], "torch": torch.__version__.split("+")[0]}


def safe_globals() -> list:
    """The non-tensor classes a Megatron checkpoint holds (args Namespace, enums, RNG states, numpy arrays...)."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return [*SAFE_GLOBALS, io.BytesIO]


def refusal():
    """The CheckpointError of the first file refused (code in it, or not a torch file) since `apply()`, or None."""
    return _refused[0] if _refused else None


BYTE_ITEM = "a byte item of the checkpoint"


def _fail(what: str, msg: str):
    from dsv3_plugin.errors import CheckpointError

    err = CheckpointError(f"{what}: {msg}")
    _refused.append(err)
    return err


def _refuse(what: str, detail: str):
    return _fail(what, f"refused to unpickle ({detail}); Megatron checkpoints are loaded without code")


def _why(e: Exception) -> str:
    # torch's message: a preamble, then the line naming the global ("Unsupported global: GLOBAL x.y")
    lines = str(e).splitlines() or [type(e).__name__]
    return next((ln for ln in lines if "GLOBAL" in ln), lines[0]).strip()


def _safe_torch_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
    # weights_only is True whatever the caller asked; pickle_module is not passed on (weights_only=True uses
    # torch's restricted unpickler, and torch refuses the two together)
    import torch

    name = os.fspath(f) if isinstance(f, (str, os.PathLike)) else BYTE_ITEM
    with torch.serialization.safe_globals(safe_globals()):
        try:
            return _saved["torch.load"](f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
        except pickle.UnpicklingError as e:
            raise _refuse(name, _why(e)) from None
        except (RuntimeError, EOFError) as e:  # not a torch file (bad zip, truncated)
            if isinstance(e, EOFError) or "zip archive" in str(e) or "magic number" in str(e):
                raise _fail(name, f"not a readable torch checkpoint file ({_why(e)})") from None
            raise


def _read_metadata(self, *args, **kwargs):
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    from dsv3_plugin.checkpoint.megatron_dist import load_dcp_metadata

    path = self._get_metadata_path(kwargs.get("rank"))
    try:
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_dcp_metadata(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise _refuse(os.fspath(path), str(e)) from None
    if not isinstance(metadata, Metadata):
        raise _refuse(os.fspath(path), f"a {type(metadata).__name__}, not a torch.distributed.checkpoint Metadata")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _read_data(self, plan, planner):
    # a byte item is unpickled from memory: name the checkpoint directory it came from
    n = len(_refused)
    try:
        return _saved["read_data"](self, plan, planner)
    except Exception:
        if len(_refused) > n and str(_refused[n]).startswith(BYTE_ITEM + ": "):
            msg = str(_refused[n])[len(BYTE_ITEM) + 2 :]
            del _refused[n:]
            raise _fail(f"{os.fspath(self.path)} (a byte item of its .distcp files)", msg) from None
        raise


def is_applied() -> bool:
    return bool(_saved)


def apply(force: bool = False) -> bool:
    """Patch torch.load and the torch_dist reader (idempotent). Returns True when patched now.

    Args:
        force: patch versions not in TESTED_VERSIONS too.

    Returns:
        Whether this call patched anything.
    """
    v = _versions()
    bad = {k: x for k, x in v.items() if not x.startswith(TESTED_VERSIONS[k])}
    if bad and not force:
        raise RuntimeError(
            "dsv3_plugin_patches.megatron_safe_load: "
            + ", ".join(f"{k} {x}" for k, x in bad.items())
            + " untested (tested: "
            + "; ".join(f"{k} {', '.join(t)}" for k, t in TESTED_VERSIONS.items())
            + "); refusing to load Megatron checkpoints without this patch. Check torch.load and "
            "FileSystemReader.read_metadata/read_data against these versions and add them, or pass force=True."
        )
    if _saved:
        return False
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    _refused.clear()
    _saved.update(
        {
            "torch.load": torch.load,
            "read_metadata": FileSystemReader.__dict__["read_metadata"],
            "read_data": FileSystemReader.__dict__["read_data"],
        }
    )
    torch.load = _safe_torch_load
    FileSystemReader.read_metadata = _read_metadata
    FileSystemReader.read_data = _read_data
    return True


def revert() -> bool:
    """Restore what `apply()` replaced. Returns True when something was restored."""
    if not _saved:
        return False
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    torch.load = _saved.pop("torch.load")
    FileSystemReader.read_metadata = _saved.pop("read_metadata")
    FileSystemReader.read_data = _saved.pop("read_data")
    return True
