"""Runtime shims that let megatron-core's own training loop (`megatron.training.pretrain`) run on CPU with gloo.

For CI and laptops only: `apply()` does nothing (returns False) when CUDA is available. It builds on
`patches/megatron_cpu.py` (model, optimizer, DDP; apply that first). Importing this module changes nothing;
`apply()` / `revert()` restore the exact original objects. Tested with megatron-core 0.19.2 (the first wheel that
ships `megatron.training`); other versions are refused with a message naming the version (`force=True` overrides).
Patched: `initialize_megatron` (allow_no_cuda), the model-parallel groups and RNG seeding Megatron skips without
a GPU, `torch.cuda.get_rng_state` / `set_rng_state`, `torch.cuda.memory_stats` (the process's resident memory,
for `--log-memory-to-tensorboard`), the torch_dist writer's results queue of a synchronous save (in-process, not a
spawned Manager); `cuda_literals_on_cpu()` wraps the `pretrain()` call.

What each shim does and why: docs/design_notes.md#patches-megatron-training-cpu
"""

from __future__ import annotations

import contextlib
import functools
import queue

import torch

__all__ = ["TESTED_VERSIONS", "apply", "revert", "is_applied", "cuda_literals_on_cpu"]

TESTED_VERSIONS = ("0.19.2",)
_saved: dict | None = None


def is_applied() -> bool:
    return _saved is not None


def _init_model_parallel_like_megatron(args, get_embedding_ranks=None, get_position_embedding_ranks=None):
    """The `initialize_model_parallel` call of `megatron.training.initialize._initialize_distributed` (0.19.2)."""
    from datetime import timedelta  # noqa: F401  (Megatron passes minutes)

    from megatron.core import mpu

    mpu.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=args.pipeline_model_parallel_comm_backend,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-dp-pp" if not args.use_tp_pp_dp_mapping else "tp-cp-ep-pp-dp",
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        create_gloo_process_groups=args.use_gloo_process_groups,
    )


def _wrap_initialize_distributed(orig):
    @functools.wraps(orig)
    def wrapper(get_embedding_ranks, get_position_embedding_ranks, store, skip_model_parallel_init=False):
        orig(
            get_embedding_ranks, get_position_embedding_ranks, store, skip_model_parallel_init=skip_model_parallel_init
        )
        from megatron.core import mpu
        from megatron.training import get_args

        if not skip_model_parallel_init and not mpu.model_parallel_is_initialized():
            _init_model_parallel_like_megatron(get_args(), get_embedding_ranks, get_position_embedding_ranks)

    return wrapper


def _wrap_set_random_seed(orig):
    @functools.wraps(orig)
    def wrapper(seed_, data_parallel_random_init=False, *args, **kwargs):
        orig(seed_, data_parallel_random_init, *args, **kwargs)
        from megatron.core import mpu, tensor_parallel

        seed = seed_ + 100 * mpu.get_pipeline_model_parallel_rank()
        if data_parallel_random_init:
            seed += 10 * mpu.get_data_parallel_rank()
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    return wrapper


def _cpu_get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _cpu_memory_stats(device=None) -> dict:
    """The keys of `torch.cuda.memory_stats()` Megatron's `training_log` reads (`--log-memory-to-tensorboard`), with
    the CPU process's figures: reserved and allocated = its resident set size (torch's CPU allocator returns freed
    blocks to the C heap: there is no cache to tell apart), peak = the peak resident set size. NOTE: the CPU
    allocator counts no live allocations; `allocation.all.current` is 0, not a count."""
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {
        "reserved_bytes.all.current": rss,
        "allocated_bytes.all.current": rss,
        "allocated_bytes.all.peak": max(peak, rss),
        "allocation.all.current": 0,
    }


_SYNC_RESULTS: queue.Queue | None = None


def _wrap_results_queue(orig):
    """Without `--async-save` the torch_dist writer runs in the saving process, so its results can travel through an
    in-process queue; Megatron's default, a `spawn` Manager, starts a fresh interpreter per rank that re-imports the
    launch module (~6 s of CPU a rank on the first save). With `--async-save` (another process writes): Megatron's."""

    @functools.wraps(orig)
    def wrapper(mp_mode: str = "spawn"):
        global _SYNC_RESULTS
        from megatron.training.global_vars import get_args

        try:
            async_save = get_args().async_save
        except AssertionError:  # Megatron's args not parsed: not a pretrain() save, Megatron's own queue
            return orig(mp_mode)
        if async_save:
            return orig(mp_mode)
        if _SYNC_RESULTS is None:
            _SYNC_RESULTS = queue.Queue()
        return _SYNC_RESULTS

    return wrapper


def apply(force: bool = False) -> bool:
    """Install the shims. Returns True if installed now or already, False when CUDA is available."""
    global _saved
    if torch.cuda.is_available():
        return False
    if _saved is not None:
        return True
    from megatron.core.package_info import __version__

    v = __version__.split("+")[0]  # without the "+<git hash>" megatron-core adds inside a git checkout
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"dsv3_plugin_patches.megatron_training_cpu: megatron-core {v} is untested (tested: "
            f"{', '.join(TESTED_VERSIONS)}); refusing to patch it (force=True to try anyway)"
        )
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    import megatron.training.initialize as init
    import megatron.training.training as tr

    _saved = {
        (fs_async, "get_write_results_queue"): fs_async.get_write_results_queue,
        (tr, "initialize_megatron"): tr.initialize_megatron,
        (init, "_initialize_distributed"): init._initialize_distributed,
        (init, "_set_random_seed"): init._set_random_seed,
        (torch.cuda, "get_rng_state"): torch.cuda.get_rng_state,
        (torch.cuda, "set_rng_state"): torch.cuda.set_rng_state,
        (torch.cuda, "memory_stats"): torch.cuda.memory_stats,
    }
    tr.initialize_megatron = functools.partial(_saved[(tr, "initialize_megatron")], allow_no_cuda=True)
    init._initialize_distributed = _wrap_initialize_distributed(_saved[(init, "_initialize_distributed")])
    init._set_random_seed = _wrap_set_random_seed(_saved[(init, "_set_random_seed")])
    torch.cuda.get_rng_state = _cpu_get_rng_state
    torch.cuda.set_rng_state = _cpu_set_rng_state
    torch.cuda.memory_stats = _cpu_memory_stats
    fs_async.get_write_results_queue = _wrap_results_queue(_saved[(fs_async, "get_write_results_queue")])
    return True


def revert() -> None:
    global _saved
    if _saved is None:
        return
    for (owner, attr), orig in _saved.items():
        setattr(owner, attr, orig)
    _saved = None


@contextlib.contextmanager
def cuda_literals_on_cpu():
    """Run the enclosed code (Megatron's `pretrain()`) with `device="cuda"` allocations made on CPU."""
    from dsv3_plugin_patches.megatron_cpu import _CudaLiteralsOnCPU

    with _CudaLiteralsOnCPU():
        yield
