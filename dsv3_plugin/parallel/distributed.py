"""Process-group setup shared by every multi-process entry point.

The same code runs under the launchers users already have (`torchrun`, the `deepspeed` launcher: they
set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT) and self-spawned on loopback
(`--nproc N`, via `torch.multiprocessing`: forks of a forkserver that imported torch once), with gloo on CPU and
NCCL on GPU.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3_plugin.config import ConfigError
from dsv3_plugin.errors import CheckpointError, DataError, PeerError

__all__ = [
    "launched_externally",
    "free_port",
    "init_distributed",
    "default_backend",
    "spawn",
    "first_failure",
    "rank",
    "world_size",
    "set_peer_timeout",
    "peer_timeout",
    "set_group_timeout",
    "new_groups_bounded",
    "peer_failures",
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
    local = int(os.environ["LOCAL_RANK"])
    if backend == "nccl":
        torch.cuda.set_device(local)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    if dist.get_world_size() > 1:
        # Every rank has finished connecting before any rank goes on: a rank that then fails at once (bad input)
        # and exits would otherwise take rank 0's rendezvous store with it while a peer is still connecting, and
        # that peer would fail inside init_process_group, before it could learn that someone else failed first.
        dist.barrier(device_ids=[local] if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size()


_PEER_TIMEOUT: timedelta | None = None  # what set_peer_timeout was last given (None: never called)
# What gloo / NCCL / c10d say when a peer is gone or silent past the group's timeout.
_COMM_FAILURE = re.compile(r"gloo|nccl|timed? ?out|connection (closed|reset|refused)|broken pipe", re.I)


def _member_groups() -> list:
    """Every process group this rank belongs to (the world group and each group created since, by anyone)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {}) or [dist.group.WORLD]


def set_group_timeout(group, timeout: timedelta) -> None:
    """Bound every later operation on `group` by `timeout`."""
    if hasattr(group, "set_timeout"):
        group.set_timeout(timeout)
    else:  # older torch: no ProcessGroup.set_timeout
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def set_peer_timeout(timeout_s: float) -> None:
    """Bound every later operation on every process group this rank belongs to by `timeout_s`: the default
    (world) group, whoever initialised it (`init_distributed`, a launcher, a test), and every group created
    before this call (by this package or by DeepSpeed; e.g. groups cached by an earlier run in this process).
    A dead or stopped peer then fails the waiting rank instead of hanging it.

    Groups created later need the value too: torch gives a group created without `timeout=` its backend's
    default (30 minutes on gloo, 10 on NCCL), not the world group's. This package's own `dist.new_group` calls
    pass `timeout=peer_timeout()` (or the config's value); wrap calls into a library that creates groups
    (`deepspeed.initialize`) in `new_groups_bounded`."""
    global _PEER_TIMEOUT
    if not (dist.is_available() and dist.is_initialized()):
        return
    _PEER_TIMEOUT = timedelta(seconds=timeout_s)
    for g in _member_groups():
        set_group_timeout(g, _PEER_TIMEOUT)


def peer_timeout() -> timedelta | None:
    """The limit `set_peer_timeout` set in this process (None if it was never called): the `timeout=` to give
    `dist.new_group`."""
    return _PEER_TIMEOUT


@contextlib.contextmanager
def new_groups_bounded(timeout_s: float | None):
    """Every process group created inside the block (e.g. by `deepspeed.initialize`: its clone of the world
    group for ZeRO, its expert-parallel / expert-data-parallel groups) gets `timeout_s` (None: no change)."""
    if timeout_s is None or not (dist.is_available() and dist.is_initialized()):
        yield
        return
    before = {id(g) for g in _member_groups()}
    try:
        yield
    finally:
        for g in _member_groups():
            if id(g) not in before:
                set_group_timeout(g, timedelta(seconds=timeout_s))


@contextlib.contextmanager
def peer_failures(
    op: str, timeout_s: float, ranks: list[int] | None = None, limit_name: str = "parallel.p2p_timeout_s"
):
    """Turn a communication failure inside the block (gloo: "Timed out waiting ...ms", "Connection closed by
    peer"; NCCL: the watchdog's error) into a `PeerError` naming the operation, the ranks and the limit;
    any other exception passes unchanged."""
    try:
        yield
    except PeerError:
        raise
    except RuntimeError as e:  # torch.distributed's DistBackendError and gloo's errors are RuntimeErrors
        if not (isinstance(e, getattr(dist, "DistError", ())) or _COMM_FAILURE.search(str(e))):
            raise  # not a communication failure: leave it as it is
        first = (str(e).splitlines() or [""])[0][:300]
        me = dist.get_rank() if dist.is_initialized() else 0
        over = f" over global ranks {ranks}" if ranks is not None else ""
        raise PeerError(
            f"global rank {me}: {op}{over} failed (peer dead, or silent longer than {limit_name} = "
            f"{timeout_s:g}s): {type(e).__name__}: {first}"
        ) from e


def _is_input_error(e: BaseException) -> bool:
    """ConfigError / CheckpointError / DataError: bad user input, reported as one line and exit code 2
    (docs/architecture.md)."""
    return isinstance(e, (ConfigError, CheckpointError, DataError))


def first_failure(code: int) -> tuple[bool, int]:
    """For a rank of an externally launched job that is about to exit with `code`: (whether it is the first rank
    of the job to fail, the exit code to use). A counter in the process group's store picks the first, so that
    a failure every rank runs into is reported once; the others exit quietly with the first one's code (a peer
    that dies makes the others fail in their next collective, and the launcher reports whichever exit it sees
    first). Under torchrun the store lives in the agent; under the deepspeed launcher in rank 0's process — if
    that is gone, rank 0 failed first and reported, so this rank stays quiet. Without a process group:
    (True, code)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True, code
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)  # a store whose host is gone makes c10d log a C++ stack trace: not this rank's news
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=10))
        if store.add("dsv3/failed_ranks", 1) == 1:
            store.set("dsv3/exit_code", str(code))
            return True, code
        return False, int(store.get("dsv3/exit_code"))
    except Exception:
        import time

        time.sleep(5)  # the first failure's process is gone: let the launcher see its exit code first
        return False, code
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)


def _die_with_parent(parent_pid: int) -> None:
    """Kill this rank as soon as the spawning process `parent_pid` is gone (kill -9 included), so that no rank
    outlives it holding a run directory's lock or a port. A daemon thread waits on the process (Linux: a pidfd,
    no polling; elsewhere: a check per second). NOTE: not PR_SET_PDEATHSIG: a rank's parent is the forkserver,
    and the forkserver outlives the spawning process as long as a rank is alive."""
    import select
    import signal
    import threading
    import time

    def watch():
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):  # no pidfd here, or the process is already gone
            fd = None
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while True:
                try:
                    os.kill(parent_pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:  # alive, owned by someone else: cannot be our spawner, which is gone
                    break
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dsv3-die-with-spawner", daemon=True).start()


class _Stdio:
    """The spawning process's stdout / stderr (file descriptors 1 and 2 at `spawn` time) for a rank: a forkserver's
    child would otherwise inherit the forkserver's, i.e. whatever they were when the forkserver started (e.g. an
    earlier test's capture)."""

    def __reduce__(self):  # called while the rank's Process is pickled: the fds travel with it
        from multiprocessing import reduction

        return _adopt_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_stdio(out, err) -> None:
    for wrapped, target in ((out, 1), (err, 2)):
        fd = wrapped.detach()
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _worker(
    local_rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    queue,
    env: dict,
    parent_pid: int | None = None,
    stdio: Any = None,
) -> None:
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        # the forkserver imported torch with the spawning process's environment: apply this rank's thread count
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    code = 0
    try:
        out = fn(*args)
        # Pickle here: tensors would otherwise travel as shared memory of a process that is about to exit.
        import io

        buf = io.BytesIO()
        torch.save(out, buf)
        queue.put((local_rank, "ok", buf.getvalue()))
    except BaseException as e:
        # Report to the parent and exit without printing: the parent prints the one message that matters
        # (a rank's traceback printed here would repeat on every rank that hit the same input).
        if _is_input_error(e):
            queue.put((local_rank, "input", (type(e).__name__, str(e))))
            code = 2
        elif isinstance(e, PeerError):  # the message says it all: which wait, on whom, and the limit
            queue.put((local_rank, "peer", f"{type(e).__name__}: {e}"))
            code = 1
        else:
            queue.put((local_rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            code = 1
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass
    if code:
        import sys

        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: threads of a broken process group can block it


def _input_error(name: str, message: str) -> ValueError:
    return {"ConfigError": ConfigError, "CheckpointError": CheckpointError, "DataError": DataError}[name](message)


# What the forkserver imports once, so that each rank starts as a fork of it instead of a fresh interpreter that
# imports torch again (~1 s of CPU per rank). Nothing else: a module that reads the environment when imported would
# see the spawning process's, not the rank's.
_PRELOAD = ["torch", "torch.distributed"]


def _context():
    """Ranks start from a forkserver that preloaded torch (Unix); elsewhere as fresh interpreters ("spawn"). Never
    "fork": a fork of the caller would copy its threads' state (OpenMP pool, gloo) and its CUDA context."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def spawn(
    fn: Callable[..., Any], nproc: int, *args: Any, env: dict | None = None, timeout_s: float = 600.0
) -> list[Any]:
    """Run `fn(*args)` on `nproc` loopback ranks (each sets the torchrun env vars); return results by rank.

    `fn` must be picklable (module level). It should call `init_distributed()` itself, exactly as it
    would under torchrun. Ranks print no tracebacks of their own. A `ConfigError` / `CheckpointError` on any
    rank is raised here again (same type and message, once, whichever rank found it first); any other failure
    raises `RuntimeError` with that rank's traceback (a `PeerError`, a peer dead or silent past the timeout:
    with its message only, and only if no rank failed otherwise). The other ranks are stopped.
    """
    import time

    port = free_port()
    ctx = _context()
    queue = ctx.SimpleQueue()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, fn, args, queue, env, os.getpid(), _Stdio()), daemon=False)
        for r in range(nproc)
    ]
    results: dict[int, Any] = {}
    done = False
    try:
        for p in procs:
            p.start()
        failures: list[tuple[int, str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while len(results) < nproc and not failures:
            if not queue.empty():
                r, status, out = queue.get()
                if status == "ok":
                    import io

                    results[r] = torch.load(io.BytesIO(out), weights_only=False)  # our own child's result
                else:
                    failures.append((r, status, out))
            elif any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.2)
                if queue.empty():
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    failures.append(
                        (dead[0], "error", f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                    )
            elif time.monotonic() > deadline:
                failures.append((-1, "error", f"timed out after {timeout_s:.0f}s"))
            else:
                time.sleep(0.02)
        if failures:
            # Other ranks often fail right after the first (same bad input, or a peer gone from a collective):
            # give them a moment so that an input error wins over the broken-pipe errors it causes.
            grace = time.monotonic() + 1.0
            while time.monotonic() < grace and any(p.is_alive() for p in procs):
                while not queue.empty():
                    r, status, out = queue.get()
                    if status != "ok":
                        failures.append((r, status, out))
                time.sleep(0.05)
            while not queue.empty():
                r, status, out = queue.get()
                if status != "ok":
                    failures.append((r, status, out))
            first_input = next((f for f in failures if f[1] == "input"), None)
            if first_input is not None:
                raise _input_error(*first_input[2])
            # a rank's own failure (a bug, a death) before the peer errors it causes on the others
            r, _, out = min(failures, key=lambda f: f[1] == "peer")
            raise RuntimeError(f"spawned run failed:\nrank {r}: {out}" if r >= 0 else f"spawned run failed: {out}")
        done = True
    finally:  # also on KeyboardInterrupt: no rank outlives the call
        for p in procs:
            if p.pid is not None and not done and p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(30 if done else 5)
    return [results[r] for r in range(nproc)]
