"""Reading a Megatron-LM training checkpoint (`--save`, `--ckpt-format torch_dist`) of the plugin's `pretrain_gpt`
tensor by tensor, without unpickling code.

Format (torch.distributed.checkpoint, as Megatron-Core's dist_checkpointing writes it): the tracker file
`latest_checkpointed_iteration.txt` names `iter_NNNNNNN/`, which holds `.metadata` (a pickle of `Metadata`: every
key's global shape, dtype and the file ranges of its chunks) and `__<rank>_<k>.distcp` files. The plugin's spec saves
one global tensor per layer under our Megatron names (`names.Key.megatron()`: `decoder.layers.{i}.…`, routed experts
stacked `[E, …]`, the MTP block's `mtp.layers.{k}.transformer_layer.…`); with mixed precision the FP32 master weights
are the optimizer's `optimizer.state.fp32_param.<name>`.

Design notes: docs/design_notes.md#checkpoint-megatron-dist
"""

from __future__ import annotations

import os
import pickle
import warnings

import torch

from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.safe_files import check_regular, open_regular, read_regular

__all__ = ["megatron_iteration_dir", "MegatronDistReader", "TRACKER", "load_dcp_metadata"]

TRACKER = "latest_checkpointed_iteration.txt"
# exactly the classes a torch_dist `.metadata` pickles (dataclasses and enums: constructing them runs no code)
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "TensorWriteData", "WriteItem", "WriteItemType"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id when the writer was given a Path
}


def megatron_iteration_dir(src: str, iteration: str | None = None) -> str | None:
    """The `iter_NNNNNNN` directory to read: `src` itself when it is one, else the one `src`'s tracker file names
    (or `iteration`). None when `src` is no Megatron-LM checkpoint; CheckpointError when it is a broken one."""
    # lexists: a FIFO or a link out in place of a file is this kind of checkpoint, refused by the read that follows
    if os.path.lexists(os.path.join(src, ".metadata")) and iteration is None:
        return src
    tracker = os.path.join(src, TRACKER)
    if not os.path.lexists(tracker):
        return None
    if iteration is None:
        # a regular file inside the checkpoint (a FIFO would hang the read)
        iteration = read_regular(tracker, CheckpointError, src, limit=4096).decode(errors="replace").strip()
    digits = iteration[len("iter_") :] if iteration.startswith("iter_") else iteration
    if not digits.isdigit():
        raise CheckpointError(f"{tracker}: iteration {iteration!r} is not a number; pass --tag N (or iter_NNNNNNN)")
    d = os.path.join(src, f"iter_{int(digits):07d}")
    if not os.path.lexists(os.path.join(d, ".metadata")):
        raise CheckpointError(f"{d}: no .metadata (not a torch_dist checkpoint; only --ckpt-format torch_dist is read)")
    return d


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()) or (module == "torch" and name == "Size"):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # maps a layout's name to torch.strided etc.
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not a checkpoint-metadata class")


def load_dcp_metadata(f) -> object:
    """Unpickle a torch.distributed.checkpoint `.metadata` stream `f` through the allow-list (`_MetadataUnpickler`:
    the metadata classes, `torch.Size`, dtypes, layouts; any other global raises `pickle.UnpicklingError` before
    anything of it runs). The one reader of `.metadata` for `dsv3 export` and the Megatron safe-load patch."""
    return _MetadataUnpickler(f).load()


class MegatronDistReader:
    """Global tensors of one `iter_NNNNNNN` directory, read one key at a time.

    Args:
        path: the iteration directory (`megatron_iteration_dir`).
    """

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        meta_path = os.path.join(path, ".metadata")
        with open_regular(meta_path, CheckpointError, path) as f:  # regular, inside the checkpoint
            try:
                self.metadata = load_dcp_metadata(f)
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
                raise CheckpointError(f"{meta_path}: refused or unreadable checkpoint metadata ({e})") from None
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

        if not isinstance(self.metadata, Metadata):
            raise CheckpointError(f"{meta_path}: not a torch.distributed.checkpoint Metadata object")
        self._tensor_meta = TensorStorageMetadata
        metadata = self.metadata
        # every data file the metadata names: a regular file inside the checkpoint (torch's reader opens them
        # by name; a FIFO would hang it, a link could leave the directory)
        for rel in sorted({getattr(v, "relative_path", "") for v in (metadata.storage_data or {}).values()}):
            if not rel or os.path.basename(rel) != rel:
                raise CheckpointError(f"{meta_path}: data file {rel!r} is not a plain file name inside {path}")
            check_regular(os.path.join(path, rel), CheckpointError, path)

        class _Reader(FileSystemReader):  # torch's reader, with the metadata read above (never pickle.load)
            def read_metadata(self, *args, **kwargs):
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        self._reader_cls = _Reader

    def tensor_keys(self) -> list[str]:
        md = self.metadata.state_dict_metadata
        return [k for k, v in md.items() if isinstance(v, self._tensor_meta)]

    def nbytes(self, key: str) -> int:
        m = self.metadata.state_dict_metadata[key]
        return m.size.numel() * m.properties.dtype.itemsize

    def has(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), self._tensor_meta)

    def get(self, key: str) -> torch.Tensor:
        """The whole global tensor `key` (all its chunks), in its stored dtype."""
        from torch.distributed.checkpoint import load

        if not self.has(key):
            raise CheckpointError(f"{key}: missing from {self.path}")
        m = self.metadata.state_dict_metadata[key]
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": intended
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            load({key: t}, storage_reader=self._reader_cls(self.path), no_dist=True)
        return t
