"""`dsv3 check-config FILE [--nproc N]`: the validation `dsv3 train` and the DeepSpeed engine run, without running.

Exit 0 with a one-line summary (or the resolved JSON with --print), or 2 with the message of the first problem,
which starts with the key that is wrong (or names the file). It runs `RunConfig.load`, the function `dsv3 train`
runs before it spawns ranks; what is checked: `dsv3_plugin.deepspeed.validate`.
"""

import json

from dsv3_plugin.config import ConfigError
from dsv3_plugin.deepspeed.run_config import RunConfig, RunOverrides
from dsv3_plugin.training.memory_estimate import format_bytes, host_memory_bytes


def register(sub):
    p = sub.add_parser("check-config", help='validate a DeepSpeed JSON with a "dsv3" block as dsv3 train would')
    p.add_argument("file")
    p.add_argument(
        "--nproc",
        type=int,
        help="world size to check the world-size rules for (as `dsv3 train --nproc "
        "N` or torchrun's total ranks); default: those rules are skipped",
    )
    p.add_argument("--ranks-per-host", type=int, help="ranks sharing one host's memory (default: --nproc, or 1)")
    p.add_argument(
        "--host-memory-gib", type=float, help="memory of the host that will run dsv3 train (default: this host's)"
    )
    p.add_argument(
        "--target",
        choices=("train", "engine"),
        default="train",
        help="train: as `dsv3 train` runs it (default); engine: as dsv3_plugin.deepspeed.initialize "
        'sees it (no dsv3 train-only rules; a client optimizer may replace the "optimizer" section)',
    )
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="the released checkpoint `dsv3 train --init-from DIR` will start from (its config.json gives the "
        "model's shape; a dsv3.lora block needs it)",
    )
    p.add_argument("--print", action="store_true", help="print the resolved config as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    for flag, val in (("--nproc", args.nproc), ("--ranks-per-host", args.ranks_per_host)):
        if val is not None and val < 1:
            raise ConfigError(f"{flag}: must be >= 1 (got {val})")
    if args.host_memory_gib is not None and not 0 < args.host_memory_gib < 2**60:
        raise ConfigError(f"--host-memory-gib: must be a positive number of GiB (got {args.host_memory_gib})")
    memory = int(args.host_memory_gib * 1024**3) if args.host_memory_gib is not None else host_memory_bytes()
    train = args.target == "train"  # the memory bound is dsv3 train's (the engine gets a model already built)
    checked = RunConfig.load(
        args.file,
        target=args.target,
        world_size=args.nproc,
        ranks_on_host=args.ranks_per_host or args.nproc or 1,
        host_memory=memory if train else None,
        overrides=RunOverrides(init_from=args.init_from) if args.init_from else None,
    )
    cfg = checked.cfg
    if args.print:
        print(json.dumps({**checked.ds, "dsv3": cfg.to_dict()}, indent=2))
        return 0
    world = (
        f"world-size rules checked for {args.nproc} rank(s)"
        if args.nproc is not None
        else "world-size rules not checked (pass --nproc N)"
    )
    mem = (
        f"; dsv3 train needs >= {format_bytes(checked.memory.host_bytes)} of the host's {format_bytes(memory)}"
        if checked.memory
        else "; checked as the engine sees it"
    )
    print(
        f"ok: {args.file} (preset {cfg.preset}, {cfg.model.num_hidden_layers} layers, "
        f"{cfg.moe.n_routed_experts} experts, top-{cfg.moe.top_k}, MTP depth {cfg.mtp.depth}; {world}{mem})"
    )
    return 0
