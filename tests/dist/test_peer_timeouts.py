"""`parallel.p2p_timeout_s` reaches every process group a `dsv3 train` rank waits on: the world group, the
expert-parallel groups (ours, which DeepSpeed's MoE layer also uses as its EP / EDP groups) and DeepSpeed's clone
of the world group (over which ZeRO-1 reduces gradients). torch gives a group created without `timeout=` 30
minutes on gloo, so a group missed here would let a stopped peer hang the job that long (the end-to-end check with
a SIGSTOPped rank is tests/dist/test_pipeline_stopped_peer.py).

Each rank lists the groups torch knows it is a member of after training and reads each one's timeout from its
gloo backend. A second run in the same processes with another value must re-bound the groups the first run
created (both our EP groups and DeepSpeed's are cached per process)."""

from helpers import run_ranks


def _timeouts() -> list[float]:
    import torch
    import torch.distributed as dist

    groups = list(dist.distributed_c10d._world.pg_map)
    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def _train_twice():
    from dsv3_plugin.deepspeed.run_config import default_ds_config
    from dsv3_plugin.deepspeed.train import train

    seen = []
    for timeout_s in (7.0, 11.0):
        ds = default_ds_config()
        ds["dsv3"]["parallel"] = {"ep": 2, "p2p_timeout_s": timeout_s}
        ds["dsv3"]["train"]["seq_len"] = 16
        train(ds, steps=1, progress=False, save=False)
        seen.append(_timeouts())
    return seen


def test_every_group_waits_at_most_the_configured_timeout():
    for rank, (first, second) in enumerate(run_ranks(_train_twice, 2)):
        # world + our EDP/node groups (DeepSpeed's MoE layer uses ours as its EP/EDP groups) + DeepSpeed's
        # world clone
        assert len(first) >= 4, (rank, first)
        assert first == [7.0] * len(first), (rank, first)
        assert second == [11.0] * len(second), (rank, second)
