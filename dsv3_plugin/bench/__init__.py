"""Benches for `dsv3 bench NAME` (one module each; see `dsv3_plugin.cli.bench`)."""

import os
import platform

__all__ = ["env_facts", "positive_int"]


def env_facts() -> dict:
    import torch

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.is_available(),
    }


def positive_int(text: str) -> int:
    """argparse type for sizes and counts: a bad value is a usage error (exit 2) naming the flag."""
    import argparse

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (got {text!r})") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {v})")
    return v
