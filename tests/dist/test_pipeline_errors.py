"""A wrong shape, a dead peer or a stuck peer end a pipeline step with a PipelineError within the timeout
on the ranks that are still alive, instead of a hang. One 4-rank run: ranks {0, 1} exchange a wrong
shape; ranks {2, 3}: rank 3 stays silent past the timeout, then exits while rank 2 waits again."""
import time

import pytest
import torch
import torch.distributed as dist

from dsv3_plugin.distributed import init_distributed
from dsv3_plugin.pipeline import DualPipeV, OneFOneB, PipelineError
from helpers import run_ranks
from pipeline_stages import H, MLPStage, criterion, make_batch

TIMEOUT = 3.0


class WideStage(MLPStage):
    """Emits one extra feature: disagrees with the declared P2P shape."""

    def forward(self, x):
        y = super().forward(x)
        return torch.cat([y, y[..., :1]], dim=-1)


def _attempt(rt, *args, **kw):
    t0 = time.monotonic()
    try:
        rt.step(*args, **kw)
    except PipelineError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def _worker():
    r, _ = init_distributed()
    pair_a = dist.new_group([0, 1])
    pair_b = dist.new_group([2, 3])
    pair_c = dist.new_group([2, 3])
    torch.manual_seed(0)
    x, y = make_batch(8)
    if r in (0, 1):
        mods = [WideStage() if r == 0 else MLPStage(), MLPStage()]
        rt = DualPipeV(mods, process_group=pair_a, timeout_s=TIMEOUT, p2p_shapes=[((2, 3, H), torch.float32)])
        return {"shape": _attempt(rt, x, num_chunks=4, criterion=criterion, labels=(y,))}
    if r == 3:
        time.sleep(TIMEOUT + 2)        # alive but silent for longer than the timeout ...
        return {}                      # ... then gone: returning ends this process and closes its sockets
    stuck = _attempt(OneFOneB([MLPStage()], process_group=pair_b, timeout_s=TIMEOUT), x, num_chunks=2)
    dead = _attempt(OneFOneB([MLPStage()], process_group=pair_c, timeout_s=TIMEOUT + 30), x, num_chunks=2)
    return {"stuck": stuck, "dead": dead}


@pytest.mark.dist
def test_wrong_shape_dead_and_stuck_peers_raise_in_time():
    res = run_ranks(_worker, 4, timeout_s=180)
    msg0, t0 = res[0]["shape"]
    msg1, t1 = res[1]["shape"]
    # the sender names its own output and the declaration; the receiver names what arrived
    assert msg0 is not None and "rank 0 -> rank 1" in msg0 and "declared p2p shapes" in msg0, msg0
    assert "(2, 3, 9)" in msg0 and "(2, 3, 8)" in msg0, msg0
    assert msg1 is not None and "rank 1 <- rank 0" in msg1 and "(2, 3, 9)" in msg1, msg1
    assert t0 < TIMEOUT and t1 < TIMEOUT, (t0, t1)
    msg, t = res[2]["stuck"]
    assert msg is not None and "pipeline rank 1" in msg and "peer dead or stuck" in msg, msg
    assert TIMEOUT - 0.5 < t < TIMEOUT + 3, t
    # the dead peer is noticed when its connection drops, long before that step's 33 s timeout
    msg, t = res[2]["dead"]
    assert msg is not None and "pipeline rank 1" in msg and "peer dead or stuck" in msg, msg
    assert t < 15, t
