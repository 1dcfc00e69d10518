"""Benches for `dsv3 bench NAME` (one module each; see `dsv3_plugin.cli.bench`)."""
import os
import platform

__all__ = ["env_facts"]


def env_facts() -> dict:
    import torch
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "cuda": torch.cuda.is_available()}
