"""Every rank's RNG states in a checkpoint, so that a resumed run draws what an uninterrupted one draws.

Framework-neutral: the DeepSpeed engine hooks and the pipelined engine store `gather_rng_states()` under their
checkpoint's `client_state["dsv3"]` and call `restore_rng_state` on load.
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from dsv3_plugin.errors import CheckpointError

__all__ = ["gather_rng_states", "restore_rng_state"]


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def gather_rng_states() -> dict:
    """Every rank's RNG states, for a checkpoint written by one rank.

    Returns:
        {"world_size": int, "rng": [per rank: {"torch", "python"[, "cuda"]}]}. Collective when torch.distributed
        is initialised (DeepSpeed writes client_state from one rank per model file only).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rngs = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(rngs, _rng_state())
    else:
        rngs[0] = _rng_state()
    return {"world_size": world, "rng": rngs}


def restore_rng_state(st: dict, path: str) -> None:
    """Set this rank's RNG states from what `gather_rng_states` saved.

    Args:
        st: the saved {"world_size", "rng"} record.
        path: the checkpoint, named in the error.

    Raises:
        CheckpointError: the world size differs (per-rank RNG and ZeRO-1 partitions need the same layout).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if st.get("world_size") != world:
        raise CheckpointError(
            f"{path}: saved with {st.get('world_size')} ranks, resuming on {world}; per-rank RNG "
            "and ZeRO-1 optimizer partitions need the same data-parallel size"
        )
    rng = st["rng"][dist.get_rank() if dist.is_initialized() else 0]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
