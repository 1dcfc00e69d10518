"""Aux-loss-free bias update on the DeepSpeed path: once per optimizer step, from the counts of every
micro-batch of every rank (2 ranks, gradient accumulation 4), with γ following its token schedule.

The reference is computed here, independently of the plugin's counting/all-reduce/update code: forward hooks
record each router's routing decisions (`topk_idx_TK`) per micro-batch on each rank; the test sums them over
micro-batches and ranks and applies b + γ·sign(mean − load) in fp32.
"""

import contextlib

import pytest
import torch
from helpers import run_ranks

GAS, MBS, T, WORLD = 4, 2, 16, 2
TOKENS_PER_STEP = GAS * MBS * T * WORLD


def _ds_config(gamma_schedule):
    return {
        "train_micro_batch_size_per_gpu": MBS,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "dsv3": {
            "preset": "tiny",
            "moe": {"bias_update_speed": 0.0, "bias_update_schedule": gamma_schedule},
            "train": {"seq_len": T},
        },
    }


def _both():
    """One spawn for both variants (process start-up with DeepSpeed dominates the test time)."""
    return {"plain": _run(False), "recompute": _run(True)}


def _run(recompute: bool):
    from torch.utils.checkpoint import checkpoint

    from dsv3_plugin.data.synthetic import MarkovData
    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.model.moe.router import Router, skip_counting
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.training.transforms import build_model

    rank, world = init_distributed()
    torch.manual_seed(0)
    # γ = 0.01 for the first optimizer step's tokens, 0.002 afterwards: tests the token schedule too.
    ds = _ds_config([{"until_tokens": TOKENS_PER_STEP, "value": 0.01}, {"until_tokens": None, "value": 0.002}])
    from dsv3_plugin.config import DSv3Config

    model = build_model(DSv3Config.from_block(ds["dsv3"]))
    if recompute:  # activation recompute of every decoder layer; the re-run forward must not count again
        for layer in model.layers:
            fwd = layer.forward
            layer.forward = (
                lambda f: (
                    lambda *a: checkpoint(
                        f, *a, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), skip_counting())
                    )
                )
            )(fwd)
    routers = [m for m in model.modules() if isinstance(m, Router)]

    def hook(mod, inp, out):
        if mod.training and torch.is_grad_enabled() and not getattr(hook, "recomputing", False):
            hook.current[routers.index(mod)] += torch.bincount(
                out.topk_idx_TK.flatten(), minlength=mod.cfg.n_routed_experts
            ).float()

    for r in routers:
        r.register_forward_hook(hook)

    engine, _, _, _ = initialize(model, ds)
    data = MarkovData(256, T, seed=7)
    steps = []
    for step in range(2):
        before = torch.stack([r.e_score_correction_bias.clone() for r in routers])
        unchanged_mid_window = []
        per_micro = []
        for micro in range(GAS):
            ids, labels = data.batch(step, micro, rank, MBS)
            hook.current = torch.zeros(len(routers), routers[0].cfg.n_routed_experts)
            out = engine(ids, labels=labels)
            per_micro.append(hook.current.clone())
            hook.recomputing = True  # non-reentrant recompute re-enters forward during backward
            engine.backward(out.loss)
            hook.recomputing = False
            engine.step()
            now = torch.stack([r.e_score_correction_bias.clone() for r in routers])
            if micro < GAS - 1:
                unchanged_mid_window.append(torch.equal(now, before))
        after = torch.stack([r.e_score_correction_bias.clone() for r in routers])
        # Plain lists: tensors returned through the spawn queue would travel as shared memory of a dead process.
        steps.append(
            {
                "before": before.tolist(),
                "after": after.tolist(),
                "per_micro": torch.stack(per_micro).tolist(),
                "unchanged_mid_window": unchanged_mid_window,
                "gamma": engine.dsv3.state.last_gamma,
                "tokens_seen": engine.dsv3.state.tokens_seen,
                "counts_after": torch.stack([r.tokens_per_expert.clone() for r in routers]).tolist(),
            }
        )
    return steps


def _check(results):
    results = [
        [
            {
                k: (
                    torch.tensor(v, dtype=torch.float32) if k in ("before", "after", "per_micro", "counts_after") else v
                )
                for k, v in s.items()
            }
            for s in res
        ]
        for res in results
    ]
    for step, gamma in enumerate([0.01, 0.002]):
        load_LE = sum(results[r][step]["per_micro"].sum(0) for r in range(WORLD))  # all micro-batches, ranks
        before = results[0][step]["before"]
        expected = before + (gamma * torch.sign(load_LE.mean(-1, keepdim=True) - load_LE)).float()
        for r in range(WORLD):
            s = results[r][step]
            assert all(s["unchanged_mid_window"]), "bias moved before the accumulation boundary"
            assert torch.equal(s["before"], before)
            assert torch.equal(s["after"], expected), f"rank {r} step {step}: bias != reference update"
            assert s["gamma"] == gamma
            assert s["tokens_seen"] == (step + 1) * TOKENS_PER_STEP
            assert not s["counts_after"].any(), "counts not reset after the update"
        # The reference discriminates: a per-rank or last-micro-batch-only update would differ.
        for partial in (results[0][step]["per_micro"].sum(0), results[0][step]["per_micro"][-1]):
            wrong = before + gamma * torch.sign(partial.mean(-1, keepdim=True) - partial)
            assert not torch.equal(wrong, expected)
        assert (expected != before).any()


@pytest.fixture(scope="module")
def results():
    return run_ranks(_both, WORLD)


def test_bias_update_once_per_step_over_micro_batches_and_ranks(results):
    _check([r["plain"] for r in results])


def test_bias_update_with_activation_recompute(results):
    """Recompute re-runs the forward in backward inside `skip_counting()`: loads are counted once, so the
    update equals the reference and the non-recompute run."""
    _check([r["recompute"] for r in results])
    for r in results:
        for a, b in zip(r["plain"], r["recompute"]):
            assert a["after"] == b["after"]
