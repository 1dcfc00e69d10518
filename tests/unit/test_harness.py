import torch
import torch.distributed as dist

from dsv3_plugin.parallel.distributed import init_distributed
from helpers import run_ranks


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
