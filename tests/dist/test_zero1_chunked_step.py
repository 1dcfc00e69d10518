"""`memory.chunked_step` (patches/deepspeed_zero1_chunked_step.py): ZeRO-1's optimizer step with torch AdamW over
pieces of the flat partition and DeepSpeed's FP64 gradient norm cast into one reused buffer trains exactly as
DeepSpeed's own step, in FP32 and in BF16 (`"bf16"` enabled: BF16 gradients, FP32 masters).

Same seed, same batches, 3 optimizer steps of 2 micro-batches with clipping 1.0, weight decay and the warm-up
schedule (the shared 2-rank JSON): losses, global gradient norms, every parameter, the FP32 master partitions and
AdamW's moments and step counts `torch.equal` between the two, on 1 rank and on 2 gloo ranks. The pieces are made
small here (3,000 elements: the tiny model's partition is cut in many, the last one ragged, every piece starting
off the SIMD width) and the norm's buffer too (5,000 elements: some gradients are larger and take DeepSpeed's own
cast), so both branches and every boundary run. With `memory.flat_grads` on (its per-parameter views) and off
(DeepSpeed's own gradient list), with expert parallelism (ep = 2: expert parameter groups, DeepSpeed's per-group
norms), and in the pipelined engine (pp = 2, DualPipeV: the stages' one-norm all-reduce patch composed with it).
"""

import contextlib
import copy
import io

import pytest
import torch
from helpers import run_ranks, zero1_ds, zero1_steps

DS = zero1_ds({"preset": "tiny", "train": {"seq_len": 16, "seed": 5}}, warmup_steps=2)
STEPS = 3
CHUNK, SCRATCH = 3000, 5000


def _train(chunked: bool, ds: dict) -> dict:
    import torch.distributed as dist

    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.deepspeed.moe_layer import prepare_model
    from dsv3_plugin.deepspeed.run_config import validate_ds_config
    from dsv3_plugin.training.transforms import build_model
    from dsv3_plugin_patches import deepspeed_zero1_chunked_step as patch

    patch.CHUNK, patch.SCRATCH = CHUNK, SCRATCH
    ds = copy.deepcopy(ds)
    ds["dsv3"].setdefault("memory", {})["chunked_step"] = chunked
    cfg = validate_ds_config(copy.deepcopy(ds), target="train", world_size=dist.get_world_size()).cfg
    torch.manual_seed(0)
    model = build_model(cfg)
    prepare_model(model, cfg)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        engine, *_ = initialize(model, ds)
    opt = engine.optimizer
    losses, norms = zero1_steps(engine, STEPS, dist.get_rank())
    masters = opt.single_partition_of_fp32_groups
    state = [opt.optimizer.state[m] for m in masters]
    res = {
        "applied": engine.dsv3_chunked_step,
        "stderr": err.getvalue(),
        "losses": losses,
        "norms": norms,
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [m.detach().clone() for m in masters],
        "moments": [st[k].clone() for st in state for k in ("exp_avg", "exp_avg_sq", "step")],
        "pieces": [-(-m.numel() // CHUNK) for m in masters],
        "largest_grad": max(p.numel() for p in model.parameters()),
        "smallest_grad": min(p.numel() for p in model.parameters()),
    }
    engine.dsv3.remove()
    return res


def _both(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return {"stock": _train(False, ds), "chunked": _train(True, ds)}


@pytest.mark.parametrize(
    ("nproc", "dtype", "flat", "ep"),
    [(1, "fp32", True, 1), (2, "fp32", True, 1), (2, "bf16", True, 1), (2, "fp32", False, 1), (2, "fp32", True, 2)],
)
def test_chunked_step_equals_deepspeeds(nproc, dtype, flat, ep):
    ds = copy.deepcopy(DS)
    ds["dsv3"]["memory"] = {"flat_grads": flat}
    ds["dsv3"]["parallel"] = {"ep": ep}
    if dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    for res in run_ranks(_both, nproc, ds):
        stock, chunked = res["stock"], res["chunked"]
        assert chunked["applied"] and not stock["applied"]
        assert "memory.chunked_step" not in chunked["stderr"]
        # the partition is cut in several pieces, and gradients fall on both sides of the norm's buffer size
        assert min(chunked["pieces"]) > 2 and chunked["smallest_grad"] <= SCRATCH < chunked["largest_grad"]
        assert torch.equal(chunked["losses"], stock["losses"])
        assert torch.equal(chunked["norms"], stock["norms"]) and bool((chunked["norms"] > 0).all())
        for key in ("params", "masters", "moments"):
            assert len(chunked[key]) == len(stock[key])
            for a, b in zip(chunked[key], stock[key]):
                assert torch.equal(a, b), key
        assert not torch.equal(chunked["masters"][0], chunked["moments"][0])  # (sanity: distinct tensors)
        assert float(chunked["moments"][2]) == STEPS  # AdamW's step count: once per step, not once per piece


def _fused(ds):
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return _train(True, ds)


def test_chunked_step_not_applied_says_why():
    ds = copy.deepcopy(DS)
    ds["optimizer"]["params"]["fused"] = True  # torch's fused AdamW: no temporaries to avoid
    r0, r1 = run_ranks(_fused, 2, ds)
    assert not r0["applied"] and not r1["applied"]
    assert "dsv3: memory.chunked_step: DeepSpeed's own optimizer step (torch Adam with fused=True)" in r0["stderr"]
    assert "memory.chunked_step" not in r1["stderr"]  # said once, by rank 0


def _pipelined(chunked: bool) -> dict:
    """3 steps of `dsv3 train`'s pipelined engine (pp = 2, DualPipeV, torch AdamW, clipping 1.0) on MarkovData."""
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.data.synthetic import MarkovData
    from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
    from dsv3_plugin.training.transforms import build_model
    from dsv3_plugin_patches import deepspeed_zero1_chunked_step as patch

    patch.CHUNK, patch.SCRATCH = CHUNK, SCRATCH
    ds = copy.deepcopy(DS)
    ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"] = 1, 4
    ds["dsv3"]["model"] = {"num_hidden_layers": 4}
    ds["dsv3"]["parallel"] = {"pp": 2, "schedule": "dualpipev"}
    ds["dsv3"]["memory"] = {"chunked_step": chunked}
    cfg = DSv3Config.from_block(ds["dsv3"])
    torch.manual_seed(cfg.train.seed)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        pe = PipelinedEngine(build_model(cfg), ds, cfg)
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    losses, norms = [], []
    for step in range(STEPS):
        parts = [data.batch(step, micro, pe.g.dp_rank, pe.micro_batch) for micro in range(pe.gas)]
        m = pe.train_step(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        losses.append(torch.as_tensor(m["loss"]))
        norms.append(torch.as_tensor(pe.engine.get_global_grad_norm()))
    masters = pe.engine.optimizer.single_partition_of_fp32_groups
    return {
        "applied": pe.engine.dsv3_chunked_step,
        "stderr": err.getvalue(),
        "losses": torch.stack(losses),
        "norms": torch.stack(norms),
        "params": [p.detach().clone() for p in pe.module.parameters()],
        "moments": [pe.engine.optimizer.optimizer.state[m][k].clone() for m in masters for k in ("exp_avg", "step")],
        "pieces": [-(-m.numel() // CHUNK) for m in masters],
    }


def _pipelined_both():
    from dsv3_plugin.parallel.distributed import init_distributed

    init_distributed()
    return {"stock": _pipelined(False), "chunked": _pipelined(True)}


def test_chunked_step_equals_deepspeeds_in_the_pipelined_engine():
    for res in run_ranks(_pipelined_both, 2):
        stock, chunked = res["stock"], res["chunked"]
        assert chunked["applied"] and not stock["applied"], chunked["stderr"][-2000:]
        assert max(chunked["pieces"]) > 2  # the stage's partition is cut in pieces
        assert torch.equal(chunked["losses"], stock["losses"])
        assert torch.equal(chunked["norms"], stock["norms"]) and bool((chunked["norms"] > 0).all())
        for key in ("params", "moments"):
            for a, b in zip(chunked[key], stock[key], strict=True):
                assert torch.equal(a, b), key
