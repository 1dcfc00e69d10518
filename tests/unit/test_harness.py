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
