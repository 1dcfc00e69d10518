"""The weight-gradient split in `dsv3 train` (DeepSeek-V3 §3.2.1: DualPipe's "backward for weights" chunks):
`parallel.split_weight_grads` really changes what runs, and the gradients (and the parameters after an
optimizer step) equal those without it up to the reordering it introduces. Also: the run's summary reports
each rank's busy / idle time of the pipeline steps."""

import copy

import pytest
import torch
from helpers import run_ranks
from tolerance import check_within, model_bound, reorder_bound

from dsv3_plugin.parallel.distributed import init_distributed

GAS, MBS, SEQ, LR = 4, 1, 16, 0.5
DS = {
    "train_micro_batch_size_per_gpu": MBS,
    "gradient_accumulation_steps": GAS,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 1},
    "zero_allow_untested_optimizer": True,
    # plain SGD without clipping: p' = p - lr * g, so a parameter differs by at most lr x its gradient's bound
    "optimizer": {"type": "SGD", "params": {"lr": LR}},
    "dsv3": {
        "preset": "tiny",
        "model": {"num_hidden_layers": 4},
        "moe": {"bias_update_speed": 0.01},
        "parallel": {"pp": 2, "schedule": "dualpipev"},
        "train": {"seq_len": SEQ, "steps": 2, "seed": 1234},
    },
}


def _one_step(ds):
    """One PipelinedEngine.train_step (what `dsv3 train` runs per optimizer step) from the seed's weights:
    losses, the gradients it produced (before ZeRO's reduction), the parameters after the step, W jobs run."""
    init_distributed()
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.data.synthetic import MarkovData
    from dsv3_plugin.deepspeed.pipeline import PipelinedEngine
    from dsv3_plugin.training.transforms import build_model

    cfg = DSv3Config.from_block(ds["dsv3"])
    torch.manual_seed(cfg.train.seed)
    pe = PipelinedEngine(build_model(cfg), ds, cfg)
    grads = {}
    reduce = pe.engine.allreduce_gradients

    def snapshot_then_reduce(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in pe.module.named_parameters() if p.grad is not None})
        return reduce(*a, **k)

    pe.engine.allreduce_gradients = snapshot_then_reduce
    before = {n: p.detach().clone() for n, p in pe.module.named_parameters()}
    data = MarkovData(cfg.model.vocab_size, cfg.train.seq_len, seed=cfg.train.seed)
    parts = [data.batch(0, micro, pe.g.dp_rank, pe.micro_batch) for micro in range(pe.gas)]
    m = pe.train_step(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    after = {n: p.detach().clone() for n, p in pe.module.named_parameters()}
    return {
        "losses": m,
        "grads": grads,
        "before": before,
        "after": after,
        "split": pe.split_w,
        "w_closures": pe.runtime.last_step["w_closures"],
    }


PRECISIONS = ("fp32", "fp8", "bf16")


def _step_config(precision: str, split: bool) -> dict:
    ds = copy.deepcopy(DS)
    ds["dsv3"]["fp8"] = {"enabled": precision == "fp8", "backend": "emulate"}
    if precision == "bf16":  # BF16 parameters and gradients, FP32 masters in ZeRO-1
        ds["bf16"] = {"enabled": True}
    ds["dsv3"]["parallel"]["split_weight_grads"] = split
    return ds


def _train_config(split: bool) -> dict:
    ds = copy.deepcopy(DS)
    ds["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}
    ds.pop("zero_allow_untested_optimizer")
    ds["dsv3"]["parallel"]["split_weight_grads"] = split
    return ds


def _all_runs(step_configs, train_configs):
    """Every one-step comparison and both training runs in the same 2 processes (one spawn for the module):
    each run seeds its own weights and data, so running them in turn changes none of them."""
    steps = [_one_step(ds) for ds in step_configs]
    return steps, [_train(ds) for ds in train_configs]


@pytest.fixture(scope="module")
def runs():
    keys = [(p, split) for p in PRECISIONS for split in (True, False)]
    per_rank = run_ranks(
        _all_runs, 2, [_step_config(*k) for k in keys], [_train_config(s) for s in (True, False)], timeout_s=900
    )
    steps = {k: [r[0][i] for r in per_rank] for i, k in enumerate(keys)}
    trains = {s: [r[1][i] for r in per_rank] for i, s in enumerate((True, False))}
    return steps, trains


@pytest.mark.dist
@pytest.mark.parametrize("precision", PRECISIONS)
def test_dualpipev_pp2_split_on_off_same_losses_and_gradients(runs, precision):
    """Measured on the 2-core CPU: every gradient and parameter bit-equal (0 of the bound used) in FP32, FP8
    (emulated, Linears and experts) and DeepSpeed BF16; the bound covers what is reordered in principle (below)."""
    on = _step_config(precision, True)
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    got, ref = runs[0][(precision, True)], runs[0][(precision, False)]
    from dsv3_plugin.config import DSv3Config

    cfg = DSv3Config.from_block({**on["dsv3"]})
    tokens = GAS * MBS * SEQ
    problems = []
    for r, (a, b) in enumerate(zip(got, ref)):
        # the key changes what runs: W ops run the deferred GEMM jobs with it, nothing without it
        assert a["split"] is True and b["split"] is False
        assert a["w_closures"] > 0 and b["w_closures"] == 0, (r, a["w_closures"], b["w_closures"])
        # the forward is the identical op sequence: the same losses, bit for bit
        assert a["losses"] == b["losses"], (a["losses"], b["losses"])
        assert a["grads"].keys() == b["grads"].keys() == a["after"].keys() and a["grads"]
        for n, p0 in a["before"].items():
            assert torch.equal(p0, b["before"][n]), n  # the same start
        for n, g_ref in b["grads"].items():
            # Reordered: each deferred GEMM's dW is one matmul in W instead of autograd's linear/grouped backward
            # (another blocking), and a weight used twice in one micro-batch (lm_head by the head and MTP, the
            # experts' stacks) gets two `+=` instead of autograd's sum-then-accumulate. Everything downstream of a
            # weight gradient is unaffected (dX is the same GEMM in both), so the bound is the model's reordering
            # bound over the step's tokens, forward + backward. (FP8: both sides quantize the same operands with
            # the same scales, so only the FP32 accumulation order can differ, as above.)
            g_bound = model_bound(g_ref.float(), cfg, tokens, passes=2)
            if dt == torch.bfloat16:
                # BF16: every GEMM accumulates in FP32 (the bound above), then its result and each `+=` of another
                # micro-batch's (or use's) gradient round to BF16: a BF16 sum of <= 2 x GAS terms, reordered.
                g_bound = g_bound + reorder_bound(2 * GAS, g_ref.float().abs().max(), torch.bfloat16)
            problems.append(check_within(a["grads"][n], g_ref, g_bound, f"rank {r} grad {n}: W-split vs in-B"))
            # p' = fl(p - lr g): lr x the gradient's bound, plus the step's own rounding on each side
            p_bound = LR * g_bound + reorder_bound(2, a["before"][n].float().abs() + LR * g_ref.float().abs(), dt, 1)
            problems.append(check_within(a["after"][n], b["after"][n], p_bound, f"rank {r} param {n} after SGD"))
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems[:5])


def _train(ds):
    init_distributed()
    from dsv3_plugin.deepspeed.train import train

    return train(ds, progress=False, echo=False, save=False)["summary"]


@pytest.mark.dist
def test_train_summary_reports_per_rank_busy_idle_and_the_flag_changes_what_runs(runs):
    for split in (True, False):
        summaries = runs[1][split]
        pipe = summaries[0]["pipeline"]
        assert all(s["pipeline"] == pipe for s in summaries)  # gathered: the same report everywhere
        assert pipe["schedule"] == "dualpipev" and pipe["split_weight_grads"] is split
        assert pipe["steps_measured"] == 1  # 2 steps, the first one left out
        assert [r["rank"] for r in pipe["ranks"]] == [0, 1] and [r["pp_rank"] for r in pipe["ranks"]] == [0, 1]
        for r in pipe["ranks"]:
            assert r["busy_s"] > 0 and r["idle_s"] >= 0
            assert r["idle_fraction"] == pytest.approx(r["idle_s"] / (r["busy_s"] + r["idle_s"]), rel=1e-12)
            assert (r["w_closures"] > 0) is split
            assert r["grad_sync_s"] == 0 and r["busy_s"] + r["idle_s"] <= r["wall_s"]  # DualPipeV: no mirror pair
        assert "idle fraction per rank" in summaries[0]["text"]
