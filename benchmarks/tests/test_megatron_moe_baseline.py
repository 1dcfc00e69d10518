"""`benchmarks/_megatron_moe.py`: Megatron-Core's own MoELayer holding one of our DeepSeekMoE layers' weights (the
baseline the GPU check times ours against) computes our layer's function: output, input gradient and every weight's
gradient (router, routed experts as [gate; up] / down, shared expert) within a derived FP32 bound, with group-limited
routing and the expert bias. On CPU Megatron-Core runs its SequentialMLP experts and all-gather dispatcher (under the
CPU shims); on a GPU the same mapping feeds TE's grouped experts. Runs on megatron-core 0.16.1 and 0.19.x.

Bound (tests/tolerance.py): both layers multiply the same FP32 operands with the same routing; what may differ is the
order of the reductions (the H- and I-long GEMM sums, the T-long weight-gradient sums, the combine over top-k + 1
terms), at most 4 such reductions on any path: reorder_bound(max(H, I, T) + K + 1, max|ref|, stages=4).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks
from tolerance import reorder_bound

from dsv3_plugin.config import MoEConfig

H, I, E, K, T = 64, 32, 16, 4, 48


def _ours(seed: int, groups: int, topk_group: int):
    from dsv3_plugin.model.moe.layer import DeepSeekMoE

    cfg = MoEConfig(
        n_routed_experts=E,
        n_shared_experts=1,
        intermediate_size=I,
        top_k=K,
        n_group=groups,
        topk_group=topk_group,
        route_scale=2.5,
        seq_aux_alpha=0.0,
    )
    torch.manual_seed(seed)
    ours = DeepSeekMoE(H, cfg)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.1)
        ours.gate.e_score_correction_bias.normal_(0.0, 0.01)
    return ours.train()


def _compare(groups: int, topk_group: int, swap_one_expert: bool):
    from benchmarks import _megatron_moe as megatron_moe
    from patches.megatron_cpu import cpu_shims

    ours = _ours(0, groups, topk_group)
    dev = torch.device("cpu")
    with cpu_shims():
        megatron_moe.ensure_parallel_state(dev)
        mg, info = megatron_moe.build(ours, torch.float32, dev)
        if swap_one_expert:  # a wrong mapping: expert 3's fc1 as [up; gate]
            with torch.no_grad():
                w = mg.experts.local_experts[3].linear_fc1.weight
                w.copy_(torch.cat([w[I:], w[:I]]))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, T // 2, H, generator=g)
        dy = torch.randn(2, T // 2, H, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), megatron_moe.forward(mg, xb)
        ya.backward(dy)
        yb.backward(dy)
        ex, sh = ours.experts, ours.shared_experts
        ours_grads = {
            "router": ours.gate.weight.grad,
            "fc1": torch.stack([torch.cat([ex.gate_proj.grad[e], ex.up_proj.grad[e]]) for e in range(E)]),
            "fc2": ex.down_proj.grad,
            "shared_fc1": torch.cat([sh.gate_proj.weight.grad, sh.up_proj.weight.grad]),
            "shared_fc2": sh.down_proj.weight.grad,
        }
        mg_grads = {
            "router": mg.router.weight.grad,
            "fc1": torch.stack([m.linear_fc1.weight.grad for m in mg.experts.local_experts]),
            "fc2": torch.stack([m.linear_fc2.weight.grad for m in mg.experts.local_experts]),
            "shared_fc1": mg.shared_experts.linear_fc1.weight.grad,
            "shared_fc2": mg.shared_experts.linear_fc2.weight.grad,
        }
    return {
        "info": info,
        "pairs": {"y": (yb.detach(), ya.detach()), "dx": (xb.grad, xa.grad)}
        | {k: (mg_grads[k], ours_grads[k]) for k in ours_grads},
    }


CASES = {"plain": (1, 1, False), "grouped": (4, 2, False), "wrong_mapping": (4, 2, True)}


def _compare_all():
    """Every case in one spawned process (one Megatron-Core import and parallel state for all)."""
    return {name: _compare(*args) for name, args in CASES.items()}


@pytest.fixture(scope="module")
def results():
    (res,) = run_ranks(_compare_all, 1)
    return res


def _within(got, ref) -> bool:
    bound = reorder_bound(max(H, I, T) + K + 1, ref.abs().max(), torch.float32, stages=4)
    return bool(((got - ref).abs() <= bound).all())


@pytest.mark.parametrize("case", ["plain", "grouped"])
def test_megatron_core_moe_layer_computes_ours(results, case):
    res = results[case]
    assert res["info"]["experts"] == "SequentialMLP" and res["info"]["dispatcher"] == "allgather"
    for name, (got, ref) in res["pairs"].items():
        assert got is not None and got.shape == ref.shape, name
        assert bool(ref.abs().max() > 0), name
        assert _within(got, ref), (name, (got - ref).abs().max())


def test_a_wrong_weight_mapping_is_caught(results):
    got, ref = results["wrong_mapping"]["pairs"]["y"]
    assert not _within(got, ref)


def test_fp8_layer_needs_te_on_cuda():
    from benchmarks import _megatron_moe as megatron_moe

    with pytest.raises(ValueError, match="Transformer Engine on CUDA"):
        megatron_moe.build(_ours(0, 1, 1), torch.float32, torch.device("cpu"), fp8=True)
