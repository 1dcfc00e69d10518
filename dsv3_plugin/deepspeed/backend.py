"""Importing DeepSpeed (an optional dependency, imported only when the adapter runs) and taming its logging.

DeepSpeed picks its accelerator when it is imported, so the CPU choice (`DS_ACCELERATOR=cpu` when CUDA is absent)
must be made before the first `import deepspeed`; every module of this adapter imports it through here.
"""

from __future__ import annotations

import os

import torch

__all__ = ["import_deepspeed", "quiet_deepspeed_logs"]


def import_deepspeed():
    """`import deepspeed`, set up for this machine (CPU accelerator without CUDA, our small CPU patch) and with its
    checkpoint loads restricted to `torch.load(weights_only=True)` (`dsv3_plugin_patches.deepspeed_safe_load`)."""
    if not torch.cuda.is_available():
        # DeepSpeed picks its accelerator at import time; without CUDA it must be told to use the CPU one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from dsv3_plugin_patches import deepspeed_muon_import, deepspeed_safe_load, deepspeed_shm_comm

    deepspeed_shm_comm.apply()  # CPU: no JIT build of an inference-only op, no print on stdout
    deepspeed_muon_import.apply()  # an AdamW engine does not import Muon (and torch._inductor with it)
    deepspeed_safe_load.apply()  # checkpoints read with torch.load(weights_only=True): no unpickling of code
    return deepspeed


def quiet_deepspeed_logs(level: int | None = None) -> None:
    """Send DeepSpeed's log lines to stderr (its handler writes to stdout, which `dsv3 train` keeps for JSON)."""
    import logging
    import sys

    import_deepspeed()
    from deepspeed.utils import logger

    for h in logger.handlers:
        if isinstance(h, logging.StreamHandler):
            h.setStream(sys.stderr)
    logger.setLevel(level if level is not None else logging.WARNING)
