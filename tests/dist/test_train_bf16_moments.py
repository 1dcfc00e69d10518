"""`dsv3.memory.bf16_moments` in `dsv3 train` (paper §3.3: AdamW moments kept in BF16): the engine hands DeepSpeed an
`AdamWBF16Moments` as the client optimizer, ZeRO-1 wraps it and partitions its BF16 state over the data-parallel
ranks (2 gloo ranks here), a short run tracks the FP32-moment run, and `--resume` is bit-exact, moments included."""

import copy

import pytest
import torch
from helpers import run_ranks, zero1_ds

DS = zero1_ds({"preset": "tiny", "train": {"seq_len": 16, "seed": 3}, "memory": {"bf16_moments": True}}, warmup_steps=5)
STEPS = 10


def _fp32(ds):
    d = copy.deepcopy(ds)
    d["dsv3"]["memory"]["bf16_moments"] = False
    return d


def _live_state(ds, pp=1):
    """The optimizer DeepSpeed runs, inspected after one optimizer step: (wrapper, inner optimizer, per-state
    dtypes, moment elements on this rank, parameters of the model)."""
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.training.transforms import build_model

    torch.manual_seed(0)
    model = build_model(DSv3Config.from_block(ds["dsv3"]))
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if pp == 1:
        from dsv3_plugin.deepspeed import initialize

        engine, *_ = initialize(model, copy.deepcopy(ds))
        ids = torch.randint(0, 256, (2, 16))
        for _ in range(ds["gradient_accumulation_steps"]):
            out = engine(ids, labels=ids)
            engine.backward(out.loss)
            engine.step()
        engine.dsv3.remove()
    else:
        from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
        from dsv3_plugin.deepspeed.run_config import validate_ds_config

        checked = validate_ds_config(copy.deepcopy(ds), target="train", world_size=2)
        pe = PipelinedEngine(model, checked.ds, checked.cfg)
        ids = torch.randint(0, 256, (2 * pe.gas, 16))
        pe.train_step(ids, ids)
        engine = pe.engine
    inner = engine.optimizer.optimizer
    states = [s for s in inner.state.values() if s]
    return {
        "wrapper": type(engine.optimizer).__name__,
        "inner": type(inner).__name__,
        "dtypes": sorted({f"{k}:{v.dtype}" for s in states for k, v in s.items() if torch.is_tensor(v)}),
        "moment_numel": sum(s["exp_avg"].numel() for s in states),
        "moments_nonzero": all(bool(s["exp_avg_sq"].abs().sum() > 0) for s in states),
        "state_bytes": inner.state_bytes(),
        "n_params": n_params,
        "n_local": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
    }


def _first_leg(tmp):
    from dsv3_plugin.deepspeed.train import train
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    pp2 = copy.deepcopy(DS)
    pp2["gradient_accumulation_steps"] = 4
    pp2["dsv3"]["parallel"] = {"pp": 2, "schedule": "dualpipev"}
    pp2["dsv3"]["model"] = {"num_hidden_layers": 2}
    out = {
        "live": _live_state(DS),
        "fp32": train(_fp32(DS), steps=STEPS, out=f"{tmp}/fp32", progress=False),
        "full": train(copy.deepcopy(DS), steps=STEPS, out=f"{tmp}/full", progress=False),
        "half": train(copy.deepcopy(DS), steps=STEPS // 2, out=f"{tmp}/half", progress=False),
    }
    out["live_pp2"] = _live_state(pp2, pp=2)  # last: DeepSpeed keeps the pipeline's mpu in its global state
    return out


def _second_leg(tmp):
    from dsv3_plugin.deepspeed.train import train

    return train(copy.deepcopy(DS), steps=STEPS, out=f"{tmp}/half", resume=f"{tmp}/half", progress=False)


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bf16m"))
    first = run_ranks(_first_leg, 2, tmp)
    second = run_ranks(_second_leg, 2, tmp)  # fresh processes
    return first, second, tmp


def test_moments_are_bf16_in_the_live_zero1_optimizer(legs):
    first, _, _ = legs
    for rank in range(2):
        live = first[rank]["live"]
        # DeepSpeed wraps the client optimizer in its ZeRO-1 optimizer and steps ours on the flat partition
        assert live["wrapper"] == "DeepSpeedZeroOptimizer" and live["inner"] == "AdamWBF16Moments", live
        assert live["dtypes"] == ["exp_avg:torch.bfloat16", "exp_avg_sq:torch.bfloat16"], live
        assert live["moments_nonzero"], live
        assert live["state_bytes"] == 2 * 2 * live["moment_numel"]  # 4 bytes per element (FP32 moments: 8)
    # ZeRO-1 partitions the moments over the 2 data-parallel ranks: each holds its share, together all of them
    # (DeepSpeed pads each rank's partition to an equal size)
    shares = [first[r]["live"]["moment_numel"] for r in range(2)]
    n = first[0]["live"]["n_params"]
    assert shares[0] == shares[1] and n <= sum(shares) < n + 2 * 64, (shares, n)


def test_pipelined_engine_uses_bf16_moments_too(legs):
    """pp = 2 (DualPipeV) on 2 ranks: dp = 1, each rank's optimizer holds its own stages' moments, in BF16."""
    first, _, _ = legs
    for rank in range(2):
        live = first[rank]["live_pp2"]
        assert live["wrapper"] == "DeepSpeedZeroOptimizer" and live["inner"] == "AdamWBF16Moments", live
        assert live["dtypes"] == ["exp_avg:torch.bfloat16", "exp_avg_sq:torch.bfloat16"], live
        assert live["moment_numel"] >= live["n_local"] > 0, live


def test_loss_stays_close_to_fp32_moments(legs):
    first, _, _ = legs
    fp32, bf16 = first[0]["fp32"]["history"], first[0]["full"]["history"]
    assert len(fp32) == len(bf16) == STEPS
    # Step 1's loss is computed before any optimizer step: same weights, same data, same ops.
    assert bf16[0]["loss"] == fp32[0]["loss"]
    # NOTE: a stated bound, not a derived one. The per-step relative error of the Adam update from BF16 storage is
    # bounded in tests/unit/test_bf16_adamw.py, but how a perturbed update moves later losses through training
    # is not. The paper reports no observable degradation; "observable" is made concrete here as 0.1% of the
    # loss at every step of a 10-step run (the loss itself falls 2-10% per step here). Measured: <= 4e-5.
    for a, b in zip(bf16, fp32):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (a["step"], a["loss"], b["loss"])
    # and the flag is not a no-op: the moments' rounding shows in the losses after a few steps
    assert any(a["loss"] != b["loss"] for a, b in zip(bf16, fp32))
    assert first[0]["full"]["param_checksum"] != first[0]["fp32"]["param_checksum"]


def _moments(path):
    """BF16 moments of every rank's ZeRO-1 partition in a DeepSpeed checkpoint directory."""
    import glob

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    out = {}
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
        for f in sorted(glob.glob(f"{path}/zero_pp_rank_*_optim_states.pt")):
            state = torch.load(f, weights_only=True)["optimizer_state_dict"]["base_optimizer_state"]["state"]
            out[f] = {(i, k): v for i, s in state.items() for k, v in s.items()}
    return out


def test_resume_is_bit_exact_moments_included(legs):
    first, second, tmp = legs
    full, half, resumed = first[0]["full"], first[0]["half"], second[0]
    assert [r["step"] for r in resumed["history"]] == list(range(STEPS // 2 + 1, STEPS + 1))
    keys = ["loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "maxvio_layers", "tokens_seen", "gamma", "lr"]
    for got, want in zip(half["history"] + resumed["history"], full["history"]):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, f"step {want['step']} differs"
    assert resumed["router_bias"] == full["router_bias"]
    assert resumed["param_checksum"] == full["param_checksum"]
    a, b = _moments(f"{tmp}/full/ckpt/step{STEPS}"), _moments(f"{tmp}/half/ckpt/step{STEPS}")
    assert len(a) == len(b) == 2
    for fa, fb in zip(a, b):
        assert a[fa].keys() == b[fb].keys()
        for key, va in a[fa].items():
            vb = b[fb][key]
            if torch.is_tensor(va):
                assert va.dtype == vb.dtype == torch.bfloat16, key
                assert torch.equal(va, vb), (fa, key)
            else:
                assert va == vb == STEPS, key  # the optimizer's step count
