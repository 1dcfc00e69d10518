"""Skip DeepSpeed's JIT-built shared-memory all-reduce op on the CPU accelerator (deepspeed 0.19.x).

Why: on `DS_ACCELERATOR=cpu`, creating DeepSpeed's comm backend (inside `deepspeed.initialize`) compiles the
C++ op `deepspeed_shm_comm` on first use (minutes on a small CPU box, needs a compiler) and `print`s
"... built successfully" to stdout on every rank, which breaks `dsv3 train`'s one-JSON-object-per-line
stdout. The op only serves `inference_all_reduce`; training collectives go through torch.distributed
(gloo) either way, so marking it incompatible changes no training numerics.

How: DeepSpeed keeps its probed op-compatibility table in `deepspeed.ops.__compatible_ops__` (a module-level
dict it documents as editable: "edits to it persist"); `build_shm_op()` returns None for an op marked False.
Applies only to deepspeed 0.19.x on the CPU accelerator; `revert()` restores the probed value.
"""

from __future__ import annotations

__all__ = ["apply", "revert", "applies"]

_OP = "deepspeed_shm_comm"
_saved: dict = {}


def applies() -> bool:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    return deepspeed.__version__.startswith("0.19.") and get_accelerator().device_name() == "cpu"


def apply() -> bool:
    if not applies():
        return False
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    if _OP in _saved or not table.get(_OP, False):
        return False
    _saved[_OP] = table[_OP]
    table[_OP] = False
    return True


def revert() -> None:
    if _OP in _saved:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[_OP] = _saved.pop(_OP)
