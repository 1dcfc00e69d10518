"""Robustness probe of the `dsv3` entry points, as a hostile-but-realistic user (and CI) would run it.

    python tests/probe_robustness.py [--seed N] [--train-accepted K|all] [--keep DIR] [--only PART ...]

Not a pytest module (pytest collects only `test_*.py`): it runs for several minutes and prints one JSON object
on stdout with the number of cases of each kind and the counts that must all be 0:

- `tracebacks`: a Python traceback on stderr, or an exception out of an in-process `dsv3` call;
- `exit0_on_bad_input`: exit 0 on a corrupt / non-finite checkpoint, or an accepted config that trains to NaN;
- `mixed_runs`: a run directory whose metrics.jsonl is not one run's steps 1..N in order, or a resume that is
  not bit-identical to the uninterrupted run (every metric of every step but `tokens_per_s`);
- `hangs_beyond_timeout`: a stopped peer whose job did not end within 4 x `parallel.p2p_timeout_s` + 60 s,
  or any command past its time limit;
and the other defects it looks for (`other_failures`: wrong exit code, check-config accepting what train
refuses, a partial or differing `convert` output, a second run not refused). Every failure is described on
stderr. Exit status 1 if any count is not 0.

What it runs (all on CPU, tiny models, `nice`d):
1. config fuzz: the seeded mutations of tests/unit/test_config_fuzz.py (>= 200) and four hostile files
   (UTF-16, latin-1, a UTF-8 BOM, 10 000-deep nesting) through `dsv3 check-config --nproc N`; every accepted
   config must pass `dsv3 train`'s pre-spawn check and build a model, and a sample of them (--train-accepted)
   is trained for one step with `dsv3 train`;
2. corrupted checkpoints: every case of tests/unit/test_checkpoint_corruptions.py and
   tests/unit/test_checkpoint_nonfinite.py through `dsv3 convert` (both targets), `dsv3 generate` and
   `dsv3 train --init-from`: exit 2 with one `error:` line;
3. kill -9 of `dsv3 train` (launcher and ranks) while it writes a checkpoint, then `--resume`: exit 0 and the
   same metrics, bit for bit, as a run that was never interrupted; `--resume` on another number of ranks or
   with another model: refused;
4. kill -9 of `dsv3 convert` while it writes: DST does not exist; the rerun's files are byte-identical to an
   uninterrupted conversion;
5. two `dsv3 train` into one `--out`, started together and one while the other trains: one is refused
   (exit 2), the other's metrics are its own;
6. a SIGSTOPped peer (pipeline parallel, expert parallel): the job ends within the timeout bound, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import filecmp
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(HERE, "dist"), os.path.join(HERE, "unit"), HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

COMMAND_LIMIT_S = 900  # any single dsv3 command in this probe; past it: a hang
WALL_CLOCK = {"tokens_per_s"}


class Tally:
    def __init__(self):
        self.cases: dict[str, int] = {}
        self.counts = {
            "tracebacks": 0,
            "exit0_on_bad_input": 0,
            "mixed_runs": 0,
            "hangs_beyond_timeout": 0,
            "other_failures": 0,
        }
        self.failures: list[str] = []
        self.figures: dict[str, object] = {}

    def case(self, kind: str, n: int = 1):
        self.cases[kind] = self.cases.get(kind, 0) + n

    def fail(self, count: str, what: str):
        self.counts[count] += 1
        self.failures.append(f"[{count}] {what}")
        log(f"  FAIL [{count}] {what[:2000]}")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def dsv3(*args, timeout=COMMAND_LIMIT_S) -> subprocess.CompletedProcess:
    """`dsv3 ARGS` in a fresh process (rc None: killed at `timeout`)."""
    cmd = [sys.executable, "-m", "dsv3_plugin", *map(str, args)]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
    )
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    return subprocess.CompletedProcess(cmd, rc, out, err)


@contextlib.contextmanager
def captured():
    """Capture fd 1 and 2 (also what spawned ranks write) of an in-process `dsv3` call."""
    box = {}
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(files[0].fileno(), 1), os.dup2(files[1].fileno(), 2)
    try:
        yield box
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, s in zip((1, 2), saved):
            os.dup2(s, fd)
            os.close(s)
        for key, f in zip(("out", "err"), files):
            f.seek(0)
            box[key] = f.read().decode(errors="replace")
            f.close()


def cli(argv: list[str]) -> tuple[int | str, str]:
    """`dsv3 ARGV` in this process: (exit code, or "exception" if one escaped; captured stdout + stderr)."""
    from dsv3_plugin.cli import main

    with captured() as box:
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  what this probe counts
            rc = "exception"
            print(traceback.format_exc(), file=sys.stderr)
    return rc, box["out"] + box["err"]


def check_refusal(t: Tally, what: str, rc, text: str, want_rc: int = 2) -> bool:
    """One refusal: exit `want_rc`, exactly one `error:` line, no traceback."""
    ok = True
    if rc == "exception" or "Traceback (most recent call last)" in text:
        t.fail("tracebacks", f"{what}: {text[-1500:]}")
        ok = False
    if rc == 0:
        t.fail("exit0_on_bad_input", f"{what}: exit 0")
        return False
    if rc is None:
        t.fail("hangs_beyond_timeout", f"{what}: still running after {COMMAND_LIMIT_S}s")
        return False
    if ok and (rc != want_rc or sum(x.startswith("error:") for x in text.splitlines()) != 1):
        t.fail("other_failures", f"{what}: exit {rc}, wanted {want_rc} with one 'error:' line: {text[-1500:]}")
        ok = False
    return ok


def write(path: str, obj) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def metrics(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f if x.strip()]


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in WALL_CLOCK}


# --- 1. config fuzz -------------------------------------------------------------------------------------------


def probe_config_fuzz(t: Tally, work: str, seed: int, train_accepted) -> None:
    os.environ["DSV3_FUZZ_SEED"] = str(seed)
    import test_config_fuzz as fz

    fz.SEED = seed
    cases = fz._cases()
    base = json.dumps(fz.default_ds_config())
    hostile = [
        (base.encode("utf-16"), 2, "UTF-16 file"),
        (base.replace("tiny", "t\u00efny").encode("latin-1"), 2, "latin-1 file"),
        (b"\xef\xbb\xbf" + base.encode(), 2, "UTF-8 BOM"),
        (("[" * 10000 + "]" * 10000).encode(), 2, "10000-deep nesting"),
    ]
    files = [(text.encode(), world, what) for text, world, what in cases] + hostile
    log(f"config fuzz: seed {seed}, {len(cases)} mutations + {len(hostile)} hostile files")
    accepted = []
    for i, (data, world, what) in enumerate(files):
        path = os.path.join(work, f"fuzz{i}.json")
        with open(path, "wb") as f:
            f.write(data)
        rc, text = cli(["check-config", path, "--nproc", world])
        t.case("config_fuzz")
        where = f"fuzz case {i} ({what})"
        if rc == 0:
            try:
                fz._builds(path, world)  # dsv3 train's pre-spawn check + the model on the meta device
                accepted.append((path, world, what))
            except Exception as e:  # noqa: BLE001
                t.fail(
                    "other_failures",
                    f"{where}: check-config accepted it, train's check refuses: {type(e).__name__}: {e}",
                )
            continue
        check_refusal(t, where, rc, text)
    t.figures["config_fuzz_accepted"] = len(accepted)
    if train_accepted == "all":
        sample = accepted
    else:
        k = min(int(train_accepted), len(accepted))
        sample = [accepted[round(j * (len(accepted) - 1) / max(1, k - 1))] for j in range(k)] if k else []
    log(f"config fuzz: {len(accepted)} accepted; training {len(sample)} of them for one step")
    for j, (path, world, what) in enumerate(sample):
        r = dsv3(
            "train",
            "--config",
            path,
            "--nproc",
            world,
            "--steps",
            1,
            "--out",
            os.path.join(work, f"ft{j}"),
            "--no-progress",
            "--json",
        )
        t.case("config_fuzz_trained")
        where = f"accepted fuzz config {os.path.basename(path)} ({what}), dsv3 train --nproc {world}"
        if r.returncode is None:
            t.fail("hangs_beyond_timeout", f"{where}: still running after {COMMAND_LIMIT_S}s")
        elif "Traceback (most recent call last)" in r.stderr:
            t.fail("tracebacks", f"{where}: {r.stderr[-1500:]}")
        elif r.returncode != 0:
            t.fail(
                "other_failures", f"{where}: check-config accepted it, train exits {r.returncode}: {r.stderr[-800:]}"
            )
        else:
            losses = [json.loads(x).get("loss") for x in r.stdout.splitlines() if x.startswith('{"step"')]
            if not losses or not all(math.isfinite(v) for v in losses):
                t.fail("exit0_on_bad_input", f"{where}: trained with loss {losses}")


# --- 2. corrupted checkpoints ---------------------------------------------------------------------------------


def probe_corrupt_checkpoints(t: Tally, work: str) -> None:
    import test_checkpoint_corruptions as cc
    import test_checkpoint_nonfinite as nf
    from test_checkpoint_reader import _rewrite, _shard_of

    clean = nf.make_loadable_fp8_ckpt(os.path.join(work, "clean"))
    cfg = write(
        os.path.join(work, "init_from.json"),
        {
            "train_micro_batch_size_per_gpu": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "dsv3": {"preset": "tiny", "train": {"seq_len": 16, "steps": 1}},
        },
    )
    damages = {f"corrupt:{k}": v[0] for k, v in cc.CASES.items()}
    for k, (name, edit, _) in nf.CASES.items():
        damages[f"non-finite:{k}"] = lambda d, name=name, edit=edit: _rewrite(d, _shard_of(d, name), edit)
    log(f"corrupted checkpoints: {len(damages)} damaged directories x 4 entry points")
    for n, (case, damage) in enumerate(sorted(damages.items())):
        d = os.path.join(work, f"bad{n}")
        shutil.copytree(clean, d)
        damage(d)
        t.case("corrupt_checkpoints")
        runs = {
            "convert --to hf-bf16": ["convert", d, os.path.join(work, f"cv{n}"), "--to", "hf-bf16", "--no-progress"],
            "convert --to megatron": [
                "convert",
                d,
                os.path.join(work, f"cm{n}"),
                "--to",
                "megatron",
                "--pp",
                2,
                "--ep",
                2,
                "--no-progress",
            ],
            "generate": ["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", 2],
            "train --init-from": [
                "train",
                "--config",
                cfg,
                "--init-from",
                d,
                "--nproc",
                1,
                "--no-progress",
                "--out",
                os.path.join(work, f"ti{n}"),
            ],
        }
        for what, argv in runs.items():
            rc, text = cli(argv)
            t.case("corrupt_checkpoint_commands")
            check_refusal(t, f"{case}: dsv3 {what}", rc, text)
            if what.startswith("convert") and os.path.exists(argv[2]):
                t.fail("other_failures", f"{case}: dsv3 {what} left {argv[2]}")
        shutil.rmtree(d, ignore_errors=True)


# --- 3. kill -9 of dsv3 train during a checkpoint save --------------------------------------------------------

TRAIN_DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
    "dsv3": {
        "preset": "tiny",
        "moe": {"bias_update_speed": 0.01},
        "train": {"seq_len": 16, "seed": 11, "save_every": 1},
    },
}
TRAIN_STEPS = 8


def _kill_during_save(out: str, cfg: str, kill_after_step: int, when: str) -> tuple[str, str]:
    """Start `dsv3 train`, SIGKILL its whole process group (launcher and ranks) inside the save of the first
    checkpoint tag after `kill_after_step`: `when` = "tag" the moment its directory appears, "latest" the moment
    DeepSpeed's `latest` names it (its files are written, the completion marker is not yet). Returns (what the
    kill hit, stderr)."""
    from dsv3_plugin.training.checkpoint_tags import COMPLETE_MARKER

    cmd = [
        sys.executable,
        "-m",
        "dsv3_plugin",
        "train",
        "--config",
        cfg,
        "--nproc",
        "2",
        "--steps",
        TRAIN_STEPS,
        "--out",
        out,
        "--no-progress",
    ]
    p = subprocess.Popen(
        list(map(str, cmd)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    ck = os.path.join(out, "ckpt")
    deadline = time.monotonic() + COMMAND_LIMIT_S
    hit = "never saw the save: the run ended first"
    while p.poll() is None and time.monotonic() < deadline:
        try:
            tags = [n for n in os.listdir(ck) if n.startswith("step") and int(n[4:]) > kill_after_step]
        except (OSError, ValueError):
            tags = []
        if tags and when == "latest":
            try:
                with open(os.path.join(ck, "latest")) as f:
                    named = f.read().strip()
            except OSError:
                named = ""
            tags = [n for n in tags if n == named]
        if tags:
            os.killpg(p.pid, signal.SIGKILL)
            tag = max(tags, key=lambda n: int(n[4:]))
            hit = (
                f"mid-save of {tag}"
                if not os.path.exists(os.path.join(ck, tag, COMPLETE_MARKER))
                else f"after {tag} was complete"
            )
            break
        time.sleep(0.0005)
    else:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            hit = "hang"
    _, err = p.communicate()
    return hit, err


def probe_kill_train(t: Tally, work: str, want_mid_save: int = 4, attempts: int = 8) -> None:
    cfg = write(os.path.join(work, "kill.json"), TRAIN_DS)
    ref = os.path.join(work, "uninterrupted")
    r = dsv3("train", "--config", cfg, "--nproc", 2, "--steps", TRAIN_STEPS, "--out", ref, "--no-progress")
    if r.returncode != 0:
        t.fail("other_failures", f"uninterrupted reference run failed ({r.returncode}): {r.stderr[-1500:]}")
        return
    want = [strip(x) for x in metrics(ref)]
    # resuming the finished run on another number of ranks, or with another model: refused, nothing touched
    other = copy.deepcopy(TRAIN_DS)
    other["dsv3"]["model"] = {"hidden_size": 96}
    for what, argv in {
        "--resume on 1 rank of a 2-rank run": ["--config", cfg, "--nproc", 1, "--out", ref],
        "--resume with another model": [
            "--config",
            write(os.path.join(work, "other.json"), other),
            "--nproc",
            2,
            "--out",
            os.path.join(work, "other"),
        ],
    }.items():
        r = dsv3("train", *argv, "--resume", ref, "--steps", TRAIN_STEPS + 2, "--no-progress")
        t.case("resume_refused")
        check_refusal(t, what, r.returncode, r.stderr)
    if [strip(x) for x in metrics(ref)] != want:
        t.fail("mixed_runs", "a refused --resume changed the run it was refused for")
    mid = 0
    for a in range(attempts):
        if mid >= want_mid_save:
            break
        out = os.path.join(work, f"killed{a}")
        after, when = 1 + (a * 2) % (TRAIN_STEPS - 2), ("tag", "latest")[a % 2]  # steps 1, 3, 5, 1, ...
        hit, err = _kill_during_save(out, cfg, after, when)
        t.case("kill9_train")
        log(f"kill -9 of dsv3 train #{a} (first save after step {after}, when its {when} appears): {hit}")
        if hit == "hang":
            t.fail("hangs_beyond_timeout", f"kill -9 train #{a}: run did not reach a save in {COMMAND_LIMIT_S}s")
            continue
        if "Traceback (most recent call last)" in err:
            t.fail("tracebacks", f"kill -9 train #{a}, before the kill: {err[-1500:]}")
        mid += hit.startswith("mid-save")
        r = dsv3(
            "train",
            "--config",
            cfg,
            "--nproc",
            2,
            "--steps",
            TRAIN_STEPS,
            "--out",
            out,
            "--resume",
            out,
            "--no-progress",
        )
        where = f"kill -9 train #{a} ({hit}), then --resume"
        if r.returncode is None:
            t.fail("hangs_beyond_timeout", f"{where}: still running after {COMMAND_LIMIT_S}s")
            continue
        if "Traceback (most recent call last)" in r.stderr:
            t.fail("tracebacks", f"{where}: {r.stderr[-1500:]}")
        if r.returncode != 0:
            t.fail("other_failures", f"{where}: exit {r.returncode}: {r.stderr[-1500:]}")
            continue
        for note in (x for x in r.stderr.splitlines() if x.startswith("dsv3 train: ")):
            log(f"  resume said: {note}")
            t.case("kill9_train_resume_notes")
        got = [strip(x) for x in metrics(out)]
        if got != want:
            steps = [x.get("step") for x in got]
            diff = next((w["step"] for g, w in zip(got, want) if g != w), None)
            t.fail(
                "mixed_runs",
                f"{where}: metrics differ from the uninterrupted run (steps {steps}, first differing step {diff})",
            )
    t.case("kill9_train_mid_save", mid)
    if mid == 0:
        t.fail("other_failures", f"kill -9 train: none of {attempts} kills landed inside a checkpoint save")


# --- 4. kill -9 of dsv3 convert -------------------------------------------------------------------------------


def _same_tree(a: str, b: str) -> str | None:
    fa = sorted(os.path.relpath(os.path.join(r, n), a) for r, _, ns in os.walk(a) for n in ns)
    fb = sorted(os.path.relpath(os.path.join(r, n), b) for r, _, ns in os.walk(b) for n in ns)
    if fa != fb:
        return f"file lists differ: {sorted(set(fa) ^ set(fb))}"
    for f in fa:
        if not filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False):
            return f"{f} differs"
    return None


def _partial_appears(p: subprocess.Popen, parent: str, dst: str) -> float | None:
    """When `dsv3 convert`'s hidden output directory for `dst` appears (None: the process ended first)."""
    partial = f".{os.path.basename(dst)}.partial-"
    deadline = time.monotonic() + COMMAND_LIMIT_S
    while p.poll() is None and time.monotonic() < deadline:
        if any(n.startswith(partial) for n in os.listdir(parent)):
            return time.monotonic()
        time.sleep(0.001)
    return None


def probe_kill_convert(t: Tally, work: str, rng: random.Random, kills: int = 6) -> None:
    import torch
    from test_checkpoint_reader import tiny_hf_cfg

    from dsv3_plugin.checkpoint.synthetic import write_released_checkpoint

    src = os.path.join(work, "convert_src")
    # larger than the tiny preset so that a conversion takes long enough to be interrupted (~60 MB of FP8)
    hf = tiny_hf_cfg(
        hidden_size=512,
        moe_intermediate_size=256,
        intermediate_size=1024,
        n_routed_experts=32,
        num_hidden_layers=4,
        vocab_size=4096,
    )
    g = torch.Generator().manual_seed(5)
    write_released_checkpoint(
        src, hf, lambda n, s: torch.randn(s, generator=g) * 0.05, shard_bytes=8 * 2**20, block=(128, 128)
    )
    targets = [["--to", "hf-bf16"], ["--to", "megatron", "--pp", "2", "--ep", "2"]]
    refs, writing_s = [], []
    for i, tgt in enumerate(targets):
        ref = os.path.join(work, f"convert_ref{i}")
        p = subprocess.Popen(
            [sys.executable, "-m", "dsv3_plugin", "convert", src, ref, *tgt, "--no-progress"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        began = _partial_appears(p, work, ref)
        err = p.communicate()[1]
        if p.returncode != 0 or began is None:
            t.fail("other_failures", f"uninterrupted convert {tgt} failed: {err[-1500:]}")
            return
        refs.append(ref)
        writing_s.append(time.monotonic() - began)  # from the first output directory to the exit
    for k in range(kills):
        tgt, ref = targets[k % 2], refs[k % 2]
        dst = os.path.join(work, f"convert_dst{k}")
        cmd = [sys.executable, "-m", "dsv3_plugin", "convert", src, dst, *tgt, "--no-progress"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
        partial = f".{os.path.basename(dst)}.partial-"
        delay = rng.uniform(0.0, 0.8 * writing_s[k % 2])
        if _partial_appears(p, work, dst) is not None:  # its output started: kill it a random time later
            time.sleep(delay)
        finished = p.poll() is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        t.case("kill9_convert")
        where = f"kill -9 convert #{k} ({' '.join(tgt)}, {delay:.2f}s into writing)"
        if os.path.exists(dst):  # renamed into place before the kill: it must be the complete output
            diff = _same_tree(ref, dst)
            if diff:
                t.fail("other_failures", f"{where}: a partial DST exists ({diff})")
            else:
                log(f"{where}: DST was complete before the kill (not counted as interrupted)")
        elif finished:
            t.fail("other_failures", f"{where}: convert ended before the kill without writing DST")
        else:
            t.case("kill9_convert_interrupted")
        if os.path.exists(dst):
            shutil.rmtree(dst)
        r = dsv3("convert", src, dst, *tgt, "--no-progress")
        if r.returncode != 0 or "Traceback (most recent call last)" in r.stderr:
            t.fail(
                "tracebacks" if "Traceback" in r.stderr else "other_failures",
                f"{where}, rerun: exit {r.returncode}: {r.stderr[-1500:]}",
            )
            continue
        diff = _same_tree(ref, dst)
        if diff:
            t.fail("other_failures", f"{where}, rerun: not byte-identical to the uninterrupted output: {diff}")
        left = [n for n in os.listdir(work) if n.startswith(partial)]
        if left:
            t.fail("other_failures", f"{where}, rerun: left {left}")
        shutil.rmtree(dst)


# --- 5. two runs into one --out -------------------------------------------------------------------------------


def _check_one_run(t: Tally, out: str, steps: int | None, where: str) -> None:
    """metrics.jsonl holds steps 1..`steps` (None: 1..whatever was logged) of one run, in order."""
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            got = [json.loads(x)["step"] for x in f if x.endswith("\n")]  # a killed run may tear the last line
    except (OSError, ValueError, KeyError) as e:
        t.fail("mixed_runs", f"{where}: metrics.jsonl unreadable: {e}")
        return
    if got != list(range(1, (len(got) if steps is None else steps) + 1)) or not got:
        t.fail("mixed_runs", f"{where}: metrics.jsonl steps {got}")


def probe_concurrent(t: Tally, work: str) -> None:
    ds = copy.deepcopy(TRAIN_DS)
    ds["dsv3"]["train"]["save_every"] = 2
    cfg = write(os.path.join(work, "concurrent.json"), ds)

    def start(out, steps):
        cmd = [
            sys.executable,
            "-m",
            "dsv3_plugin",
            "train",
            "--config",
            cfg,
            "--nproc",
            "2",
            "--steps",
            str(steps),
            "--out",
            out,
            "--no-progress",
        ]
        return subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True
        )

    def finish(p):
        try:
            out, err = p.communicate(timeout=COMMAND_LIMIT_S)
            return p.returncode, err
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            return None, p.communicate()[1]

    for k in range(2):  # started at the same moment
        out = os.path.join(work, f"together{k}")
        a, b = start(out, 4), start(out, 4)
        (ra, ea), (rb, eb) = finish(a), finish(b)
        t.case("concurrent_out")
        where = f"two dsv3 train started together into one --out (#{k})"
        if None in (ra, rb):
            t.fail("hangs_beyond_timeout", f"{where}: exit codes {ra}, {rb}")
            continue
        if sorted((ra, rb)) != [0, 2]:
            t.fail(
                "mixed_runs" if (ra, rb) == (0, 0) else "other_failures",
                f"{where}: exit codes {ra}, {rb}: {(ea + eb)[-1500:]}",
            )
        for e in (ea, eb):
            if "Traceback (most recent call last)" in e:
                t.fail("tracebacks", f"{where}: {e[-1500:]}")
        loser = eb if ra == 0 else ea
        log(
            f"{where}: exit codes {ra}, {rb}; refused with: "
            f"{next((x for x in loser.splitlines() if x.startswith('error:')), '(no error line)')[:300]}"
        )
        if "error: --out" not in loser:
            t.fail("other_failures", f"{where}: the refused run does not name --out: {loser[-800:]}")
        _check_one_run(t, out, 4, where)

    out = os.path.join(work, "while_training")  # one while the other trains (then killed: it would run for hours)
    a = start(out, 100000)
    lock = os.path.join(out, ".dsv3.lock")
    holder, deadline = None, time.monotonic() + COMMAND_LIMIT_S
    while holder is None and a.poll() is None and time.monotonic() < deadline:
        try:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                if f.readline().endswith("\n"):
                    with open(lock) as g:
                        holder = json.load(g)["pid"]
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    r = dsv3("train", "--config", cfg, "--nproc", 2, "--steps", 3, "--out", out, "--no-progress")
    t.case("concurrent_out")
    where = "a second dsv3 train into the --out of a running one"
    check_refusal(t, where, r.returncode, r.stderr)
    if holder is None or f"pid {holder} " not in r.stderr:
        t.fail("other_failures", f"{where}: refusal does not name the holder (pid {holder}): {r.stderr[-800:]}")
    alive = a.poll() is None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(a.pid, signal.SIGKILL)
    ea = a.communicate()[1]
    if not alive:
        t.fail("other_failures", f"{where}: the first run ended early ({a.returncode}): {ea[-1500:]}")
    _check_one_run(t, out, None, where)


# --- 6. a stopped peer ----------------------------------------------------------------------------------------


def probe_stopped_peer(t: Tally, work: str, timeout_s: float = 8.0) -> None:
    import test_pipeline_stopped_peer as sp

    worst = 0.0
    for n, (layout, victim) in enumerate([("pp2", 0), ("pp2", 1), ("ep2x2", 1), ("ep2x2", 2)]):
        d = os.path.join(work, f"stop{n}")
        os.makedirs(d)
        where = f"SIGSTOP of rank {victim} ({layout}, parallel.p2p_timeout_s = {timeout_s:g})"
        try:
            r = sp.stop_a_rank(d, layout, victim, timeout_s=timeout_s)
        except AssertionError as e:
            t.fail("other_failures", f"{where}: {e}")
            continue
        t.case("stopped_peer")
        log(f"{where}: exit {r['rc']} after {r['after_stop_s']}")
        if r["rc"] is None:
            t.fail("hangs_beyond_timeout", f"{where}: still running {4 * timeout_s + 60:g}s after the stop")
            continue
        worst = max(worst, r["after_stop_s"])
        err = r["stderr"]
        if "Traceback (most recent call last)" in err:
            t.fail("tracebacks", f"{where}: {err[-1500:]}")
        if r["rc"] == 0 or f"p2p_timeout_s = {timeout_s:g}s" not in err:
            t.fail("other_failures", f"{where}: exit {r['rc']}, message does not name the timeout: {err[-1500:]}")
    t.figures["stopped_peer_worst_exit_after_stop_s"] = round(worst, 1)
    t.figures["stopped_peer_timeout_s"] = timeout_s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--seed",
        type=int,
        default=int(os.environ.get("DSV3_FUZZ_SEED", "20261201")),
        help="config fuzz seed (that of tests/unit/test_config_fuzz.py by default)",
    )
    ap.add_argument("--train-accepted", default="12", help="accepted fuzz configs to train one step ('all': every one)")
    ap.add_argument("--keep", help="work in this directory and keep it (default: a temporary one, removed)")
    ap.add_argument(
        "--only",
        action="append",
        help="run only this part (repeatable): config_fuzz, "
        "corrupt_checkpoints, kill9_train, kill9_convert, concurrent_out, stopped_peer",
    )
    args = ap.parse_args(argv)
    os.nice(10)
    t0 = time.perf_counter()
    work = args.keep or tempfile.mkdtemp(prefix="dsv3-probe-")
    os.makedirs(work, exist_ok=True)
    t = Tally()
    rng = random.Random(args.seed)
    parts = [
        ("config_fuzz", lambda d: probe_config_fuzz(t, d, args.seed, args.train_accepted)),
        ("corrupt_checkpoints", lambda d: probe_corrupt_checkpoints(t, d)),
        ("kill9_train", lambda d: probe_kill_train(t, d)),
        ("kill9_convert", lambda d: probe_kill_convert(t, d, rng)),
        ("concurrent_out", lambda d: probe_concurrent(t, d)),
        ("stopped_peer", lambda d: probe_stopped_peer(t, d)),
    ]
    walls = {}
    try:
        for name, fn in parts:
            if args.only and name not in args.only:
                continue
            log(f"== {name}")
            d = os.path.join(work, name)
            os.makedirs(d, exist_ok=True)
            s = time.perf_counter()
            try:
                fn(d)
            except Exception:  # noqa: BLE001  a crash of the probe itself is a failure, not a silent pass
                t.fail("other_failures", f"{name}: the probe crashed: {traceback.format_exc()[-3000:]}")
            walls[name] = round(time.perf_counter() - s, 1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res = {
        "seed": args.seed,
        "cases": t.cases,
        **t.counts,
        "figures": t.figures,
        "wall_s_by_part": walls,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(res))
    return 0 if not any(t.counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
