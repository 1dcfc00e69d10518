"""Megatron-Core process setup for scripts and tests: torch.distributed (gloo on CPU, NCCL on GPU), the CPU shims
when there is no GPU, Megatron's model-parallel groups and RNG seeds; and teardown in reverse order.

Works self-spawned (`dsv3_plugin.parallel.distributed.spawn`) and under torchrun (RANK/WORLD_SIZE/... from the env).
"""

from __future__ import annotations

import torch

from dsv3_plugin.parallel.distributed import init_distributed

__all__ = ["init_megatron", "shutdown_megatron", "wrap_ddp"]


def _cpu_patch():
    from dsv3_plugin_patches import megatron_cpu

    return megatron_cpu


def init_megatron(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234) -> tuple[int, int]:
    """Initialize distributed + Megatron parallel state; returns (rank, world)."""
    rank, world = init_distributed()
    if not torch.cuda.is_available():
        _cpu_patch().apply()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
        )
    model_parallel_cuda_manual_seed(seed)
    return rank, world


def shutdown_megatron() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if not torch.cuda.is_available():
        _cpu_patch().revert()


def wrap_ddp(model, **ddp_overrides):
    """Megatron's DistributedDataParallel (what `finalize_model_grads` expects), fp32 grads, plain all-reduce."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        **{
            "grad_reduce_in_fp32": True,
            "overlap_grad_reduce": False,
            "use_distributed_optimizer": False,
            **ddp_overrides,
        }
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
