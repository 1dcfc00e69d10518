"""examples/slurm/dsv3_train.sbatch runs `dsv3 train` as the package accepts it: the script runs with stand-ins for
srun / scontrol / torchrun (`helpers.slurm_launch_argv`: nothing starts), then the recorded torchrun line is
checked: one agent per node meeting at a c10d rendezvous on the first node, `dsv3 train`'s own parser accepts the
arguments, the config validates for the launch's world size, and its `moe.ranks_per_node` agrees with the launch's
nodes (`parallel.node_layout`, as the ranks check it at start).
The Megatron script: tests/megatron/test_launch_script.py.
"""

import os

from helpers import SLURM_NODES, slurm_launch_argv

from dsv3_plugin.cli import build_parser
from dsv3_plugin.deepspeed.run_config import RunConfig
from dsv3_plugin.parallel.groups import ep_layout
from dsv3_plugin.parallel.node_layout import node_layout_error

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "slurm", "dsv3_train.sbatch")


def _split(argv):
    """(torchrun's options as a dict, the `dsv3 train` arguments)."""
    i = next(k for k, a in enumerate(argv) if os.path.basename(a) == "dsv3")
    launcher = argv[:i]
    return dict(zip(launcher[::2], launcher[1::2])), argv[i + 1 :]


def test_sbatch_launch_line(tmp_path):
    out = tmp_path / "run"
    opts, train = _split(slurm_launch_argv(SCRIPT, tmp_path, {"OUT": str(out)}))
    assert opts == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": f"{SLURM_NODES[0]}:29500",
        "--rdzv-id": "42",
    }
    args = build_parser().parse_args(train)
    assert (args.command, args.out, args.resume) == ("train", str(out), None)
    assert os.path.isfile(os.path.join(ROOT, args.config)), args.config
    world, per_node = 2 * 8, 8
    run = RunConfig.load(os.path.join(ROOT, args.config), target="train", world_size=world, ranks_on_host=per_node)
    p, rpn = run.cfg.parallel, run.cfg.moe.ranks_per_node
    agents = [n for n in SLURM_NODES for _ in range(per_node)]  # torchrun numbers each agent's ranks in a block
    assert p.ep > rpn  # EP spans the nodes: node-limited routing between them
    assert node_layout_error(ep_layout(world, p.ep, rpn, p.pp)["ep"], rpn, agents, per_node, world) is None

    # a resubmitted job continues the run in OUT
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "latest").write_text("step500")
    _, train = _split(slurm_launch_argv(SCRIPT, tmp_path / "again", {"OUT": str(out)}))
    assert build_parser().parse_args(train).resume == str(out)
