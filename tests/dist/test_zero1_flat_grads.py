"""`memory.flat_grads` (patches/deepspeed_zero1_flat_grads.py): ZeRO-1 with the gradients accumulated in place in one
flat buffer per group trains exactly as DeepSpeed's own gradient path, in FP32 and in BF16 (`"bf16"` enabled:
BF16 gradients, FP32 masters).

Same seed, same batches, 3 optimizer steps of 2 micro-batches with clipping 1.0 (the shared 2-rank JSON), a
parameter added to the model that gets a gradient in every other optimizer step only (its buffer view must not keep
the last step's gradient): losses, global gradient norms, every parameter and the
FP32 master partitions `torch.equal` between the two paths, on 1 rank (no arithmetic in either path: the
gradients are only moved) and on 2 gloo ranks (a/2 + b/2 in both: DeepSpeed divides by the world size before
summing, and a sum of two terms does not depend on the order). Where the patch does not apply (FP32 gradient
accumulation of BF16 parameters, i.e. DeepSpeed's BF16_Optimizer; expert-parallel groups) DeepSpeed's path runs and
the reason is printed once.

`memory.grad_norm: fp32` (the norm from FP32 pieces of the flat partition instead of DeepSpeed's FP64 per
parameter): with clipping inactive (a bound of 1e6: both clip factors are exactly 1) losses, parameters and masters
stay equal to DeepSpeed's path and every step's norm is within the FP32 summation bound of DeepSpeed's FP64 one; an
inf gradient gives DeepSpeed's overflow (norm inf, step skipped) on both paths.
"""

import contextlib
import copy
import io

import pytest
import torch
from helpers import run_ranks, zero1_ds, zero1_steps

from patches.deepspeed_zero1_flat_grads import NORM_CHUNK

DS = zero1_ds({"preset": "tiny", "train": {"seq_len": 16, "seed": 5}}, warmup_steps=2)
STEPS = 3


def _train(flat: bool, ds: dict, norm: str = "fp64", inf_step: int | None = None) -> dict:
    import torch.distributed as dist

    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.deepspeed.moe_layer import prepare_model
    from dsv3_plugin.deepspeed.run_config import validate_ds_config
    from dsv3_plugin.training.transforms import build_model

    ds = copy.deepcopy(ds)
    ds["dsv3"].setdefault("memory", {}).update(flat_grads=flat, grad_norm=norm)
    checked = validate_ds_config(copy.deepcopy(ds), target="train", world_size=dist.get_world_size())
    cfg = checked.cfg
    torch.manual_seed(0)
    model = build_model(cfg)
    model.register_parameter("sometimes", torch.nn.Parameter(torch.ones(5)))  # a gradient in even steps only
    prepare_model(model, cfg)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        engine, *_ = initialize(model, ds)
    opt = engine.optimizer
    # the FP32 masters this rank steps (DeepSpeed's ZeRO-1 optimizer, or its BF16_Optimizer where the patch is off)
    master_groups = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    first = master_groups[0].detach().clone()  # (BF16: the module's weights may not move in 3 small steps)

    def extra(s):  # `sometimes` gets a gradient in even steps only; an inf one at `inf_step`
        if s == inf_step:
            return model.sometimes.sum() * float("inf")
        return model.sometimes.square().sum() * 1e-2 if s % 2 == 0 else 0.0

    losses, norms = zero1_steps(engine, STEPS, dist.get_rank(), extra)
    masters = [m.detach().clone() for m in master_groups]
    buffers = getattr(engine.optimizer, "_dsv3_flat_grads", None)  # the patch's own gradient buffers
    engine.dsv3.remove()
    return {
        "applied": engine.dsv3_flat_grads,
        "stderr": err.getvalue(),
        "losses": losses,
        "norms": norms,
        "params": [p.detach().clone() for p in model.parameters()],
        "trained": not torch.equal(first, masters[0]),
        "masters": masters,
        "buffers_used": buffers is not None and all(bool(b.abs().sum() > 0) for b in buffers[0]),
        # gradients found in place (the expert kernel wrote them into the buffer: `grad_destination`)
        "in_place": 0 if buffers is None else buffers[1]["in_place"],
        # elements the norm sums (padding incl.)
        "numel": sum(f.numel() for f in getattr(opt, "bit16_groups_flat", [])),
        "first_master": first,
    }


def _both(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return {"stock": _train(False, ds), "flat": _train(True, ds)}


def _not_applied(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return _train(True, ds)


def _check_equal(res):
    stock, flat = res["stock"], res["flat"]
    assert flat["applied"] and not stock["applied"]
    assert flat["buffers_used"] and not stock["buffers_used"]  # the gradients went through the flat buffers
    # the routed experts' weight gradients were written into the buffer by the kernel (3 per MoE layer a window)
    assert flat["in_place"] >= 3 * STEPS
    assert torch.equal(flat["losses"], stock["losses"])
    assert torch.equal(flat["norms"], stock["norms"]) and bool((flat["norms"] > 0).all())
    assert len(flat["params"]) == len(stock["params"])
    for a, b in zip(flat["params"], stock["params"]):
        assert torch.equal(a, b)
    for a, b in zip(flat["masters"], stock["masters"]):
        assert torch.equal(a, b)
    assert flat["trained"]  # the masters moved


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_flat_grads_equal_deepspeed_path(nproc, dtype):
    ds = copy.deepcopy(DS)
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    for res in run_ranks(_both, nproc, ds):
        _check_equal(res)


def test_flat_grads_not_applied_says_why():
    acc32 = copy.deepcopy(DS)
    acc32["bf16"] = {"enabled": True}
    acc32["data_types"] = {"grad_accum_dtype": "fp32"}
    ep2 = copy.deepcopy(DS)
    ep2["dsv3"]["parallel"] = {"ep": 2}
    for ds, why in ((acc32, "the optimizer is a BF16_Optimizer"), (ep2, "expert (MoE) parameter groups")):
        r0, r1 = run_ranks(_not_applied, 2, ds)
        assert not r0["applied"] and not r1["applied"]
        assert f"DeepSpeed's own ZeRO-1 gradient path ({why}" in r0["stderr"]
        assert "memory.flat_grads" not in r1["stderr"]  # said once, by rank 0


def _fp32_norm(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return {"stock": _train(False, ds), "fp32": _train(True, ds, norm="fp32")}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_fp32_grad_norm_within_bound_of_deepspeeds(nproc, dtype):
    ds = copy.deepcopy(DS)
    ds["gradient_clipping"] = 1e6  # inactive: both clip factors are 1.0 exactly, so the updates stay equal
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    for res in run_ranks(_fp32_norm, nproc, ds):
        stock, fp32 = res["stock"], res["fp32"]
        assert fp32["applied"] and fp32["buffers_used"]
        assert torch.equal(fp32["losses"], stock["losses"])
        for a, b in zip(fp32["params"] + fp32["masters"], stock["params"] + stock["masters"]):
            assert torch.equal(a, b)
        # Σ g² in FP32 pieces of C = min(n, 256) elements summed in FP64 (`chunked_sq_norm`): relative error <=
        # (C + 4)·u (u = 2^-24), the 2-rank all-reduce one more u; the square root halves it and adds u;
        # DeepSpeed's FP64 norm (exact to ~n·2^-53) is rounded to FP32 once more: u.
        c = min(stock["numel"], NORM_CHUNK)
        bound = ((c + 5) / 2 + 2) * 2.0**-24 * stock["norms"].double()
        diff = (fp32["norms"].double() - stock["norms"].double()).abs()
        assert bool((diff <= bound).all()), (fp32["norms"], stock["norms"], bound)
        assert bool((stock["norms"] > 0).all())


def _inf_runs(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return {"stock": _train(False, ds, inf_step=0), "fp32": _train(True, ds, norm="fp32", inf_step=0)}


def test_fp32_grad_norm_inf_is_deepspeeds_overflow():
    (res,) = run_ranks(_inf_runs, 1, copy.deepcopy(DS))
    for r in res.values():  # step 0 skipped on both paths (FP32 model: an invalid norm is an overflow)
        assert r["norms"][0] == float("inf") and bool(torch.isfinite(r["norms"][1:]).all())
    assert torch.equal(res["fp32"]["norms"][0], res["stock"]["norms"][0])


def _refused(ds):
    from dsv3_plugin.config import ConfigError
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    try:
        _train(True, ds, norm="fp32")
    except ConfigError as e:
        return str(e)
    return None


def test_fp32_grad_norm_refused_where_flat_grads_do_not_apply():
    """DeepSpeed's BF16_Optimizer (BF16 parameters, FP32 gradient accumulation) keeps its own gradients: the FP32
    norm over the flat buffer cannot be taken there, so it is refused (not silently DeepSpeed's FP64 norm)."""
    acc32 = copy.deepcopy(DS)
    acc32["bf16"] = {"enabled": True}
    acc32["data_types"] = {"grad_accum_dtype": "fp32"}
    (msg,) = run_ranks(_refused, 1, acc32)
    assert msg is not None and msg.startswith("dsv3.memory.grad_norm = 'fp32': the FP32 norm is taken over")
    assert "the optimizer is a BF16_Optimizer" in msg
