"""DualPipe, DualPipeV, 1F1B and ZB1P over gloo against a single-process run of the same stages:
losses bit-exact (torch.equal), gradients within 1e-6 relative, inference outputs equal."""
import copy

import pytest
import torch

from dsv3_plugin.distributed import init_distributed
from dsv3_plugin.pipeline import DualPipe, DualPipeV, OneFOneB, ZeroBubble1P
from helpers import run_ranks
from pipeline_stages import MLPStage, OverlapStage, criterion, make_batch, make_stages, reference, rel_err

RUNTIMES = {"1f1b": OneFOneB, "zb1p": ZeroBubble1P, "dualpipe": DualPipe, "dualpipev": DualPipeV}


def _local_stage_ids(name, P, r):
    if name in ("1f1b", "zb1p"):
        return [r]
    if name == "dualpipe":
        return [r, P - 1 - r]
    return [r, 2 * P - 1 - r]


def _check(name, P, r, C, stage_cls, seed, group=None, mapping=None):
    n_stages = 2 * P if name == "dualpipev" else P
    full = make_stages(n_stages, seed, stage_cls)
    ids = _local_stage_ids(name, P, r)
    local = [copy.deepcopy(full[i]) for i in ids]
    rt = RUNTIMES[name](local, process_group=group, rank_mapping=mapping, timeout_s=60)
    report = {}
    for it in range(2):                         # two steps: no state may leak between them
        for m in local:
            m.zero_grad(set_to_none=True)
        x, y = make_batch(2 * C, seed=10 * seed + it)
        ref_loss, ref_out, ref_stages = reference(full, x, y, C)
        losses, _ = rt.step(x, num_chunks=C, criterion=criterion, labels=(y,))
        if r == rt.loss_rank:
            report[f"loss_equal_{it}"] = bool(torch.equal(losses, ref_loss))
        else:
            report[f"loss_none_{it}"] = losses is None
        errs = []
        for sid, m in zip(ids, local):
            for (n, p), (_, q) in zip(m.named_parameters(), ref_stages[sid].named_parameters()):
                errs.append(rel_err(p.grad, q.grad))
        report[f"grad_err_{it}"] = max(errs)
    with torch.no_grad():
        x, y = make_batch(2 * C, seed=99)
        ref_loss, ref_out, _ = reference(full, x, y, C)
        losses, outs = rt.step(x, num_chunks=C, criterion=criterion, labels=(y,), return_outputs=True)
        if r == rt.loss_rank:
            report["infer_equal"] = bool(torch.equal(losses, ref_loss)) and bool(torch.equal(outs, ref_out))
    return report


def _worker(cases4, cases_a, cases_b):
    """4 ranks: PP=4 on the world group; then PP=2 on {0, 1} and, concurrently, on {2, 3} with the
    pipeline ranks reversed (rank_mapping) to exercise sub-groups and the mapping."""
    r, world = init_distributed()
    assert world == 4
    pair_a = torch.distributed.new_group([0, 1])
    pair_b = torch.distributed.new_group([2, 3])
    out = {}
    _run_cases(4, r, cases4, None, None, out, "pp4")
    if r < 2:
        _run_cases(2, r, cases_a, pair_a, None, out, "pp2a")
    else:
        _run_cases(2, 3 - r, cases_b, pair_b, [1, 0], out, "pp2b")
    return out


def _run_cases(P, r, cases, group, mapping, out, tag):
    for i, (name, C, overlap) in enumerate(cases):
        OverlapStage.calls = 0
        rep = _check(name, P, r, C, OverlapStage if overlap else MLPStage, seed=i + 1, group=group,
                     mapping=mapping)
        if overlap:
            rep["overlap_calls"] = OverlapStage.calls
        out[f"{tag}/{name}/C={C}/overlap={overlap}"] = rep


def _assert_reports(results):
    for r, per_case in enumerate(results):
        for case, rep in per_case.items():
            for k, v in rep.items():
                if k.startswith("grad_err"):
                    assert v <= 1e-6, (r, case, k, v)
                elif k == "overlap_calls":
                    assert v > 0, (r, case, "overlap hook never called")
                else:
                    assert v is True, (r, case, k, v)


@pytest.mark.dist
def test_pipeline_schedules_match_single_process():
    cases4 = [("1f1b", 4, False), ("zb1p", 6, False), ("dualpipe", 8, True), ("dualpipev", 8, False),
              ("dualpipev", 10, True)]
    cases_a = [("1f1b", 3, False), ("dualpipe", 4, False), ("dualpipev", 5, True)]
    cases_b = [("zb1p", 4, False), ("dualpipe", 6, True), ("dualpipev", 4, False)]
    results = run_ranks(_worker, 4, cases4, cases_a, cases_b, timeout_s=300)
    assert sum(len(r) for r in results) == 4 * len(cases4) + 2 * len(cases_a) + 2 * len(cases_b)
    _assert_reports(results)
