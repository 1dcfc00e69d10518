"""DSv3Model cut into pipeline stages: composing the stages gives the model's loss and gradients bit for bit."""

import copy

import pytest
import torch
from tolerance import assert_within, model_bound

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.pipeline.stages import DSv3PipelineLoss, build_stages, split_layers, stage_ids_for_rank
from dsv3_plugin.training.transforms import build_model


def tiny(layers=4):
    return DSv3Config.from_block({"preset": "tiny", "model": {"num_hidden_layers": layers}})


def test_split_layers_and_rank_layout():
    assert [list(r) for r in split_layers(5, 3)] == [[0, 1], [2, 3], [4]]
    assert [len(r) for r in split_layers(3, 4)] == [1, 1, 1, 0]
    assert stage_ids_for_rank("dualpipev", 2, 0) == [0, 3] and stage_ids_for_rank("dualpipe", 4, 1) == [1, 2]
    with pytest.raises(ValueError, match="parallel.schedule"):
        stage_ids_for_rank("gpipe", 2, 0)


@pytest.mark.parametrize("n_stages", [1, 2, 4, 5])
def test_stages_compose_to_the_model(n_stages):
    torch.manual_seed(0)
    model = build_model(tiny())
    model.train()
    ids = torch.randint(0, 256, (2, 12))
    labels = torch.randint(0, 256, (2, 12))
    ref = copy.deepcopy(model)
    out = ref(ids, labels, tokens_seen=0.0)
    out.loss.backward()

    stages = build_stages(model, n_stages)
    crit = DSv3PipelineLoss(model)
    msg = (ids,)
    for s in stages:
        msg = s(*msg)
    loss = crit(*msg, labels)
    loss.backward()
    assert torch.equal(loss, out.loss)
    rec = crit.records[0]
    assert torch.equal(rec["lm_loss"], out.lm_loss) and torch.equal(rec["mtp_loss"], out.mtp_loss)
    assert torch.equal(rec["balance_loss"], out.balance_loss)
    # One autograd graph through the stages: the same ops as the model's forward, built in the same order,
    # so the backward runs the identical op sequence (shared-embedding contributions accumulate in the same
    # order too): bit-identical gradients, not merely close.
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    # the first and last stage share the one embedding (MTP reuses it)
    assert stages[0].embed_tokens.weight is stages[-1].embed_tokens.weight


def test_split_weight_grads_defers_linear_and_expert_gemms():
    from dsv3_plugin.model.kernels import KernelLinear, UsesKernel, find_wrapper
    from dsv3_plugin.model.moe.layer import GroupedExperts
    from dsv3_plugin.parallel.pipeline.weight_grad import DeferredWeightGrads, WeightGradQueue, split_weight_grads

    torch.manual_seed(0)
    model = build_model(tiny(3))
    model.train()
    ref = copy.deepcopy(model)
    ids, labels = torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12))
    ref(ids, labels).loss.backward()
    n = split_weight_grads(model)
    deferred = [
        m
        for m in model.modules()
        if isinstance(m, UsesKernel) and find_wrapper(m.kernel, DeferredWeightGrads) is not None
    ]
    n_exp = sum(isinstance(m, GroupedExperts) for m in deferred)
    n_lin = sum(isinstance(m, KernelLinear) for m in deferred)
    assert n_exp == 3 and n == n_exp + n_lin == len(deferred)  # 2 MoE layers + the MTP layer
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.state_dict().keys() == ref.state_dict().keys()
    q = WeightGradQueue()
    out = model(ids, labels)
    with q.deferring("mb0"):
        out.loss.backward()
    assert torch.equal(out.loss, ref(ids, labels).loss)
    params = dict(model.named_parameters())
    # input grads flowed (the embedding has no GEMM of ours), weight GEMMs waited for W
    assert params["embed_tokens.weight"].grad is not None
    assert params["layers.1.mlp.experts.gate_proj"].grad is None and params["lm_head.weight"].grad is None
    q.pop("mb0")
    # Reordered (backward only; the forward is the same, the loss equal): each deferred Linear/expert GEMM's
    # dX and dW run as plain matmuls in the I op and the W closure instead of autograd's linear/grouped
    # backward kernels, so their blocking differs, and the differences flow back through every block.
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        assert_within(
            p.grad,
            r.grad,
            model_bound(r.grad, model.cfg, ids.numel(), passes=1),
            f"{name}.grad, deferred W-GEMMs vs autograd",
        )
