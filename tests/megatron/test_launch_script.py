"""examples/megatron/launch_dsv3.sh is accepted by Megatron: the script runs with a stand-in `torchrun` that only
records its arguments (no process is started), then Megatron's own argument parsing and `validate_args` run on the
recorded flags with the world size the script declares (nodes x processes per node), through the entry point's
parsing (dsv3 block <-> Megatron flags). Needs `megatron.training` (megatron-core >= 0.19's wheel; 0.16.1's wheel
has no argument module, so this is skipped there)."""

import json
import os
import stat
import subprocess

import pytest

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training (argument parsing)")
# These tests parse Megatron arguments in the pytest process, not in a launched rank: without torch.distributed or
# RANK, the print_rank_0 inside Megatron's validate_args warns that it assumes rank 0.
pytestmark = pytest.mark.filterwarnings("ignore:Could not determine rank from torch\\.distributed:UserWarning:megatron")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "megatron", "launch_dsv3.sh")


def _recorded_launch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\0" "$@" > "$DSV3_RECORD"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    ds = tmp_path / "ds_v3.json"
    ds.write_text(json.dumps({"dsv3": {"preset": "v3-671b", "parallel": {"schedule": "1f1b"}}}))
    record = tmp_path / "argv"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DSV3_RECORD": str(record),
        "DS_JSON": str(ds),
        "CKPT": str(tmp_path / "ckpt"),
    }
    subprocess.run(["bash", SCRIPT], env=env, check=True, cwd=tmp_path, timeout=60)
    argv = record.read_text().split("\0")[:-1]
    i = argv.index("-m")
    launcher, module, flags = argv[:i], argv[i + 1], argv[i + 2 :]
    opt = lambda name: int(launcher[launcher.index(name) + 1])  # noqa: E731
    return module, opt("--nnodes") * opt("--nproc-per-node"), flags


def test_launch_script_passes_megatrons_validate_args(tmp_path):
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    module, world, flags = _recorded_launch(tmp_path)
    assert module == "dsv3_plugin.megatron.pretrain_gpt"
    assert world == 2048
    args, notes = parse_megatron_args(flags, world_size=world, on_cpu=False, set_globals=False)
    assert notes == []  # every model flag given, all agree with the preset
    assert (args.pipeline_model_parallel_size, args.expert_model_parallel_size, args.data_parallel_size) == (
        16,
        64,
        128,
    )
    assert args.decoder_first_pipeline_num_layers + 14 * 4 + args.decoder_last_pipeline_num_layers == 61
    assert (args.num_layers, args.mtp_num_layers, args.num_experts, args.moe_router_topk) == (61, 1, 256, 8)
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim) == (1536, 512, 128, 64)
    assert (args.fp8, args.fp8_recipe, args.bf16) == ("e4m3", "blockwise", True)
    assert args.eval_interval == 1000 and args.use_distributed_optimizer


def test_wrong_world_size_is_refused_by_megatron(tmp_path):
    """What the old script hit: 8 processes cannot hold TP x PP = 16 (Megatron's own check fires, as one line)."""
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args

    _, _, flags = _recorded_launch(tmp_path)
    with pytest.raises(ConfigError, match=r"^Megatron's argument check: .*8"):
        parse_megatron_args(flags, world_size=8, on_cpu=False, set_globals=False)


def test_slurm_script_passes_megatrons_validate_args(tmp_path):
    """examples/slurm/pretrain_megatron.sbatch (stand-ins for srun / scontrol / torchrun: nothing starts): one agent
    per node at a c10d rendezvous on the first node; the module and its flags pass Megatron's `validate_args` for the
    launch's world; the dsv3 block's `moe.ranks_per_node` agrees with the launch's nodes (as the ranks check it)."""
    from helpers import SLURM_NODES, slurm_launch_argv

    from dsv3_plugin.megatron.config import run_config
    from dsv3_plugin.megatron.pretrain_gpt import parse_megatron_args
    from dsv3_plugin.parallel.groups import ep_layout
    from dsv3_plugin.parallel.node_layout import node_layout_error

    argv = slurm_launch_argv(os.path.join(ROOT, "examples", "slurm", "pretrain_megatron.sbatch"), tmp_path)
    i = argv.index("-m")
    launcher, module, flags = argv[:i], argv[i + 1], argv[i + 2 :]
    opts = dict(zip(launcher[::2], launcher[1::2]))
    assert opts == {
        "--nnodes": "2",
        "--nproc-per-node": "8",
        "--rdzv-backend": "c10d",
        "--rdzv-endpoint": f"{SLURM_NODES[0]}:29500",
        "--rdzv-id": "42",
    }
    assert module == "dsv3_plugin.megatron.pretrain_gpt"
    world, per_node = 16, 8
    args, _ = parse_megatron_args(flags, world_size=world, on_cpu=False, set_globals=False)
    assert os.path.isabs(args.dsv3_config) or os.path.isfile(os.path.join(ROOT, args.dsv3_config))
    ep, rpn = args.expert_model_parallel_size, run_config(args).moe.ranks_per_node
    assert ep > rpn  # EP spans the nodes: node-limited routing between them
    # Megatron (TP = CP = 1) lays EP out as contiguous rank blocks: the plugin's pp = 1 layout over the world
    agents = [n for n in SLURM_NODES for _ in range(per_node)]
    assert node_layout_error(ep_layout(world, ep, rpn)["ep"], rpn, agents, per_node, world) is None
