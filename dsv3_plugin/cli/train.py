"""`dsv3 train`: DeepSpeed ZeRO-1 training of a DeepSeek-V3 model on synthetic data (see `dsv3_plugin.train`).

    dsv3 train [--config FILE] [--nproc N] [--steps N] [--out DIR] [--resume DIR] [--init-from DIR]

No --config: the built-in DeepSpeed JSON (`tiny` preset; equal to examples/deepspeed/ds_config.json).
Self-spawns N gloo/NCCL ranks with --nproc (default 2) unless launched by torchrun / the deepspeed launcher,
in which case RANK / WORLD_SIZE / MASTER_* come from the environment. stdout: one JSON object per optimizer
step, then a one-line summary; stderr: progress bar and logs. Exit 2 on bad config/checkpoint input.
"""
from __future__ import annotations

import os
import re
import sys


def register(sub):
    p = sub.add_parser("train", help="train with DeepSpeed ZeRO-1 (tiny preset on 2 CPU ranks by default)")
    p.add_argument("--config", help="DeepSpeed JSON with a \"dsv3\" block (default: built-in tiny config)")
    p.add_argument("--nproc", type=int, help="ranks to self-spawn (default 2; ignored under torchrun/deepspeed)")
    p.add_argument("--steps", type=int, help="train up to this step (default dsv3.train.steps); with --resume "
                                             "it is the step to reach, not a number to add")
    p.add_argument("--out", default="runs/train", help="metrics.jsonl, train.png and ckpt/ go here")
    p.add_argument("--resume", metavar="DIR", help="a previous --out dir (or its ckpt/ dir) to continue from")
    p.add_argument("--init-from", metavar="DIR", help="released-format HF checkpoint dir to start from")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar on stderr")
    p.set_defaults(func=run)


def _worker(config, steps, out, resume, init_from, progress):
    from ..train import train
    train(config, steps=steps, out=out, resume=resume, init_from=init_from, progress=progress)


_INPUT_ERROR = re.compile(r"^(ConfigError|CheckpointError): (.*)$", re.M)


def run(args) -> int:
    from ..distributed import launched_externally, spawn
    from ..errors import CheckpointError
    from ..train import _prepare, checkpoint_dir
    if args.nproc is not None and args.nproc < 1:
        print(f"error: --nproc: must be >= 1 (got {args.nproc})", file=sys.stderr)
        return 2
    _prepare(args.config, args.steps, args.init_from)  # bad input -> ConfigError/CheckpointError -> exit 2
    if args.resume:
        ck = checkpoint_dir(args.resume)
        if not os.path.isfile(os.path.join(ck, "latest")):
            raise CheckpointError(f"{args.resume}: no DeepSpeed checkpoint here (no 'latest' in it or in ckpt/)")
    wargs = (args.config, args.steps, args.out, args.resume, args.init_from, not args.no_progress)
    if launched_externally():
        _worker(*wargs)
        return 0
    try:
        spawn(_worker, args.nproc or 2, *wargs, timeout_s=24 * 3600.0)
    except RuntimeError as e:
        m = _INPUT_ERROR.search(str(e))
        if m:  # a rank rejected its input (e.g. checkpoint tensors): same exit code as in-process checks
            print(f"error: {m.group(2)}", file=sys.stderr)
            return 2
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
