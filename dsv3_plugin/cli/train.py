"""`dsv3 train [--config FILE] [--nproc N] [--steps N] [--out DIR] [--resume DIR] [--init-from DIR] [--data PREFIX]
[--valid-data PREFIX] [--tokenizer DIR] [--json] [--overwrite] [--no-progress]`: DeepSpeed ZeRO-1 training
(`dsv3_plugin.deepspeed.train`) on prepared data (--data or a `dsv3.train.data` object) or the synthetic Markov
chain; no --config: the built-in JSON (`tiny` preset). The options become one `TrainRequest`; its `RunConfig` is
parsed and validated here, once, with `dsv3 check-config`'s function, and handed to the N self-spawned ranks
(--nproc, default 2); under torchrun / the deepspeed launcher each rank parses it once. `--resume` with other data
than the checkpoint's is refused. Output: a bar on stderr, a short summary on stdout, every step's JSON line in
OUT/metrics.jsonl (and on stdout with --json, the summary then on stderr). Exit 2 on bad config/checkpoint/--out
input with one `error:` line, whichever rank found it; 1 for other failures (a rank dead or silent longer than
`parallel.p2p_timeout_s`: one message naming the wait and the limit, no traceback).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

from dsv3_plugin.checkpoint.frozen_base import check_resume_base
from dsv3_plugin.config import ConfigError
from dsv3_plugin.deepspeed.train import TrainRequest, prepare_run, train
from dsv3_plugin.errors import PeerError, Preempted
from dsv3_plugin.parallel.distributed import (
    _is_input_error,
    first_failure,
    init_distributed,
    launched_externally,
    spawn,
)
from dsv3_plugin.training import checkpoint_tags as ct
from dsv3_plugin.training import metrics_file
from dsv3_plugin.training import run_dir as rd
from dsv3_plugin.training.loop import data_fingerprint
from dsv3_plugin.training.preemption import REPEAT_WINDOW_S, SIGNALS

# what every rank imports on its way to the first step, once in the forkserver instead of once per rank (without
# CUDA; see `spawn`): DeepSpeed, and torch._dynamo (torch.optim's constructors import it)
RANK_IMPORTS = ("deepspeed", "torch._dynamo")


def register(sub):
    p = sub.add_parser(
        "train",
        help="train with DeepSpeed ZeRO-1 on prepared data (--data) or synthetic data (tiny preset, 2 CPU ranks)",
        description='Without --data (and with dsv3.train.data = "synthetic", the default) it trains on a seeded '
        "Markov chain over the vocabulary: no tokenizer or dataset is read, also with --init-from. With --data "
        "PREFIX (dsv3 prepare-data output) or a dsv3.train.data object it trains on that data, packed into "
        "seq_len rows, with eval_loss on --valid-data.",
    )
    p.add_argument("--config", help='DeepSpeed JSON with a "dsv3" block (default: built-in tiny config)')
    p.add_argument("--nproc", type=int, help="ranks to self-spawn (default 2; ignored under torchrun/deepspeed)")
    p.add_argument(
        "--steps",
        type=int,
        help="train up to this step (default dsv3.train.steps); with --resume "
        "it is the step to reach, not a number to add",
    )
    p.add_argument(
        "--out",
        default="runs/train",
        help="metrics.jsonl, train.png, routing.png and ckpt/ go here (locked while the run lasts)",
    )
    p.add_argument("--resume", metavar="DIR", help="a previous --out dir (or its ckpt/ dir) to continue from")
    p.add_argument("--init-from", metavar="DIR", help="released-format HF checkpoint dir to start from")
    p.add_argument(
        "--data",
        action="append",
        metavar="PREFIX",
        help="training data: a dsv3 prepare-data PREFIX (PREFIX.bin/.idx) or a small .jsonl; repeat for several "
        "(sets dsv3.train.data.train)",
    )
    p.add_argument(
        "--valid-data",
        action="append",
        metavar="PREFIX",
        help="held-out data for eval_loss (sets dsv3.train.data.valid); repeatable",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer directory (sets dsv3.train.data.tokenizer; default: the --init-from directory)",
    )
    p.add_argument("--json", action="store_true", help="also print every JSON line and a JSON summary on stdout")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --out that holds a previous run (deletes its metrics and checkpoints)",
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar on stderr")
    p.add_argument(
        "--exit-after-minutes",
        type=float,
        metavar="M",
        help="save and exit (status 0) before M minutes of wall clock run out, at a step boundary "
        "(sets dsv3.train.exit_after_minutes)",
    )
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="--init-from: load NaN/Inf weights and scales instead of refusing them (exit 2)",
    )
    p.set_defaults(func=run)


def _request(args) -> TrainRequest:
    """The command line as `dsv3_plugin.deepspeed.train`'s options (the one place they are named)."""
    return TrainRequest(
        config=args.config,
        steps=args.steps,
        out=args.out,
        resume=args.resume,
        init_from=args.init_from,
        progress=not args.no_progress,
        echo=args.json,
        summary=True,
        overwrite=args.overwrite,
        allow_non_finite=args.allow_non_finite,
        data=args.data,
        valid_data=args.valid_data,
        tokenizer=args.tokenizer,
        exit_after_minutes=args.exit_after_minutes,
    )


def _worker(request: TrainRequest) -> None:
    train(request)  # (the history stays on the rank: nothing to send back)


def _precheck(request: TrainRequest, nproc: int) -> TrainRequest:
    """What can be refused before any rank starts (the ranks check the run directory again under its lock).
    Returns the request with its `RunConfig`: parsed and validated here, once, for the ranks to take as it is."""
    # the world this run will have: the same rules as `dsv3 check-config FILE --nproc N`; the data opened and checked
    run, _, data = prepare_run(request, nproc)
    out, resume = request.out, request.resume
    if out:
        rd.check_out_path(out)
        rd.probe_lock(out)
    if resume:  # (checksums: rank 0 reads the whole checkpoint for them once, under the run's lock)
        ck, tag, _ = ct.resume_source(resume, run.cfg, nproc, data_fingerprint(data), verify=False)
        if run.cfg.lora is not None:  # adapters resume only on the base they were trained on
            check_resume_base(os.path.join(ck, tag), request.init_from)
    same_dir = bool(resume and out) and (
        os.path.realpath(ct.checkpoint_dir(resume)) == os.path.realpath(os.path.join(out, "ckpt"))
    )
    metrics = os.path.join(out, "metrics.jsonl") if same_dir else None
    if metrics and os.path.isfile(metrics):
        metrics_file.read_jsonl(metrics)  # a bad line (not a torn last one) is refused before any rank starts
    prev = rd.previous_run(out) if out and not same_dir else None
    if prev and not request.overwrite:
        raise ConfigError(
            f"--out {out}: holds a previous run ({prev}); continue it with --resume "
            f"{out}, replace it with --overwrite, or pick another --out"
        )
    return dataclasses.replace(request, config=run)


def run(args) -> int:
    request = _request(args)
    if launched_externally():
        return _run_launched(request)
    if args.nproc is not None and args.nproc < 1:
        print(f"error: --nproc: must be >= 1 (got {args.nproc})", file=sys.stderr)
        return 2
    nproc = args.nproc or 2
    request = _precheck(request, nproc)  # bad input -> ConfigError/CheckpointError -> exit 2 (dsv3_plugin.cli.main)
    try:
        # the launcher outlives SIGTERM / SIGINT / SIGUSR1 and passes it on: the ranks save and stop together
        spawn(
            _worker,
            nproc,
            request,
            timeout_s=24 * 3600.0,
            forward_signals=SIGNALS,
            repeat_window_s=REPEAT_WINDOW_S,
            preload=RANK_IMPORTS,
        )
    except Preempted as e:  # every rank saved and stopped at the same step: not a failure, a status
        print(e, file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # input errors come back as ConfigError/CheckpointError (exit 2 in main)
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _run_launched(request: TrainRequest) -> int:
    """One rank of a torchrun / deepspeed-launcher job. Every rank may hit the same bad input; the first to fail
    reports it (one `error:` line, or one traceback for a bug) and the others exit without a word — the
    launcher stops the job on the first non-zero exit."""
    import traceback

    try:
        init_distributed()
        train(request)  # this rank is its own process: it reads and validates the config once
        return 0
    except Preempted as e:  # every rank saved and stopped at the same step; rank 0 says so, all exit alike
        if int(os.environ.get("RANK", "0")) == 0:
            print(e, file=sys.stderr, flush=True)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(e.exit_code)
    except KeyboardInterrupt:
        code, msg = 130, None
    except Exception as e:
        code = 2 if _is_input_error(e) else 1
        # bad input, or a peer dead / silent past parallel.p2p_timeout_s: the message says it all; a bug: traceback
        msg = f"error: {e}" if code == 2 or isinstance(e, PeerError) else traceback.format_exc()
    # the launcher's SIGTERM to the survivors follows a failure within ~0.1 s: this rank is exiting anyway, and its
    # one line (naming the dead rank, or the bad input) must not die with it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    first, code = first_failure(code)
    if first and msg:
        print(msg, file=sys.stderr, end="" if msg.endswith("\n") else "\n")
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: a process group with a dead peer can block it
