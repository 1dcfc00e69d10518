"""dsv3 train on prepared data (2 gloo ranks): fine-tuning the tiny released checkpoint (FP8, MTP, padded
vocabulary) on Python's docs prepared by `dsv3 prepare-data`'s `prepare`. The LM loss and the held-out eval_loss
fall; N + N resumed steps equal 2N straight steps bit for bit (every logged metric including eval_loss, the router
biases, the weights) at ep = 2 (dp = 2, packed rows) and at pp = 2 (1F1B, unpacked padded rows); the run says first
what it trains on; `dsv3 train --resume` with other data is refused before any rank starts.

Bit-exact (torch.equal / ==) because both sides run the same ops on the same batches: batches are a pure function
of (seed, epoch, step, micro-batch, rank) and evaluation changes no state."""

import contextlib
import copy
import io
import json
import os

import pytest
from helpers import run_ranks, zero1_ds

N = 10  # steps per leg: N + N resumed == 2N straight
EVAL_EVERY = 5
KEYS = ["loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "maxvio_layers", "tokens_seen", "gamma", "lr"]


def _ds(data: dict, **dsv3) -> dict:
    block = {"train": {"seq_len": 32, "seed": 5, "data": data}, "moe": {"bias_update_speed": 0.01}, **dsv3}
    return zero1_ds(block, warmup_steps=5)


def _layouts(prep):
    data = {"train": [prep["train"]], "valid": [prep["valid"]], "eval_every": EVAL_EVERY, "eval_batches": 2}
    return {
        "ep2": _ds(data, parallel={"ep": 2}),
        "pp2": _ds({**data, "packing": False}, parallel={"pp": 2, "schedule": "1f1b"}),
    }


def _first_leg(prep, tmp):
    from dsv3_plugin.deepspeed.train import train

    out = {}
    # --init-from without data: the first line says the data is synthetic (first: a pp = 1, ep = 1 engine after
    # an ep = 2 one in the same process finds DeepSpeed's expert groups of that run)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        syn = train(
            zero1_ds({"train": {"seq_len": 16}}, warmup_steps=1),
            steps=1,
            init_from=prep["rel"],
            progress=False,
            summary=True,
        )
    out["synthetic_first_line"] = err.getvalue().splitlines()[0] if err.getvalue() else ""
    out["synthetic_data"] = syn["summary"]["data"]
    for name, ds in _layouts(prep).items():
        kw = dict(init_from=prep["rel"], progress=False)
        out[f"{name}_full"] = train(copy.deepcopy(ds), steps=2 * N, out=f"{tmp}/{name}_full", **kw)
        out[f"{name}_half"] = train(copy.deepcopy(ds), steps=N, out=f"{tmp}/{name}_half", **kw)
    return out


def _second_leg(prep, tmp):
    from dsv3_plugin.deepspeed.train import train

    return {
        name: train(
            copy.deepcopy(ds),
            steps=2 * N,
            out=f"{tmp}/{name}_half",
            resume=f"{tmp}/{name}_half",
            init_from=prep["rel"],
            progress=False,
        )
        for name, ds in _layouts(prep).items()
    }


@pytest.fixture(scope="module")
def prep(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
    from dsv3_plugin.data.prepare import prepare
    from dsv3_plugin.data.tokenizer import pydoc_texts

    tmp = tmp_path_factory.mktemp("data")
    rel = write_tiny_release(tmp / "rel")
    texts = pydoc_texts()
    out = {"rel": str(rel), "tmp": str(tmp)}
    for name, part in (("train", texts[:60]), ("valid", texts[60:70])):
        with open(tmp / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
        prepare([str(tmp / f"{name}.jsonl")], str(rel), str(tmp / name), progress=False)
        out[name] = str(tmp / name)
    return out


@pytest.fixture(scope="module")
def legs(prep, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("runs"))
    first = run_ranks(_first_leg, 2, prep, tmp)
    second = run_ranks(_second_leg, 2, prep, tmp)  # fresh processes
    return first, second, tmp


def test_finetune_loss_and_eval_loss_fall(legs):
    first, _, tmp = legs
    for name in ("ep2", "pp2"):
        h = first[0][f"{name}_full"]["history"]
        assert h[-1]["lm_loss"] < h[0]["lm_loss"] - 0.3, name
        evals = [(r["step"], r["eval_loss"]) for r in h if "eval_loss" in r]
        assert [s for s, _ in evals] == list(range(EVAL_EVERY, 2 * N + 1, EVAL_EVERY))
        assert evals[-1][1] < evals[0][1] - 0.2, (name, evals)
        summ = first[0][f"{name}_full"]["summary"]
        assert summ["eval_loss"] == evals[-1][1]
        assert summ["data_wait_s"] >= 0 and 0 <= summ["data_wait_pct"] < 100
        assert "60 documents" in summ["data"] and ("packed" in summ["data"]) == (name == "ep2")
        assert sorted(os.listdir(f"{tmp}/{name}_full/tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]
        marker = json.load(open(f"{tmp}/{name}_full/ckpt/step{2 * N}/dsv3_complete.json"))
        assert marker["data"]["kind"] == "prepared" and marker["data"]["packing"] == (name == "ep2")


def test_resume_bit_exact_on_real_data(legs):
    first, second, tmp = legs
    for name in ("ep2", "pp2"):
        full, half, resumed = first[0][f"{name}_full"], first[0][f"{name}_half"], second[0][name]
        assert [r["step"] for r in resumed["history"]] == list(range(N + 1, 2 * N + 1))
        for got, want in zip(half["history"] + resumed["history"], full["history"]):
            keys = KEYS + ["eval_loss"] * ("eval_loss" in want)
            assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, f"{name} step {want['step']} differs"
        assert resumed["router_bias"] == full["router_bias"], name
        assert resumed["param_checksum"] == full["param_checksum"], name
        # every rank logs the same metrics (means over ranks), also the evaluation (summed over ranks)
        per_rank = [[{k: r.get(k) for k in [*KEYS, "eval_loss"]} for r in second[i][name]["history"]] for i in (0, 1)]
        assert per_rank[0] == per_rank[1], name
        with open(f"{tmp}/{name}_half/metrics.jsonl") as f:
            assert [json.loads(x)["step"] for x in f] == list(range(1, 2 * N + 1))


def test_init_from_without_data_says_synthetic_first(legs):
    first, _, _ = legs
    line = first[0]["synthetic_first_line"]
    assert line.startswith("dsv3 train: training on synthetic data") and "--init-from does not change" in line
    assert "synthetic" in first[0]["synthetic_data"] and "--init-from does not change" in first[0]["synthetic_data"]


def test_resume_with_other_data_is_refused_before_any_rank(legs, prep, tmp_path, capsys):
    from dsv3_plugin.cli import main

    _, _, tmp = legs
    run = f"{tmp}/ep2_half"
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(_layouts(prep)["ep2"]))
    before = sorted(os.listdir(f"{run}/ckpt")), open(f"{run}/metrics.jsonl").read()
    args = [
        "train",
        "--config",
        str(cfg),
        "--init-from",
        prep["rel"],
        "--out",
        run,
        "--resume",
        run,
        "--steps",
        str(3 * N),
        "--no-progress",
    ]
    assert main([*args, "--data", prep["valid"]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --resume {run}: step{2 * N} was trained on other data")
    assert "dsv3.train.data.train.0: " in err[0]
    cfg.write_text(json.dumps(_layouts(prep)["ep2"] | {"gradient_accumulation_steps": 1}))
    assert main(args) == 2
    assert "gradient_accumulation_steps: 2 in the checkpoint's run, 1 now" in capsys.readouterr().err
    assert (sorted(os.listdir(f"{run}/ckpt")), open(f"{run}/metrics.jsonl").read()) == before  # nothing ran
