"""DSv3Model through DualPipeV (PP=2, 4 stages), DualPipe (PP=2), then 1F1B and ZB1P (with deferred
weight grads in every nn.Linear) on gloo: per-micro-batch losses bit-identical to the single-process model,
gradients within 1e-6, the embedding shared on rank 0 (DualPipe(V)) or synchronised (1F1B/ZB1P + MTP)."""
import copy

import pytest
import torch
import torch.distributed as dist

from dsv3_plugin.config import load_config
from dsv3_plugin.distributed import init_distributed
from dsv3_plugin.model import DSv3Model
from dsv3_plugin.pipeline import DualPipe, DualPipeV, OneFOneB, ZeroBubble1P, split_weight_grads
from dsv3_plugin.pipeline.stages import (DSv3PipelineLoss, build_stages, n_stages_of, stage_ids_for_rank,
                                         sync_tied_embedding)
from helpers import run_ranks

C = 4


def _model():
    torch.manual_seed(0)
    m = DSv3Model(load_config({"preset": "tiny", "model": {"num_hidden_layers": 4}}))
    m.train()
    return m


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (C, 10), generator=g), torch.randint(0, 256, (C, 10), generator=g)


def _worker():
    r, _ = init_distributed()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    first = _run(r, groups, *(("dualpipev", DualPipeV) if r < 2 else ("dualpipe", DualPipe)), split=False)
    second = _run(r, groups, *(("1f1b", OneFOneB) if r < 2 else ("zb1p", ZeroBubble1P)), split=True)
    return first, second


def _run(r, groups, schedule, cls, split):
    pr = r % 2
    ids, labels = _data()
    model = _model()
    ref = copy.deepcopy(model)
    ref_losses = []
    for i in range(C):     # the reference: one micro-batch at a time, gradients accumulate
        out = ref(ids[i:i + 1], labels[i:i + 1])
        out.loss.backward()
        ref_losses.append(out.loss.detach())
    stages = build_stages(model, n_stages_of(schedule, 2), stage_ids_for_rank(schedule, 2, pr))
    if split:
        for st in stages:
            split_weight_grads(st)
    rt = cls(stages, process_group=groups[r // 2], timeout_s=60)
    crit = DSv3PipelineLoss(model)
    losses, _ = rt.step(ids, num_chunks=C, criterion=crit, labels=(labels,))
    rep = {"schedule": schedule, "pipeline_rank": pr, "loss_rank": rt.loss_rank,
           "tied_sync": sync_tied_embedding(rt, stages)}
    if pr == rt.loss_rank:
        rep["loss_equal"] = bool(torch.equal(losses, torch.stack(ref_losses)))
    if len(stages) == 2 and pr == 0:
        rep["shared_embedding"] = stages[0].embed_tokens.weight is stages[1].embed_tokens.weight
    ref_params = dict(ref.named_parameters())
    errs = {}
    seen = set()
    for s in stages:
        for n, p in s.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = next(k for k, q in model.named_parameters() if q is p)
            q = ref_params[full]
            errs[full] = ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
    rep["max_grad_err"] = max(errs.values())
    rep["n_params"] = len(errs)
    return rep


@pytest.mark.dist
def test_dsv3_model_through_dualpipev_and_dualpipe():
    out = run_ranks(_worker, 4, timeout_s=300)
    reps = [rep for pair in out for rep in pair]
    assert sorted({rep["schedule"] for rep in reps}) == ["1f1b", "dualpipe", "dualpipev", "zb1p"]
    for rep in reps:
        assert rep["max_grad_err"] <= 1e-6, rep
        if rep["pipeline_rank"] == rep["loss_rank"]:
            assert rep["loss_equal"] is True, rep
        if "shared_embedding" in rep:
            assert rep["shared_embedding"] is True, rep
        assert rep["tied_sync"] is (rep["schedule"] in ("1f1b", "zb1p")), rep
    n_total = len(list(_model().parameters()))
    assert out[0][0]["n_params"] + out[1][0]["n_params"] == n_total   # DualPipeV: each parameter on one rank
