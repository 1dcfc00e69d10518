"""Let Megatron's `pretrain()` use the dataset helpers the megatron-core wheel ships already compiled.

`megatron.training.initialize._compile_dependencies` runs `make -C <site-packages>/megatron/core/datasets` on rank 0
and exits the process when it fails. The megatron-core 0.19 wheel ships `helpers_cpp` compiled but no Makefile, so
`make` fails and `pretrain()` ends with "Failed to compile the C++ dataset helper functions" on CPU and GPU alike.
`apply()` replaces that function with one that only compiles when `helpers_cpp` does not import (a source
checkout), keeping Megatron's barrier. Version-guarded; `revert()` restores the original.
"""

from __future__ import annotations

__all__ = ["TESTED_VERSIONS", "apply", "revert", "is_applied"]

TESTED_VERSIONS = ("0.19.2",)
_saved = None


def is_applied() -> bool:
    return _saved is not None


def _compile_dependencies_if_missing():
    import torch

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        if torch.distributed.get_rank() == 0:
            from megatron.core.datasets.utils import compile_helpers

            compile_helpers()
    torch.distributed.barrier()


def apply(force: bool = False) -> bool:
    """Install (on any device). Returns True if installed now or already."""
    global _saved
    if _saved is not None:
        return True
    from megatron.core.package_info import __version__

    v = __version__.split("+")[0]  # without the "+<git hash>" megatron-core adds inside a git checkout
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"dsv3_plugin_patches.megatron_dataset_helpers: megatron-core {v} is untested (tested: "
            f"{', '.join(TESTED_VERSIONS)}); refusing to patch it (force=True to try anyway)"
        )
    import megatron.training.initialize as init

    _saved = init._compile_dependencies
    init._compile_dependencies = _compile_dependencies_if_missing
    return True


def revert() -> None:
    global _saved
    if _saved is None:
        return
    import megatron.training.initialize as init

    init._compile_dependencies = _saved
    _saved = None
