"""DeepSpeed `"bf16": {"enabled": true}` on the dsv3 path (paper §3.3 mixed precision), on 2 gloo ranks.

On the live engines, after real optimizer steps:
- every module parameter is BF16 (router weights included: one dtype per ZeRO flat group), the optimizer steps
  FP32 master partitions with FP32 Adam moments, and this rank's BF16 partition is exactly its FP32 master rounded
  to BF16 (so the master holds precision the module does not);
- the aux-loss-free router bias and its load counts stay FP32, and the bias moves by exactly the FP32 formula
  b + γ·sign(mean − load) (paper §2.1.2) on the counts all-reduced over the ranks;
for ZeRO-1's `DeepSpeedZeroOptimizer` (BF16 gradients; pp = 1 with ep = 1 and ep = 2, with FP8 GEMMs, with
`memory.bf16_moments` (then the moments are BF16), and pp = 2 DualPipeV) and
DeepSpeed's `BF16_Optimizer` (`data_types.grad_accum_dtype: fp32`, pp = 1). `dsv3 train` under bf16: 5 + 5 steps
with `--resume` are bit-identical to 10.
"""

import contextlib
import copy
import io

import pytest
import torch
from helpers import run_ranks, zero1_ds

GAMMA = 1e-3  # a step that BF16 cannot hold exactly (bf16(1e-3) = 1.0004e-3): an FP32 bias keeps it
DS = zero1_ds(
    {"preset": "tiny", "moe": {"bias_update_speed": GAMMA}, "train": {"seq_len": 16, "seed": 5}},
    warmup_steps=5,
    bf16={"enabled": True},
)
STEPS = 10


def _variant(name: str) -> dict:
    ds = copy.deepcopy(DS)
    if name == "ep2":
        ds["dsv3"]["parallel"] = {"ep": 2}
    elif name == "acc32":
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    elif name == "fp8":  # FP8 GEMMs (CPU emulation) on the BF16 activations
        ds["dsv3"]["fp8"] = {"enabled": True}
    elif name == "moments":  # + memory.bf16_moments: the client AdamW keeps BF16 moments of the FP32 masters
        ds["dsv3"]["memory"] = {"bf16_moments": True}
    elif name == "pp2":
        ds["gradient_accumulation_steps"] = 4
        ds["dsv3"]["parallel"] = {"pp": 2, "schedule": "dualpipev"}
        ds["dsv3"]["model"] = {"num_hidden_layers": 2}
    return ds


def _partitions(opt):
    """(FP32 master partitions this rank steps, the matching BF16 partitions of the module's flat buffers)."""
    import torch.distributed as dist

    if type(opt).__name__ == "BF16_Optimizer":
        masters, lp = opt.fp32_groups_flat_partition, opt.bf16_partitioned_groups
    else:
        masters, lp = opt.single_partition_of_fp32_groups, opt.parallel_partitioned_bit16_groups
    return masters, [parts[dist.get_rank(group=g)] for parts, g in zip(lp, opt.real_dp_process_group)]


def _live(name: str) -> dict:
    """Build the engine `name` uses, train 2 optimizer steps, and inspect it (plain values, to cross processes)."""
    import torch.distributed as dist

    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.deepspeed.moe_layer import prepare_model
    from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
    from dsv3_plugin.deepspeed.run_config import validate_ds_config
    from dsv3_plugin.model.moe.router import Router
    from dsv3_plugin.precision.fp8 import Fp8Linear
    from dsv3_plugin.training.transforms import build_model

    ds = _variant(name)
    checked = validate_ds_config(copy.deepcopy(ds), target="train", world_size=2)
    cfg = checked.cfg
    torch.manual_seed(0)
    model = build_model(cfg)
    built = sorted({str(b.dtype) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    ids = torch.randint(
        0,
        256,
        (2 * checked.ds["gradient_accumulation_steps"], 16),
        generator=torch.Generator().manual_seed(dist.get_rank()),
    )
    if cfg.parallel.pp == 1:
        prepare_model(model, cfg)
        with contextlib.redirect_stdout(io.StringIO()) as printed:  # dsv3 train keeps stdout for JSON lines
            engine, *_ = initialize(model, copy.deepcopy(ds))
        module, group = model, None
    else:
        pe = PipelinedEngine(model, checked.ds, cfg)
        engine, module, group = pe.engine, pe.module, pe.g.dp_group
    routers = [m for m in module.modules() if isinstance(m, Router)]
    updates = []
    for _ in range(2):
        if cfg.parallel.pp == 1:
            for micro in range(engine.gradient_accumulation_steps()):
                out = engine(ids[2 * micro : 2 * micro + 2], labels=ids[2 * micro : 2 * micro + 2])
                engine.backward(out.loss)
                if micro < engine.gradient_accumulation_steps() - 1:
                    engine.step()
            loads_LE = torch.stack([r.tokens_per_expert.clone() for r in routers])
            bias_LE = torch.stack([r.e_score_correction_bias.clone() for r in routers])
            gamma = engine.dsv3.gamma
            engine.step()  # the boundary: optimizer step, then the bias update
        else:
            pe.train_step(ids, ids)
            loads_LE = torch.stack([r.tokens_per_expert.clone() for r in routers])
            bias_LE = torch.stack([r.e_score_correction_bias.clone() for r in routers])
            gamma = cfg.moe.gamma(0.0)
            pe.update_expert_bias(gamma)
        dist.all_reduce(loads_LE, group=group)  # the counts of every data-parallel rank
        # the paper's rule in FP32, evaluated here on FP32 copies
        want_LE = bias_LE + torch.sign(loads_LE.mean(dim=1, keepdim=True) - loads_LE) * gamma
        got_LE = torch.stack([r.e_score_correction_bias for r in routers])
        updates.append(
            {
                "equal": torch.equal(got_LE, want_LE),
                "moved": bool((got_LE != bias_LE).any()),
                "bf16_exact": torch.equal(got_LE, got_LE.bfloat16().float()),
            }
        )
    opt = engine.optimizer
    inner = opt.optimizer
    masters, lp = _partitions(opt)
    states = [s for s in inner.state.values() if s]
    if cfg.parallel.pp == 1:
        engine.dsv3.remove()
    return {
        "stdout": printed.getvalue() if cfg.parallel.pp == 1 else "",
        "wrapper": type(opt).__name__,
        "inner": type(inner).__name__,
        "n_fp8_linears": sum(isinstance(m, Fp8Linear) for m in module.modules()),
        "module_params": sorted({str(p.dtype) for p in module.parameters()}),
        "router_weights": sorted({str(r.weight.dtype) for r in routers}),
        "bias_built": built,
        "router_buffers": sorted(
            {str(b.dtype) for r in routers for b in (r.e_score_correction_bias, r.tokens_per_expert)}
        ),
        "masters": sorted({str(m.dtype) for m in masters}),
        "inner_params_are_masters": [id(p) for g in inner.param_groups for p in g["params"]]
        == [id(m) for m in masters],
        "moments": sorted({f"{k}:{v.dtype}" for s in states for k, v in s.items() if torch.is_tensor(v) and v.dim()}),
        "lp_is_rounded_master": all(torch.equal(b, m.to(torch.bfloat16)) for b, m in zip(lp, masters)),
        "master_finer_than_bf16": any(not torch.equal(m, m.bfloat16().float()) for m in masters),
        "n_masters": sum(m.numel() for m in masters),
        "updates": updates,
    }


def _first_leg(tmp):
    from dsv3_plugin.deepspeed.train import train
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    out = {name: _live(name) for name in ("ep1", "ep2", "acc32", "fp8", "moments")}
    out["full"] = train(copy.deepcopy(DS), steps=STEPS, out=f"{tmp}/full", progress=False)
    out["half"] = train(copy.deepcopy(DS), steps=STEPS // 2, out=f"{tmp}/half", progress=False)
    out["pp2"] = _live("pp2")  # last: DeepSpeed keeps the pipeline's mpu in its global state
    return out


def _second_leg(tmp):
    from dsv3_plugin.deepspeed.train import train

    return train(copy.deepcopy(DS), steps=STEPS, out=f"{tmp}/half", resume=f"{tmp}/half", progress=False)


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bf16"))
    first = run_ranks(_first_leg, 2, tmp, timeout_s=600)
    second = run_ranks(_second_leg, 2, tmp)  # fresh processes
    return first, second


@pytest.mark.parametrize(
    "name,wrapper",
    [
        ("ep1", "DeepSpeedZeroOptimizer"),
        ("ep2", "DeepSpeedZeroOptimizer"),
        ("acc32", "BF16_Optimizer"),
        ("fp8", "DeepSpeedZeroOptimizer"),
        ("moments", "DeepSpeedZeroOptimizer"),
        ("pp2", "DeepSpeedZeroOptimizer"),
    ],
)
def test_bf16_params_fp32_masters_fp32_router_bias(legs, name, wrapper):
    first, _ = legs
    for rank in range(2):
        live = first[rank][name]
        assert live["wrapper"] == wrapper, live
        assert live["stdout"] == "", live["stdout"]  # (BF16_Optimizer prints memory reports while it builds)
        assert live["module_params"] == ["torch.bfloat16"], live
        assert live["router_weights"] == ["torch.bfloat16"], live  # its gating math stays FP32 (Router.scores)
        assert live["masters"] == ["torch.float32"] and live["inner_params_are_masters"], live
        moment = "torch.bfloat16" if name == "moments" else "torch.float32"
        assert live["moments"] == [f"exp_avg:{moment}", f"exp_avg_sq:{moment}"], live
        assert live["inner"] == ("AdamWBF16Moments" if name == "moments" else "AdamW"), live
        assert live["lp_is_rounded_master"] and live["master_finer_than_bf16"], live
        assert live["n_masters"] > 0
        assert (live["n_fp8_linears"] > 0) == (name == "fp8"), live["n_fp8_linears"]
        assert live["bias_built"] == live["router_buffers"] == ["torch.float32"], live
        for u in live["updates"]:
            assert u["equal"] and u["moved"], (rank, live["updates"])
        # after two steps of ±γ some biases are ±γ or ±2γ: values BF16 would have rounded
        assert not live["updates"][-1]["bf16_exact"], live["updates"]


def test_resume_under_bf16_is_bit_exact(legs):
    first, second = legs
    full, half, resumed = first[0]["full"], first[0]["half"], second[0]
    assert [r["step"] for r in resumed["history"]] == list(range(STEPS // 2 + 1, STEPS + 1))
    keys = ["loss", "lm_loss", "mtp_loss", "balance_loss", "maxvio", "maxvio_layers", "tokens_seen", "gamma", "lr"]
    for got, want in zip(half["history"] + resumed["history"], full["history"]):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, f"step {want['step']} differs"
    assert resumed["router_bias"] == full["router_bias"]
    assert resumed["param_checksum"] == full["param_checksum"]
    assert all(r["loss"] < full["history"][0]["loss"] for r in full["history"][-3:])  # it trains
    for rank in range(2):  # every rank ends with the same biases (the counts were all-reduced)
        assert first[rank]["full"]["router_bias"] == full["router_bias"]
