"""DualPipeV and DualPipe as Megatron's pipeline schedule, through Megatron's own `pretrain()` (`python -m
dsv3_plugin.megatron.pretrain_gpt`, run as a user runs it, gloo on CPU): Megatron's GPTModel built from our spec
(`--spec dsv3_plugin.megatron layer_spec`) cut into DualPipeV's V (`--pipeline-model-parallel-size 2
--dsv3-pipeline-schedule dualpipev`: rank r holds stages r and 3-r, embedding, head, MTP and loss on rank 0), into
DualPipe's two mirrored copies (the dsv3 block's `"schedule": "dualpipe"`, with the W split: rank r holds stage r
of copy A and stage 1-r of copy B; micro-batches 0-1 enter at rank 0, 2-3 at rank 1), and our 1F1B through the
same hook as the baseline, against the PP = 1 run on the same data and global batch.

Same starting point for all four: the PP = 1 run (one rank, Megatron's no-pipelining schedule) trains 10
iterations and saves a torch_dist checkpoint at iteration 5; the PP = 2 runs load it (Megatron reshards by the
global layer numbers the V layout gives every layer, so a wrong placement fails to load or computes something
else) and train iterations 6..10. Tiny model: 4 layers (1 dense, 3 MoE), MTP depth 1, micro-batch 2, global
batch 8 (4 micro-batches, the least DualPipeV takes at PP = 2), sequence 32, fp32, OMP_NUM_THREADS=1.

Needs megatron-core >= 0.19 (`megatron.training` in the wheel): skipped on 0.16.1 (the V chunks and the schedule
run there in tests/megatron/test_dualpipev_chunks.py, without `pretrain()`).
"""

import json
import os
import re
import sys
import time

import pytest
from helpers import MEGATRON_SPEC, run_module, tiny_megatron_args

pytest.importorskip(
    "megatron.training",
    reason="megatron-core < 0.19: no megatron.training (Megatron's pretrain() "
    "loop) in the wheel; the V chunks and the schedule are tested there by test_dualpipev_chunks.py",
)
pytestmark = pytest.mark.dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DSV3 = {"preset": "tiny", "model": {"num_hidden_layers": 4}}
DSV3_DUALPIPE = {**DSV3, "parallel": {"pp": 2, "schedule": "dualpipe", "split_weight_grads": True}}
MBS, GBS, SEQ = 2, 8, 32
FLAGS = MEGATRON_SPEC + tiny_megatron_args(11, mbs=MBS, gbs=GBS, seq=SEQ)
LOADED = 5  # the PP = 2 runs resume from the iteration-5 checkpoint


def _run(tmp, name, nproc, extra, config="ds.json"):
    metrics = tmp / f"{name}.jsonl"
    cmd = (
        [
            sys.executable,
            "-m",
            "dsv3_plugin.megatron.pretrain_gpt",
            "--nproc",
            str(nproc),
            "--dsv3-config",
            str(tmp / config),
            "--dsv3-metrics",
            str(metrics),
        ]
        + FLAGS
        + extra
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    p = run_module(cmd, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    iter_ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", p.stdout)]
    return {
        "metrics": [json.loads(l) for l in metrics.read_text().splitlines()],
        "log": p.stdout,
        "wall_s": wall,
        "iter_ms": iter_ms,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dualpipev")
    (tmp / "ds.json").write_text(json.dumps({"dsv3": DSV3}))
    (tmp / "ds_dualpipe.json").write_text(json.dumps({"dsv3": DSV3_DUALPIPE}))
    ck, ck_v = str(tmp / "ckpt"), str(tmp / "ckpt_v")
    out = {"pp1": _run(tmp, "pp1", 1, ["--save", ck, "--save-interval", str(LOADED)])}
    load = ["--load", ck, "--ckpt-step", str(LOADED), "--pipeline-model-parallel-size", "2", "--exit-interval", "10"]
    out["dualpipev"] = _run(
        tmp,
        "dualpipev",
        2,
        load + ["--dsv3-pipeline-schedule", "dualpipev", "--save", ck_v, "--save-interval", str(LOADED)],
    )
    out["1f1b"] = _run(tmp, "1f1b", 2, load + ["--dsv3-pipeline-schedule", "1f1b"])
    # DualPipe chosen by the dsv3 block, with the W split
    out["dualpipe"] = _run(
        tmp,
        "dualpipe",
        2,
        load + ["--save", str(tmp / "ckpt_dp"), "--save-interval", str(LOADED)],
        config="ds_dualpipe.json",
    )
    out["ckpt_v"], out["ckpt_dp"] = tmp / "ckpt_v", tmp / "ckpt_dp"
    out["tmp"] = tmp
    # the curves and wall times (pytest -s shows them)
    runs_ = [k for k, r in out.items() if isinstance(r, dict)]
    print("\niteration | " + " | ".join(f"{k} lm loss" for k in runs_))
    ref = {r["iteration"]: r for r in out["pp1"]["metrics"]}
    for it in sorted(ref):
        row = [ref[it]["lm_loss"]] + [
            next((r["lm_loss"] for r in out[k]["metrics"] if r["iteration"] == it), None)
            for k in ("dualpipev", "1f1b", "dualpipe")
        ]
        print(f"{it} | " + " | ".join("-" if v is None else f"{v:.9g}" for v in row))
    for k, r in out.items():
        if not isinstance(r, dict):
            continue
        its = r["iter_ms"][1:] or r["iter_ms"]
        print(
            f"{k}: wall {r['wall_s']:.1f} s, {len(r['iter_ms'])} iterations, median iteration "
            f"{sorted(its)[len(its) // 2]:.0f} ms (first one excluded)"
        )
    return out


def _padded_vocab(log: str) -> int:
    m = re.search(r"new size: (\d+)\)", log)
    assert m, "Megatron's padded-vocabulary line not in the log"
    return int(m.group(1))


def test_the_v_layout_is_what_runs(runs):
    log = runs["dualpipev"]["log"]
    assert (
        "pipeline schedule: the plugin's dualpipev over 2 pipeline ranks, 4 stages with [1, 1, 1, 1] decoder "
        "layers (rank r holds stages r and 3-r"
    ) in log
    assert "successfully loaded checkpoint from" in log and "at iteration 5" in log
    assert "pipeline schedule: the plugin's 1f1b over 2 pipeline ranks" in runs["1f1b"]["log"]
    assert (
        "pipeline schedule: the plugin's dualpipe over 2 pipeline ranks, two model copies of 2 stages with [2, 2] "
        "decoder layers (rank r holds stage r of copy A and stage 1-r of copy B; micro-batches 0..1 enter at rank 0, "
        "2..3 at rank 1)"
    ) in runs["dualpipe"]["log"]
    want = "the W split (dualpipe's W ops): every GEMM with a weight defers its weight gradient"
    assert want in runs["dualpipe"]["log"]
    assert "mtp_1 loss" in log  # Megatron logs the MTP loss computed on rank 0 too
    assert "mtp_1 loss" in runs["dualpipe"]["log"]
    for k in ("dualpipev", "1f1b", "dualpipe"):
        assert [r["iteration"] for r in runs[k]["metrics"]] == list(range(LOADED + 1, 11))  # 5 iterations
    assert [r["iteration"] for r in runs["pp1"]["metrics"]] == list(range(1, 12))


def test_losses_equal_the_pp1_run(runs):
    from tolerance import assert_within, model_bound

    from dsv3_plugin.config import DSv3Config

    ref = {r["iteration"]: r for r in runs["pp1"]["metrics"]}
    cfg = DSv3Config.from_block({**DSV3, "model": {**DSV3["model"], "vocab_size": _padded_vocab(runs["pp1"]["log"])}})
    for k in ("dualpipev", "1f1b", "dualpipe"):
        first, *rest = runs[k]["metrics"]
        r0 = ref[first["iteration"]]
        # Iteration 6 runs the identical op sequence on all of them: the same weights and optimizer state (one
        # checkpoint, loaded into both DualPipe copies), the same micro-batches, the same per-micro-batch ops, and
        # the per-micro-batch loss sums (and MTP tracker values) added in micro-batch order on the rank Megatron
        # reduces them on. Equal, not close.
        assert (first["lm_loss"], first["mtp_1_loss"]) == (r0["lm_loss"], r0["mtp_1_loss"]), (k, first, r0)
        assert first["router_bias_abs_sum"] == r0["router_bias_abs_sum"], (k, first, r0)  # same loads, same update
        for r in rest:
            # From iteration 7 on the weights carry the rounding of sums the pipeline orders differently: the word
            # embedding's gradient (the token lookup's and the MTP block's contributions, accumulated per micro-
            # batch at PP = 1, per copy then added at PP = 2 - locally in the V, by all-reduce in 1F1B) and the
            # gradient norm for clipping (partial sums per pipeline rank), and in DualPipe every gradient as the sum of
            # the two copies' halves of the batch (the mirror exchange). model_bound: every reduction of every
            # forward and backward since the common checkpoint reordered (2 passes per elapsed iteration, + this
            # forward), assuming - as the helper does - that neither the layers nor AdamW amplify the rounding.
            passes = 2 * (r["iteration"] - first["iteration"]) + 1
            for key in ("lm_loss", "mtp_1_loss"):
                want = ref[r["iteration"]][key]
                assert_within(
                    r[key],
                    want,
                    model_bound(_t(want), cfg, GBS * SEQ, passes=passes),
                    f"{k} iteration {r['iteration']} {key} vs PP=1 (reordered embedding-grad and grad-norm sums)",
                )


@pytest.fixture(scope="module")
def v_to_pp1(runs):
    """And back: the V's iteration-10 checkpoint, loaded at PP = 1, trains iteration 11 (only when a test asks)."""
    return _run(runs["tmp"], "v_to_pp1", 1, ["--load", str(runs["ckpt_v"])])


@pytest.mark.long  # (CI time: one more launch; `make test-long`)
def test_a_checkpoint_saved_by_the_v_resumes_at_pp1(runs, v_to_pp1):
    """The V saves Megatron checkpoints under global layer numbers (the replica of the embedding copy not
    stored twice): loaded at PP = 1 its iteration-10 weights train iteration 11 like the PP = 1 run's own."""
    from tolerance import assert_within, model_bound

    from dsv3_plugin.config import DSv3Config

    assert [r["iteration"] for r in v_to_pp1["metrics"]] == [11]
    assert "at iteration 10" in v_to_pp1["log"]
    got, want = v_to_pp1["metrics"][0], runs["pp1"]["metrics"][10]
    cfg = DSv3Config.from_block({**DSV3, "model": {**DSV3["model"], "vocab_size": _padded_vocab(runs["pp1"]["log"])}})
    for key in ("lm_loss", "mtp_1_loss"):
        # weights of iteration 10 in the V vs at PP = 1: the reorderings of iterations 6..10 (as above), + this forward
        assert_within(
            got[key],
            want[key],
            model_bound(_t(want[key]), cfg, GBS * SEQ, passes=2 * 5 + 1),
            f"iteration 11 {key} from the V's checkpoint vs PP=1",
        )


def _t(x):
    import torch

    return torch.tensor(x, dtype=torch.float64)


def test_router_biases_updated_by_finalize_model_grads(runs):
    cfg_gamma, E = 0.001, 16  # tiny preset: bias_update_speed, n_routed_experts
    for k in ("pp1", "dualpipev", "1f1b", "dualpipe"):
        s = runs[k]["metrics"]
        R = s[0]["routers"]
        assert R == 4  # 3 MoE decoder layers + the MTP layer, over all stages (DualPipe: of copy A)
        # b <- b + gamma * sign(mean - load): each of R*E entries moves by 0 or exactly gamma per iteration
        for a, b in zip(s, s[1:]):
            assert abs(b["router_bias_abs_sum"] - a["router_bias_abs_sum"]) <= R * E * cfg_gamma + 1e-6, (k, a, b)
        assert s[-1]["router_bias_abs_sum"] > s[0]["router_bias_abs_sum"], k


def test_word_embedding_copies_stay_identical(runs):
    """With MTP the last stage holds a copy of the word embedding: on rank 0 in the V (made equal at build time,
    its gradient summed with the original's each step), on the other rank in 1F1B (Megatron's embedding group).
    The float64 sums of the copies are equal at every iteration, i.e. the copies are (to that checksum) identical."""
    assert all(len(r["word_embedding_sums"]) == 1 for r in runs["pp1"]["metrics"])
    for k in ("dualpipev", "1f1b"):
        for r in runs[k]["metrics"]:
            a, b = r["word_embedding_sums"]
            assert a == b, (k, r)
    # DualPipe: each copy's embedding and its last stage's copy: four tensors, on ranks 0 and 1
    for r in runs["dualpipe"]["metrics"]:
        assert len(r["word_embedding_sums"]) == 4 and len(set(r["word_embedding_sums"])) == 1, r


def test_dualpipe_copies_stay_identical(runs):
    """DualPipe's two model copies (stage s of copy A on rank s, of copy B on rank 1-s): after every iteration's
    update the float64 sums of each stage's parameters and buffers (router biases and counts included) are equal in
    the two copies, i.e. the mirror exchange gave both the same gradients and token counts. The sums also moved
    (the copies are not equal only because nothing trained)."""
    rows = runs["dualpipe"]["metrics"]
    for r in rows:
        assert r["copy_sums"]["A"] == r["copy_sums"]["B"], r
        assert len(r["copy_sums"]["A"]) == 2
    assert rows[0]["copy_sums"]["A"] != rows[-1]["copy_sums"]["A"]


def test_dualpipe_checkpoint_stores_each_tensor_once(runs):
    """The DualPipe run saved iteration 10 with copy B's entries as replicas of copy A's: its checkpoint holds the
    same tensors, under the same keys and shapes, as the V's (one model), not a second copy."""
    from torch.distributed.checkpoint import FileSystemReader

    def entries(root):
        md = FileSystemReader(str(root / "iter_0000010")).read_metadata()
        return {k: tuple(getattr(v, "size", ())) for k, v in md.state_dict_metadata.items()}

    dp, v = entries(runs["ckpt_dp"]), entries(runs["ckpt_v"])
    model_dp = {k: s for k, s in dp.items() if not k.startswith(("optimizer.", "rng_state", "rerun_state"))}
    model_v = {k: s for k, s in v.items() if not k.startswith(("optimizer.", "rng_state", "rerun_state"))}
    assert len(model_dp) > 20 and model_dp == model_v


def test_idle_per_rank_reported_in_the_metrics(runs):
    """Every iteration run by the plugin's schedules carries each pipeline rank's busy / idle seconds as the
    runtime measured them in that step (timing itself is not asserted: only that the figures are there, per rank,
    finite and consistent); Megatron's own no-pipelining schedule (PP = 1) reports none."""
    import math

    assert all("pipeline_ranks" not in r and "pipeline_schedule" not in r for r in runs["pp1"]["metrics"])
    for k in ("dualpipev", "1f1b", "dualpipe"):
        for r in runs[k]["metrics"]:
            assert r["pipeline_schedule"] == k, (k, r)
            ranks = r["pipeline_ranks"]
            assert [e["pp"] for e in ranks] == [0, 1], (k, r)
            for e in ranks:
                for key in ("busy_s", "idle_s", "idle_fraction", "a2a_wait_s", "grad_sync_s", "wall_s"):
                    assert math.isfinite(e[key]), (k, key, e)
                assert e["busy_s"] > 0 and e["idle_s"] >= 0 and e["a2a_wait_s"] >= 0, (k, e)
                assert e["idle_fraction"] == e["idle_s"] / (e["busy_s"] + e["idle_s"]), (k, e)
                assert e["wall_s"] >= e["busy_s"], (k, e)
                # DualPipe's mirror exchange is timed apart from idle; the others have none. DualPipe runs with the W
                # split: per step, each rank's W ops ran deferred weight-gradient jobs (none without the split)
                assert (e["grad_sync_s"] > 0) == (k == "dualpipe"), (k, e)
                assert (e["w_closures"] > 0) == (k == "dualpipe") and e["fb_hook"] == 0, (k, e)
