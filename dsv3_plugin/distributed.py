"""Process-group setup shared by every multi-process entry point.

The same code runs under the launchers users already have (`torchrun`, the `deepspeed` launcher: they
set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT) and self-spawned on loopback
(`--nproc N`, via `torch.multiprocessing`), with gloo on CPU and NCCL on GPU.
"""
from __future__ import annotations

import os
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = [
    "launched_externally",
    "free_port",
    "init_distributed",
    "default_backend",
    "spawn",
    "rank",
    "world_size",
]


def launched_externally() -> bool:
    """True under torchrun / the deepspeed launcher (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise the default process group from the environment (idempotent). Returns (rank, world)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if int(os.environ["WORLD_SIZE"]) > 1:
            raise RuntimeError("MASTER_PORT is not set: launch with torchrun/deepspeed or use --nproc")
        os.environ["MASTER_PORT"] = str(free_port())
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _worker(local_rank: int, world: int, port: int, fn: Callable, args: tuple, queue, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    try:
        out = fn(*args)
        # Pickle here: tensors would otherwise travel as shared memory of a process that is about to exit.
        import io
        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((local_rank, "ok", buf.getvalue()))
    except BaseException as e:  # report, then re-raise so the process exits non-zero
        queue.put((local_rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nproc: int, *args: Any, env: dict | None = None,
          timeout_s: float = 600.0) -> list[Any]:
    """Run `fn(*args)` on `nproc` loopback ranks (each sets the torchrun env vars); return results by rank.

    `fn` must be picklable (module level). It should call `init_distributed()` itself, exactly as it
    would under torchrun. A failure on any rank raises here with that rank's traceback.
    """
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, fn, args, queue, env), daemon=False)
             for r in range(nproc)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time
    deadline = time.monotonic() + timeout_s
    while len(results) + len(errors) < nproc:
        if not queue.empty():
            r, status, out = queue.get()
            if status == "ok":
                import io
                results[r] = torch.load(io.BytesIO(out), weights_only=False)  # our own child's result
            else:
                errors.append(f"rank {r}: {out}")
                break
        elif any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
            time.sleep(0.2)
            if queue.empty():
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                errors.append(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                break
        elif time.monotonic() > deadline:
            errors.append(f"timed out after {timeout_s:.0f}s")
            break
        else:
            time.sleep(0.02)
    if errors:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        raise RuntimeError("spawned run failed:\n" + "\n".join(errors))
    for p in procs:
        p.join(30)
    return [results[r] for r in range(nproc)]
