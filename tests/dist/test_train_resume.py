"""Resume is bit-exact on CPU: 20 steps, save, resume in fresh processes, 20 more = 40 uninterrupted steps
(every logged metric, the router biases and the weights), on 2 ranks with gradient accumulation 2,
ZeRO-1, torch Adam, a warm-up LR schedule and gradient clipping."""

import copy

import pytest
import torch
from helpers import run_ranks, zero1_ds

DS = zero1_ds(
    # γ switches schedule piece mid-run (after 12 steps' tokens) and λ too: schedule state must resume.
    {
        "preset": "tiny",
        "train": {"seq_len": 16, "seed": 3},
        "memory": {"ema": True, "ema_decay": 0.9},
        "moe": {
            "bias_update_schedule": [{"until_tokens": 12 * 128, "value": 0.01}, {"until_tokens": None, "value": 0.003}]
        },
        "mtp": {
            "loss_weight_schedule": [{"until_tokens": 25 * 128, "value": 0.3}, {"until_tokens": None, "value": 0.1}]
        },
    },
    warmup_steps=30,
)


def _first_leg(tmp):
    from dsv3_plugin.deepspeed.train import train

    full = train(copy.deepcopy(DS), steps=40, out=f"{tmp}/full", progress=False, echo=False)
    half = train(copy.deepcopy(DS), steps=20, out=f"{tmp}/half", progress=False, echo=False)
    return {"full": full, "half": half, "rng": _rng_roundtrip(f"{tmp}/rng")}


def _rng_roundtrip(ckdir):
    """Each rank's RNG state comes back from the checkpoint (DeepSpeed saves client_state on rank 0 only)."""
    import torch.distributed as dist

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.training.transforms import build_model

    rank = dist.get_rank()
    engine, *_ = initialize(build_model(DSv3Config.from_block(DS["dsv3"])), copy.deepcopy(DS))
    torch.manual_seed(100 + rank)
    engine.save_checkpoint(ckdir, tag="rng")
    expected = torch.rand(4).tolist()
    torch.manual_seed(999)
    engine.load_checkpoint(ckdir)
    got = torch.rand(4).tolist()
    return {"expected": expected, "got": got}


def _second_leg(tmp):
    from dsv3_plugin.deepspeed.train import train

    return train(copy.deepcopy(DS), steps=40, out=f"{tmp}/half", resume=f"{tmp}/half", progress=False, echo=False)


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("resume"))
    first = run_ranks(_first_leg, 2, tmp)
    second = run_ranks(_second_leg, 2, tmp)  # fresh processes
    return first, second, tmp


def test_resume_is_bit_exact(legs):
    first, second, tmp = legs
    full, half, resumed = first[0]["full"], first[0]["half"], second[0]
    assert [r["step"] for r in resumed["history"]] == list(range(21, 41))
    keys = ["loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "maxvio_layers", "tokens_seen", "gamma", "lr"]
    for got, want in zip(half["history"] + resumed["history"], full["history"]):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, f"step {want['step']} differs"
    assert resumed["router_bias"] == full["router_bias"]
    assert resumed["param_checksum"] == full["param_checksum"]
    # both γ pieces and both λ pieces were exercised, on both sides of the resume
    gammas = [r["gamma"] for r in full["history"]]
    assert gammas == [0.01] * 12 + [0.003] * 28
    # every rank ends identical (ZeRO-1 all-gathers weights; biases from all-reduced counts)
    assert second[1]["router_bias"] == second[0]["router_bias"]
    assert second[1]["param_checksum"] == second[0]["param_checksum"]
    # the resumed run appended to the same metrics file: 40 lines, steps 1..40
    import json

    with open(f"{tmp}/half/metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == list(range(1, 41))


def test_per_rank_rng_state_restored(legs):
    first, _, _ = legs
    r0, r1 = first[0]["rng"], first[1]["rng"]
    assert r0["got"] == r0["expected"] and r1["got"] == r1["expected"]
    assert r0["expected"] != r1["expected"]  # ranks really had different states


def test_ema_shards_resume_bit_exact(legs):
    """memory.ema in dsv3 train: each rank's CPU EMA shard after 20+20 resumed steps = after 40 straight."""
    _, _, tmp = legs
    for rank in range(2):
        a = torch.load(f"{tmp}/full/ckpt/step40/ema_rank{rank}.pt", weights_only=True)
        b = torch.load(f"{tmp}/half/ckpt/step40/ema_rank{rank}.pt", weights_only=True)
        assert a["num_updates"] == b["num_updates"] == 40
        assert a["shadow"].keys() == b["shadow"].keys() and len(a["shadow"]) > 0
        for n in a["shadow"]:
            assert torch.equal(a["shadow"][n], b["shadow"][n]), n
