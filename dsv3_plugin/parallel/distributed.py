"""Process-group setup shared by every multi-process entry point.

The same code runs under the launchers users already have (`torchrun`, the `deepspeed` launcher: they
set RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT) and self-spawned on loopback
(`--nproc N`, via `torch.multiprocessing`: forks of a forkserver that imported torch and the rank's module once;
`shared_forkserver` keeps one for many calls), with gloo on CPU and NCCL on GPU.

When a rank dies (issue 27, point 2): the others fail in their next wait on it (at once when its connections
close; within `parallel.p2p_timeout_s` otherwise) and `peer_failures` names the dead rank after a roll call through
the job's store (`ROLL_CALL_S`); `spawn` names it from its exit status ("rank 1 was killed by SIGKILL (signal
9)"), and leaves no process behind: no rank, forkserver or resource tracker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv3_plugin.config import ConfigError
from dsv3_plugin.errors import CheckpointError, DataError, PeerError, Preempted

__all__ = [
    "launched_externally",
    "free_port",
    "init_distributed",
    "default_backend",
    "spawn",
    "shared_forkserver",
    "first_failure",
    "rank",
    "world_size",
    "set_peer_timeout",
    "peer_timeout",
    "set_group_timeout",
    "new_groups_bounded",
    "peer_failures",
    "ROLL_CALL_S",
]


def launched_externally() -> bool:
    """True under torchrun / the deepspeed launcher (they export RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (connect(), bind to port 0); Linux's default if unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port that is free now, chosen OUTSIDE the kernel's ephemeral range.

    Why: the port is bound only later, by rank 0 or the launcher (seconds, after imports). A port the kernel handed
    out for bind(0) returns to its ephemeral pool on close, and every gloo connection made meanwhile (other jobs,
    other test workers) draws from that pool: the rendezvous then fails with EADDRINUSE. Ports below the range are
    never handed out by the kernel; a random one that binds now is taken only by another explicit choice.
    """
    import random

    lo, _ = _ephemeral_range()
    first = 10000 if lo > 11000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(first, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded machine: the kernel's choice
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
        _publish_process(dist.distributed_c10d._get_default_store(), dist.get_rank())  # for a peer's roll call
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


# --- Who is gone: the roll call ------------------------------------------------------------------------------

# How long a rank that caught a communication failure waits for the other ranks to answer the roll call before it
# names the silent ones. Not a machine figure: the ranks that see the same broken connection get here within
# milliseconds of each other (the kernel closes a dead process's sockets at once), so the wait only has to cover
# a Python exception unwinding and one store round trip per rank on a host whose cores are shared with other
# jobs; 5 s is that with two orders of magnitude to spare, and short next to any `parallel.p2p_timeout_s` one
# would set (the roll call never waits longer than that limit). A dead rank on this rank's own host is named at
# once, without waiting (its process is looked up, see `_roll_call`).
ROLL_CALL_S = 5.0
_ROLL_CALLED: list = []  # the default process group this process last took a roll call in (once per group)
_PROC_KEY = "dsv3/procs/"  # + this host's key: "rank:pid:start time," of every rank whose process runs there


def _host_key() -> str | None:
    """What identifies the pid namespace this process runs in (Linux: the kernel's boot id and the namespace's
    inode): two processes with the same key see each other's pids. None where there is no /proc."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}.{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _publish_process(store, me: int) -> None:
    """Record this rank's pid under its host's key in the job's store, for the roll call of a peer on the same
    host (`_roll_call`). Without /proc, or with a store that cannot append (torch's TCPStore, which torchrun, the
    deepspeed launcher and `spawn` use, can), there is no record, and a dead peer is named by the roll call's
    wait alone."""
    import psutil

    here = _host_key()
    if here is None:
        return
    try:
        store.append(_PROC_KEY + here, f"{me}:{os.getpid()}:{psutil.Process().create_time()!r},")
    except NotImplementedError:
        pass


def _ended(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` (psutil's create_time) has ended (or is a zombie)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) > 0.05 or p.status() == psutil.STATUS_ZOMBIE  # pid reused, or dead
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # alive, owned by someone else
        return False


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 goes to /dev/null inside the block: a store whose host is gone makes c10d log a C++ stack
    trace, which is not this rank's news."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)


def _ranks_text(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank {shown} is" if len(ranks) == 1 else f"ranks {shown} are"


def _agent_store() -> bool:
    """Whether the default group's store is served by torchrun's agent (it hands its own store to the workers:
    TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 serves it (the deepspeed launcher, `spawn`, torchrun without
    an agent store: init_process_group's env:// TCPStore runs in rank 0's process)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def _store_host() -> str:
    """Who is gone when the default group's store does not answer: the process that served it."""
    if _agent_store():
        return "torchrun's agent (the job's store lives there) is gone"
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return f"rank 0 is gone (it served the job's store at {where}, which does not answer)"


def _roll_call(wait_s: float) -> str:
    """Which peers are gone, asked of every rank through the default group's store after a communication failure.

    Every rank that gets here registers under this roll call's key and waits up to `wait_s` for the others. Ranks
    that neither registered nor still run are named: a peer on this host (same pid namespace, see `_host_key`)
    whose process has ended is named at once ("rank 1 is gone (process 4711 ended)"); otherwise, after
    `wait_s`, the ranks that never answered ("rank 1 is gone or stuck (no answer to the roll call within 5s)":
    dead, stopped, or in a wait of its own). A rank that answered and then exited is a survivor, not the cause.
    If the store itself does not answer, its host is named (`_store_host`); rank 0, when it serves the store,
    stays up to `wait_s` more, until every rank not gone has taken its roll call.

    Once per process group: every rank takes part in one roll call (at its first failure), under the same keys
    in the group's store; a later call returns "".

    Returns:
        The clause naming them; "" when every rank answered (the failure was not a peer's death), without a
        process group, or after this rank's roll call.
    """
    import time

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return ""
    group = dist.distributed_c10d._get_default_group()
    if _ROLL_CALLED and _ROLL_CALLED[0] is group:
        return ""  # this rank took its roll call already (an inner block's failure, now passing an outer block)
    _ROLL_CALLED[:] = [group]
    me, world = dist.get_rank(), dist.get_world_size()
    key = "dsv3/roll_call/"  # + rank: one roll call per group, in the group's own store
    here = _host_key()
    with _quiet_stderr():
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=max(wait_s, 1.0)))  # one store operation's limit, not the wait's
            store.set(key + str(me), "here")
            store.add(key + "count", 1)
            local: dict[int, tuple[int, float]] = {}  # the peers on this host: rank -> (pid, start time)
            if here is not None and store.check([_PROC_KEY + here]):
                for item in store.get(_PROC_KEY + here).decode().split(","):
                    if item and int(item.split(":")[0]) != me:
                        r, pid, started = item.split(":")
                        local[int(r)] = (int(pid), float(started))
            # One store operation per poll (the count), whatever the world size; the pids looked up locally.
            deadline = time.monotonic() + wait_s
            while True:
                answered = store.add(key + "count", 0)
                ended = [r for r in sorted(local) if _ended(*local[r]) and not store.check([key + str(r)])]
                if ended or answered >= world or time.monotonic() >= deadline:
                    break
                time.sleep(0.1)
            missing = [] if ended else [r for r in range(world) if r != me and not store.check([key + str(r)])]
            store.add(key + "done", 1)
            if me == 0 and not _agent_store():
                # This process serves the store: stay until every rank that is not gone has taken its roll call
                # (at most `wait_s` more), so that none of them finds the store gone and names this rank instead.
                until = time.monotonic() + wait_s
                while time.monotonic() < until:
                    n = store.add(key + "count", 0)
                    if n >= world - len(ended) - len(missing) and store.add(key + "done", 0) >= n:
                        break
                    time.sleep(0.05)
        except Exception:  # torch raises its own error types for a store that is gone (DistStoreError, ...)
            return _store_host()
    if ended:
        pids = ", ".join(str(local[r][0]) for r in ended)
        return f"{_ranks_text(ended)} gone (process{'es' if len(ended) > 1 else ''} {pids} ended)"
    if missing:
        return f"{_ranks_text(missing)} gone or stuck (no answer to the roll call within {wait_s:g}s)"
    return ""


@contextlib.contextmanager
def peer_failures(
    op: str, timeout_s: float, ranks: list[int] | None = None, limit_name: str = "parallel.p2p_timeout_s"
):
    """Turn a communication failure inside the block (gloo: "Timed out waiting ...ms", "Connection closed by
    peer"; NCCL: the watchdog's error) into a `PeerError` naming the operation, the ranks, the limit and, after a
    roll call of the ranks through the job's store (`_roll_call`, at most `min(ROLL_CALL_S, timeout_s)`), the
    ranks that are gone; a `PeerError` from inside (e.g. a pipeline receive's) gets the roll call's answer
    appended; any other exception passes unchanged."""
    try:
        yield
    except PeerError as e:  # a lower layer's (the pipeline's p2p waits): the ranks that are gone added, once
        gone = _roll_call(min(ROLL_CALL_S, timeout_s))
        if gone:
            e.args = (f"{e}; {gone}",)
        raise
    except RuntimeError as e:  # torch.distributed's DistBackendError and gloo's errors are RuntimeErrors
        if not (isinstance(e, getattr(dist, "DistError", ())) or _COMM_FAILURE.search(str(e))):
            raise  # not a communication failure: leave it as it is
        first = (str(e).splitlines() or [""])[0][:300]
        me = dist.get_rank() if dist.is_initialized() else 0
        over = f" over global ranks {ranks}" if ranks is not None else ""
        gone = _roll_call(min(ROLL_CALL_S, timeout_s))
        raise PeerError(
            f"global rank {me}: {op}{over} failed (peer dead, or silent longer than {limit_name} = {timeout_s:g}s): "
            f"{gone + '. ' if gone else ''}{type(e).__name__}: {first}"
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
    with _quiet_stderr():
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


# --- Self-spawned ranks ----------------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    """Kill this rank as soon as the spawning process `parent_pid` is gone (kill -9 included), so that no rank
    outlives it holding a run directory's lock or a port. A daemon thread waits on the process (Linux: a pidfd,
    no polling; elsewhere: a check per second). NOTE: not PR_SET_PDEATHSIG: a rank's parent is the forkserver,
    not the spawning process."""
    import select
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


# Blocked while `spawn` starts the forkserver and multiprocessing's resource tracker, so that both inherit them
# blocked: a scheduler's SIGTERM / SIGUSR1 to the whole process group must reach the ranks and the spawning
# process (which forwards it, `spawn(forward_signals=...)`), not kill the forkserver, through which the spawning
# process learns each rank's exit status (a dead forkserver reports every rank as exit 255), nor the tracker. Both
# end anyway when the spawning process closes their pipes. Ranks unblock them first thing (`_worker`).
_HELPER_BLOCKED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})


def _worker(
    local_rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    conn,
    env: dict,
    parent_pid: int | None = None,
    stdio: Any = None,
    caller_env: dict | None = None,
    module_file: str | None = None,
) -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELPER_BLOCKED)  # inherited blocked from the forkserver
    if parent_pid is not None:
        _die_with_parent(parent_pid)
    if caller_env is not None:  # a shared forkserver (`shared_forkserver`): its environment is from its own start
        for k in set(os.environ) - set(caller_env):
            del os.environ[k]
        os.environ.update(caller_env)
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
    code, exit_now = 0, False

    def report(status: str, payload: Any) -> None:
        try:
            conn.send((local_rank, status, payload))
        except OSError:  # the spawning process is gone: this rank is about to be killed (`_die_with_parent`)
            pass

    try:
        if module_file is not None and getattr(sys.modules.get(fn.__module__), "__file__", None) != module_file:
            raise RuntimeError(  # the forkserver found another copy of it (`_rank_module`)
                f"{fn.__module__} is {sys.modules[fn.__module__].__file__} in the ranks, {module_file} in the "
                "spawning process: put the package on PYTHONPATH (or install it) rather than on sys.path at run time"
            )
        out = fn(*args)
        # Pickle here: tensors would otherwise travel as shared memory of a process that is about to exit.
        import io

        buf = io.BytesIO()
        torch.save(out, buf)
        report("ok", buf.getvalue())
    except Preempted as e:  # stopped on request after saving: a status, not a failure
        report("preempted", (e.exit_code, str(e)))
        code, exit_now = e.exit_code, True
    except KeyboardInterrupt:  # SIGINT before the run handles it (start-up): the user's Ctrl-C, not a bug
        report("interrupted", None)
        code, exit_now = 130, True
    except BaseException as e:
        # Report to the parent and exit without printing: the parent prints the one message that matters
        # (a rank's traceback printed here would repeat on every rank that hit the same input).
        if _is_input_error(e):
            report("input", (type(e).__name__, str(e)))
            code = 2
        elif isinstance(e, PeerError):  # the message says it all: which wait, on whom, and the limit
            report("peer", f"{type(e).__name__}: {e}")
            code = 1
        else:
            report("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            code = 1
        exit_now = True
    finally:
        conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a peer already gone: nothing left to tear down cleanly
                pass
    if exit_now:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: threads of a broken process group can block it


def _input_error(name: str, message: str) -> ValueError:
    return {"ConfigError": ConfigError, "CheckpointError": CheckpointError, "DataError": DataError}[name](message)


# What the forkserver imports once, so that each rank starts as a fork of it instead of a fresh interpreter that
# imports torch again (~1 s of CPU per rank). Nothing else: a module that reads the environment when imported would
# see the spawning process's, not the rank's.
_PRELOAD = ["torch", "torch.distributed"]


def _rank_module(fn: Callable) -> tuple[str, ...]:
    """The module of `fn`, for a new forkserver to import once instead of every rank: a rank imports it anyway while
    it unpickles `fn`, before `_worker` runs, in the server's environment (the caller's), so the rank gets the same
    module either way. Only this package's modules (the server finds them where the caller did: installed or on
    PYTHONPATH, not on a path the caller added at run time), and only while CUDA is not initialised here: an import
    that initialised it in the server would break the forks, and one that did not here will not there."""
    name = getattr(fn, "__module__", None) or ""
    if not name.startswith("dsv3_plugin.") or torch.cuda.is_initialized():
        return ()
    return (name,)


class _Helpers:
    """The forkserver (Unix; elsewhere ranks start as fresh interpreters, "spawn") and the resource tracker it
    starts, each stopped by `stop` if `start` started it: nothing of a `spawn` call outlives it (issue 27: no fork
    server or resource tracker left behind). Never "fork": a fork of the caller would copy its threads' state
    (OpenMP pool, gloo) and its CUDA context.

    Cost, measured on a 2-core machine shared with other jobs: a fresh forkserver imports torch once more per call
    (1.9 s of CPU); 5 calls of `spawn` with 2 ranks that join a group took 2.7-3.6 s each, against 0.5-0.9 s
    with one forkserver kept warm across the calls (the first call pays for it either way). `dsv3 train` spawns
    once per process, so only callers that spawn many times in one process (the tests) pay it; the alternative,
    two processes per calling process left running until it exits, is what issue 27 rules out unless the caller
    asks for it (`shared_forkserver`). A forkserver already running when `spawn` is called (someone else's, or
    `shared_forkserver`'s) is used and left running."""

    def __init__(self):
        self.forkserver = self.tracker = None  # the ones `start` started

    def start(self, preload: tuple[str, ...] = ()):
        if "forkserver" not in mp.get_all_start_methods():
            return mp.get_context("spawn")
        from multiprocessing import forkserver, resource_tracker

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*_PRELOAD, *preload])
        fs, rt = forkserver._forkserver, resource_tracker._resource_tracker
        had = (fs._forkserver_pid, rt._pid)
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _HELPER_BLOCKED)
        try:
            rt.ensure_running()  # (the forkserver's would start it too) ...
            # ... and unblocks SIGINT / SIGTERM in this thread on its way out: block them again for the forkserver
            signal.pthread_sigmask(signal.SIG_BLOCK, _HELPER_BLOCKED)
            fs.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.forkserver = fs if fs._forkserver_pid != had[0] else None
        self.tracker = rt if rt._pid != had[1] else None
        return ctx

    def stop(self) -> None:
        """Stop what `start` started (call once every rank has exited). The forkserver exits when its "alive" pipe
        closes; the tracker when every holder of its pipe (this process, the forkserver, the ranks and anything
        they left running) has closed it: waited for up to 5 s, then killed, so that a process a rank left behind
        cannot hang the caller."""
        import time

        if self.forkserver is not None:
            # killed, then stopped (its pipe closed, its socket removed, its status collected): it has nothing to
            # clean up, and a forkserver that imported torch takes ~0.4 s to tear down its interpreter
            os.kill(self.forkserver._forkserver_pid, signal.SIGKILL)
            self.forkserver._stop()
            self.forkserver = None
        rt, self.tracker = self.tracker, None
        if rt is None:
            return
        with rt._lock:
            fd, pid = rt._fd, rt._pid
            rt._fd = rt._pid = None
        if fd is None:
            return
        os.close(fd)
        deadline = time.monotonic() + 5.0
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)


class _Forwarder:
    """`spawn(forward_signals=...)`: the spawning process outlives the first of these signals and passes it on to
    every rank (which saves and stops, `dsv3_plugin.training.preemption`); a later SIGINT or SIGTERM (not the same
    signal again within `repeat_window_s`: the same request delivered twice) kills the ranks and exits 128 + it."""

    def __init__(self, signals, repeat_window_s: float):
        import threading

        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("spawn(forward_signals=...): call it from the main thread (Python runs handlers there)")
        self.window = repeat_window_s
        self.pids: list[int] = []
        self.first, self.first_at = 0, 0.0
        self.previous = {s: signal.signal(s, self._handle) for s in signals}

    def add(self, pid: int) -> None:
        """A rank that just started: it gets a signal that came before it."""
        self.pids.append(pid)
        if self.first:
            self._send(pid, self.first)

    @staticmethod
    def _send(pid: int, signum: int) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # that rank already ended: the parent reports it
            pass

    def _handle(self, signum, frame) -> None:
        import time

        now = time.monotonic()
        if not self.first:
            self.first, self.first_at = signum, now
            for pid in self.pids:
                self._send(pid, signum)
            return
        if signum not in (signal.SIGINT, signal.SIGTERM) or (
            signum == self.first and now - self.first_at < self.window
        ):
            return  # a stop is already on its way
        for pid in self.pids:
            self._send(pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    def restore(self) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def _death(r: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "a signal"
        return f"rank {r} was killed by {name} (signal {-code})"
    return f"rank {r} exited with status {code} without a report"


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    env: dict | None = None,
    timeout_s: float = 600.0,
    forward_signals: tuple[int, ...] = (),
    repeat_window_s: float = 0.0,
    preload: tuple[str, ...] = (),
) -> list[Any]:
    """Run `fn(*args)` on `nproc` loopback ranks (each sets the torchrun env vars); return results by rank.

    `fn` must be picklable (module level). It should call `init_distributed()` itself, exactly as it would under
    torchrun. Ranks print no tracebacks of their own. No process of the call outlives it: the ranks, and the
    forkserver and resource tracker it started (`_Helpers`).

    Args:
        fn, nproc, args: what each rank runs, and on how many ranks.
        env: environment variables for the ranks (OMP_NUM_THREADS defaults to the caller's, else 1).
        timeout_s: the whole run's limit.
        forward_signals: signals this process then handles (main thread only; e.g. `dsv3 train`'s SIGTERM,
            SIGINT, SIGUSR1): the first is passed on to every rank and this call keeps waiting for the ranks to
            save and stop; a later SIGINT or SIGTERM kills the ranks and raises SystemExit(128 + it). Default:
            none (a signal does to this process what it would anyway; the ranks die with it).
        repeat_window_s: with forward_signals, the first signal again within this many seconds is the same
            request delivered twice (a scheduler signalling the whole process group, then this process), not
            the second signal that aborts.
        preload: modules every rank imports (e.g. "deepspeed"), imported once by a new forkserver instead of by
            each rank; only where no CUDA device is visible (an import that touched the CUDA driver in the server
            would break the forks), and not by a forkserver already running.

    Returns:
        fn's return value on each rank, by rank.

    Raises:
        ConfigError / CheckpointError / DataError: bad input on any rank (same type and message, once,
            whichever rank found it first).
        RuntimeError: any other failure: a rank that died without a report ("rank 1 was killed by SIGKILL
            (signal 9)"), before a rank's own error (with its traceback), before the `PeerError`s of ranks that
            then failed waiting on it. The other ranks are stopped (after up to 2 x `ROLL_CALL_S` + 1 s to report:
            the roll call, and rank 0 serving the store until the others are done with it).
        Preempted: every rank stopped on request after saving (no rank failed): rank 0's message and exit code,
            raised once every rank has exited.
        KeyboardInterrupt: the ranks were interrupted by SIGINT before they handled it (and failed otherwise only
            waiting on each other).
        SystemExit: a second signal, with forward_signals.
    """
    forwarder = _Forwarder(forward_signals, repeat_window_s) if forward_signals else None
    helpers = _Helpers()
    try:
        own = _rank_module(fn)
        ctx = helpers.start(own + (tuple(preload) if own and not torch.cuda.is_available() else ()))
        shared = helpers.forkserver is None and ctx.get_start_method() == "forkserver"  # one started before
        module_file = sys.modules[fn.__module__].__file__ if own else None
        return _run_ranks(
            ctx, fn, nproc, args, env, timeout_s, forwarder, dict(os.environ) if shared else None, module_file
        )
    finally:
        if forwarder is not None:
            forwarder.restore()
        helpers.stop()


@contextlib.contextmanager
def shared_forkserver(preload: tuple[str, ...] = ()):
    """One forkserver (and resource tracker) for every `spawn` inside the block instead of one per call, for a
    process that spawns many times (a test session): it pays the server's start-up (importing torch and `preload`)
    once. Each rank is still a fork of the server, never of an earlier rank, so no rank state carries over from one
    `spawn` to the next; a rank gets the caller's environment of its `spawn` call, not the server's. A forkserver
    already running is used and left running. Both are stopped when the block ends.

    Args:
        preload: modules the server imports besides torch, so that the ranks need not (e.g. "deepspeed"). They
            are imported with the environment of this call; one that fails to import is skipped there.
    """
    helpers = _Helpers()
    helpers.start(tuple(preload))
    try:
        yield
    finally:
        helpers.stop()


def _process_gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs no more)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run_ranks(
    ctx,
    fn,
    nproc: int,
    args: tuple,
    env: dict | None,
    timeout_s: float,
    forwarder,
    caller_env: dict | None = None,
    module_file: str | None = None,
) -> list[Any]:
    import io
    import time
    from multiprocessing.connection import wait

    port = free_port()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
    # One pipe per rank (no shared queue: no named semaphores for the resource tracker to clean, and a rank's
    # end of the pipe closes with its process, so "ended without a report" is known for sure).
    pipes = [ctx.Pipe(duplex=False) for _ in range(nproc)]
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nproc, port, fn, args, pipes[r][1], env, os.getpid(), _Stdio(), caller_env, module_file),
            daemon=False,
        )
        for r in range(nproc)
    ]
    reports: dict[int, tuple[str, Any]] = {}  # rank -> (status, payload)
    eof: set[int] = set()

    def collect(timeout: float) -> None:
        started = {id(pipes[r][0]): r for r in range(nproc) if r not in eof and pipes[r][1].closed}
        ready = wait([pipes[r][0] for r in started.values()], timeout) if started else ()
        for conn in ready:
            r = started[id(conn)]
            try:
                _, status, payload = conn.recv()
                reports.setdefault(r, (status, payload))
            except (EOFError, OSError):
                eof.add(r)

    def finished() -> bool:
        return all(reports.get(r, ("",))[0] in ("ok", "preempted") for r in range(nproc))

    def failures() -> list[tuple[int, str, Any]]:
        return [(r, s, x) for r, (s, x) in reports.items() if s not in ("ok", "preempted")]

    def deaths() -> list[tuple[int, int]]:
        """Ranks that ended without a report: the forkserver reported an exit status, the process is gone (a
        forkserver that died itself reports 255 for ranks still running), and its pipe holds no report (read to
        its end; for at most 1 s, should a process the rank left running hold the pipe open)."""
        out = []
        for r, p in enumerate(procs):
            if r not in reports and p.pid is not None and p.exitcode is None and _process_gone(p.pid):
                # gone, but the forkserver (its parent, which reaps it) has not passed its status on yet: under
                # load that takes a moment, and without it a killed rank would be missed for its peers' errors
                until = time.monotonic() + 2.0
                while p.exitcode is None and time.monotonic() < until:
                    time.sleep(0.02)
            if r not in reports and p.pid is not None and p.exitcode is not None and _process_gone(p.pid):
                until = time.monotonic() + 1.0
                while r not in eof and r not in reports and time.monotonic() < until:
                    collect(0.05)
                if r not in reports:
                    out.append((r, p.exitcode))
        return out

    done = False
    try:
        for r, p in enumerate(procs):
            p.start()
            pipes[r][1].close()  # the rank holds the writing end now
            if forwarder is not None:
                forwarder.add(p.pid)
        deadline = time.monotonic() + timeout_s
        while not (finished() or failures() or deaths()):
            if time.monotonic() > deadline:
                break
            collect(0.05)
        if not finished():
            # Other ranks fail right after the first (same bad input, or a peer gone from a collective): give them
            # the roll call's time to report, so that an input error wins over the broken pipes it causes and the
            # survivors of a dead rank end on their own.
            grace = time.monotonic() + 2 * ROLL_CALL_S + 1.0
            while time.monotonic() < grace and any(
                r not in reports and p.pid is not None and not _process_gone(p.pid) for r, p in enumerate(procs)
            ):
                collect(0.05)
            failed, dead = failures(), deaths()
            first_input = next((x for _, s, x in failed if s == "input"), None)
            if first_input is not None:
                raise _input_error(*first_input)
            if dead:  # a rank's death before anything the others then said about it
                then = " (the other ranks then failed waiting on it)" if failed else ""
                raise RuntimeError("spawned run failed:\n" + "; ".join(_death(r, c) for r, c in dead) + then)
            if any(s == "interrupted" for _, s, _ in failed) and all(
                s in ("interrupted", "peer") for _, s, _ in failed
            ):
                raise KeyboardInterrupt  # Ctrl-C (forwarded, or to the process group) while the ranks started
            if failed:  # a rank's own failure (a bug) before the peer errors it causes on the others
                r, _, out = min(failed, key=lambda f: f[1] == "peer")
                raise RuntimeError(f"spawned run failed:\nrank {r}: {out}")
            if not finished():
                raise RuntimeError(f"spawned run failed: timed out after {timeout_s:.0f}s")
        done = True
        preempted = [(r, x) for r, (s, x) in reports.items() if s == "preempted"]
        # our own children's results (pickled by `_worker`)
        results = {r: torch.load(io.BytesIO(x), weights_only=False) for r, (s, x) in reports.items() if s == "ok"}
    finally:  # also on KeyboardInterrupt / SystemExit: no rank outlives the call
        for p in procs:  # by pid: Process.kill() skips a rank whose status a dead forkserver made up
            if p.pid is not None and not done and not _process_gone(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            if p.pid is not None:
                p.join(30 if done else 5)
        for reader, writer in pipes:
            reader.close(), writer.close()
    if preempted:  # every rank has exited (joined above)
        r, (code, message) = min(preempted, key=lambda x: x[0])
        raise Preempted(message, code)
    return [results[r] for r in range(nproc)]
