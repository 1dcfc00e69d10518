import os

import torch
import torch.distributed as dist
from helpers import run_ranks

from dsv3_plugin.parallel.distributed import init_distributed


def _allreduce_rank():
    rank, world = init_distributed()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world, t.item()


def _boom():
    rank, _ = init_distributed()
    if rank == 1:
        raise ValueError("rank one fails")
    return rank


def test_run_ranks_allreduce():
    out = run_ranks(_allreduce_rank, 3)
    assert out == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_run_ranks_reports_failure():
    import pytest

    with pytest.raises(RuntimeError, match="rank one fails"):
        run_ranks(_boom, 2, timeout_s=60)


def _threads_and_print(tag: str):
    print(f"rank {os.environ['RANK']} says {tag}", flush=True)
    return torch.get_num_threads()


def test_spawned_ranks_get_the_callers_thread_count_and_stdout(capfd):
    """Ranks are forks of a forkserver (one per `spawn` call, stopped when it returns) that imported torch with the
    caller's environment: each rank still runs with the OMP_NUM_THREADS it is given and writes to the caller's
    stdout of the moment (here: a different capture per call)."""
    from dsv3_plugin.parallel.distributed import spawn

    for n in (2, 1):
        assert spawn(_threads_and_print, 2, f"n={n}", env={"OMP_NUM_THREADS": str(n)}) == [n, n]
        out = capfd.readouterr().out
        assert sorted(line for line in out.splitlines() if "says" in line) == [
            f"rank 0 says n={n}",
            f"rank 1 says n={n}",
        ]


_CARRIED: list = []  # what an earlier rank of a shared forkserver appended here (it must not see any)


def _rank_facts():
    _CARRIED.append(os.getpid())
    return os.getppid(), os.environ.get("DSV3_TEST_MARK"), list(_CARRIED)


def test_shared_forkserver_keeps_one_server_and_nothing_of_a_rank(monkeypatch):
    """`shared_forkserver`: every `spawn` in the block forks its ranks from the same server, each rank with the
    caller's environment of that call and a fresh copy of the modules (nothing an earlier rank did); the block
    leaves no process behind."""
    import psutil

    from dsv3_plugin.parallel.distributed import shared_forkserver, spawn

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with shared_forkserver(("json",)):
        monkeypatch.setenv("DSV3_TEST_MARK", "first")
        first = spawn(_rank_facts, 2)
        monkeypatch.delenv("DSV3_TEST_MARK")
        second = spawn(_rank_facts, 2)
    servers = {parent for parent, _, _ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers
    assert [mark for _, mark, _ in first] == ["first", "first"] and [mark for _, mark, _ in second] == [None, None]
    assert all(len(carried) == 1 for _, _, carried in first + second)
    psutil.wait_procs([psutil.Process(p) for p in servers if psutil.pid_exists(p)], timeout=10)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in left), left
