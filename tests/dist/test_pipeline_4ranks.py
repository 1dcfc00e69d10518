"""All 4-rank pipeline checks in one gloo run (process start-up dominates on a small machine).

1. Generic stages: 1F1B, ZB1P, DualPipe, DualPipeV at PP=4 on the world group, then PP=2 on two 2-rank
   sub-groups at once (one with reversed rank_mapping): per-micro-batch losses torch.equal to a
   single-process run of the same stages, gradients within the float32 bound for the reordered micro-batch
   sums (after DualPipe's mirror sync), the overlap hook called, two steps (no state leaks), inference
   losses and outputs torch.equal.
2. DeepSeek-V3 stages (MLA, MoE + balance loss, MTP): DualPipeV (4 stages on 2 ranks) and DualPipe, then
   1F1B and ZB1P with every nn.Linear and expert GEMM deferring its weight grads: losses bit-identical to DSv3Model,
   gradients within the float32 bound of a reordered backward (tests/tolerance.py), the embedding shared on
   rank 0 or synchronised (1F1B/ZB1P + MTP).
3. Failures, last: a wrong shape raises on both sides; a stuck peer raises after the timeout; a dead peer
   raises when its connection drops — all as PipelineError, no hang.
"""

import copy
import time

import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from pipeline_stages import H, MLPStage, OverlapStage, criterion, grad_bound, make_batch, make_stages, reference
from tolerance import check_within, model_bound

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.distributed import init_distributed
from dsv3_plugin.parallel.pipeline import DualPipe, DualPipeV, OneFOneB, PipelineError, ZeroBubble1P, split_weight_grads
from dsv3_plugin.parallel.pipeline.stages import (
    DSv3PipelineLoss,
    build_stages,
    n_stages_of,
    stage_ids_for_rank,
    sync_tied_embedding,
)
from dsv3_plugin.training.transforms import build_model

# a 3 s peer timeout: `make test` runs these alone, with the cores to themselves (pyproject's `serial` marker)
pytestmark = pytest.mark.serial

RUNTIMES = {"1f1b": OneFOneB, "zb1p": ZeroBubble1P, "dualpipe": DualPipe, "dualpipev": DualPipeV}
TIMEOUT = 3.0
# (schedule, micro-batches, overlap hook[, p2p_order]); "pairwise" is the NCCL-safe issue order
CASES4 = [
    ("1f1b", 4, False),
    ("zb1p", 6, False),
    ("dualpipe", 8, True),
    ("dualpipev", 8, False),
    ("dualpipev", 10, True),
    ("dualpipe", 8, False, "pairwise"),
    ("dualpipev", 9, False, "pairwise"),
]
CASES_A = [("1f1b", 3, False), ("dualpipe", 4, False), ("dualpipev", 5, True)]
CASES_B = [("zb1p", 4, False), ("dualpipe", 6, True), ("dualpipev", 4, False, "pairwise")]


# ---- 1. generic stages ------------------------------------------------------------------------------
def _local_stage_ids(name, P, r):
    if name in ("1f1b", "zb1p"):
        return [r]
    if name == "dualpipe":
        return [r, P - 1 - r]
    return [r, 2 * P - 1 - r]


def _check(name, P, r, C, stage_cls, seed, group=None, mapping=None, order=None):
    n_stages = 2 * P if name == "dualpipev" else P
    full = make_stages(n_stages, seed, stage_cls)
    ids = _local_stage_ids(name, P, r)
    local = [copy.deepcopy(full[i]) for i in ids]
    rt = RUNTIMES[name](local, process_group=group, rank_mapping=mapping, timeout_s=60, p2p_order=order)
    report = {"order": rt.p2p_order == (order or "sender")}
    for it in range(2):  # two steps: no state may leak between them
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
                errs.append(check_within(p.grad, q.grad, grad_bound(q.grad, n_stages, C), f"step {it} stage {sid} {n}"))
        report[f"grad_err_{it}"] = [e for e in errs if e]
    with torch.no_grad():
        x, y = make_batch(2 * C, seed=99)
        ref_loss, ref_out, _ = reference(full, x, y, C)
        losses, outs = rt.step(x, num_chunks=C, criterion=criterion, labels=(y,), return_outputs=True)
        if r == rt.loss_rank:
            report["infer_equal"] = bool(torch.equal(losses, ref_loss)) and bool(torch.equal(outs, ref_out))
    return report


def _run_cases(P, r, cases, group, mapping, out, tag):
    for i, (name, C, overlap, *order) in enumerate(cases):
        OverlapStage.calls = 0
        rep = _check(
            name,
            P,
            r,
            C,
            OverlapStage if overlap else MLPStage,
            seed=i + 1,
            group=group,
            mapping=mapping,
            order=order[0] if order else None,
        )
        if overlap:
            rep["overlap_calls"] = OverlapStage.calls
        out[f"{tag}/{name}/C={C}/overlap={overlap}/{order}"] = rep


# ---- 2. DeepSeek-V3 stages --------------------------------------------------------------------------
C_DS = 4


def _model():
    torch.manual_seed(0)
    m = build_model(DSv3Config.from_block({"preset": "tiny", "model": {"num_hidden_layers": 4}}))
    m.train()
    return m


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (C_DS, 10), generator=g), torch.randint(0, 256, (C_DS, 10), generator=g)


def _dsv3_cases(r, groups):
    first = _run(r, groups, *(("dualpipev", DualPipeV) if r < 2 else ("dualpipe", DualPipe)), split=False)
    second = _run(r, groups, *(("1f1b", OneFOneB) if r < 2 else ("zb1p", ZeroBubble1P)), split=True)
    return first, second


def _run(r, groups, schedule, cls, split):
    pr = r % 2
    ids, labels = _data()
    model = _model()
    ref = copy.deepcopy(model)
    ref_losses = []
    for i in range(C_DS):  # the reference: one micro-batch at a time, gradients accumulate
        out = ref(ids[i : i + 1], labels[i : i + 1])
        out.loss.backward()
        ref_losses.append(out.loss.detach())
    stages = build_stages(model, n_stages_of(schedule, 2), stage_ids_for_rank(schedule, 2, pr))
    if split:
        for st in stages:
            split_weight_grads(st)
    rt = cls(stages, process_group=groups[r // 2], timeout_s=60)
    crit = DSv3PipelineLoss(model)
    losses, _ = rt.step(ids, num_chunks=C_DS, criterion=crit, labels=(labels,))
    rep = {
        "schedule": schedule,
        "pipeline_rank": pr,
        "loss_rank": rt.loss_rank,
        "tied_sync": sync_tied_embedding(rt, stages),
    }
    if pr == rt.loss_rank:
        rep["loss_equal"] = bool(torch.equal(losses, torch.stack(ref_losses)))
    if len(stages) == 2 and pr == 0:
        rep["shared_embedding"] = stages[0].embed_tokens.weight is stages[1].embed_tokens.weight
    ref_params = dict(ref.named_parameters())
    errs = []
    seen = set()
    for s in stages:
        for n, p in s.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            full = next(k for k, q in model.named_parameters() if q is p)
            q = ref_params[full]
            # forward identical (losses equal); the backward reordered: micro-batch sums, the tied
            # embedding's sync, and with `split` the deferred W-GEMMs
            errs.append(
                check_within(
                    p.grad, q.grad, model_bound(q.grad, model.cfg, ids.numel(), passes=1), f"{schedule} {full}.grad"
                )
            )
    rep["grad_errors"] = [e for e in errs if e]
    rep["n_params"] = len(errs)
    return rep


# ---- 3. failures ------------------------------------------------------------------------------------
class WideStage(MLPStage):
    """Emits one extra feature: disagrees with the declared P2P shape."""

    def forward(self, x):
        y = super().forward(x)
        return torch.cat([y, y[..., :1]], dim=-1)


def _attempt(rt, *args, **kw):
    t0 = time.monotonic()
    try:
        rt.step(*args, **kw)
    except PipelineError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def _failures(r, pair_a, pair_b, pair_c):
    torch.manual_seed(0)
    x, y = make_batch(8)
    if r in (0, 1):
        mods = [WideStage() if r == 0 else MLPStage(), MLPStage()]
        rt = DualPipeV(mods, process_group=pair_a, timeout_s=TIMEOUT, p2p_shapes=[((2, 3, H), torch.float32)])
        return {"shape": _attempt(rt, x, num_chunks=4, criterion=criterion, labels=(y,))}
    if r == 3:
        time.sleep(TIMEOUT + 2)  # alive but silent for longer than the timeout ...
        return {}  # ... then gone: returning ends this process and closes its sockets
    stuck = _attempt(OneFOneB([MLPStage()], process_group=pair_b, timeout_s=TIMEOUT), x, num_chunks=2)
    dead = _attempt(OneFOneB([MLPStage()], process_group=pair_c, timeout_s=TIMEOUT + 30), x, num_chunks=2)
    return {"stuck": stuck, "dead": dead}


def _worker():
    r, world = init_distributed()
    assert world == 4
    pair_a, pair_b = dist.new_group([0, 1]), dist.new_group([2, 3])
    pair_c = dist.new_group([2, 3])  # a fresh pair for the dead-peer step after the timeout
    generic = {}
    _run_cases(4, r, CASES4, None, None, generic, "pp4")
    if r < 2:
        _run_cases(2, r, CASES_A, pair_a, None, generic, "pp2a")
    else:
        _run_cases(2, 3 - r, CASES_B, pair_b, [1, 0], generic, "pp2b")
    dsv3 = _dsv3_cases(r, [pair_a, pair_b])
    dist.barrier()
    return {"generic": generic, "dsv3": dsv3, "failures": _failures(r, pair_a, pair_b, pair_c)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_worker, 4, timeout_s=400)


@pytest.mark.dist
def test_schedules_match_single_process(results):
    per_rank = [res["generic"] for res in results]
    assert sum(len(r) for r in per_rank) == 4 * len(CASES4) + 2 * len(CASES_A) + 2 * len(CASES_B)
    for r, per_case in enumerate(per_rank):
        for case, rep in per_case.items():
            for k, v in rep.items():
                if k.startswith("grad_err"):
                    assert v == [], (r, case, k, v)
                elif k == "overlap_calls":
                    assert v > 0, (r, case, "overlap hook never called")
                else:
                    assert v is True, (r, case, k, v)


@pytest.mark.dist
def test_dsv3_model_through_all_schedules(results):
    out = [res["dsv3"] for res in results]
    reps = [rep for pair in out for rep in pair]
    assert sorted({rep["schedule"] for rep in reps}) == ["1f1b", "dualpipe", "dualpipev", "zb1p"]
    for rep in reps:
        assert rep["grad_errors"] == [] and rep["n_params"] > 0, rep
        if rep["pipeline_rank"] == rep["loss_rank"]:
            assert rep["loss_equal"] is True, rep
        if "shared_embedding" in rep:
            assert rep["shared_embedding"] is True, rep
        assert rep["tied_sync"] is (rep["schedule"] in ("1f1b", "zb1p")), rep
    n_total = len(list(_model().parameters()))
    assert out[0][0]["n_params"] + out[1][0]["n_params"] == n_total  # DualPipeV: each parameter on one rank


@pytest.mark.dist
def test_wrong_shape_dead_and_stuck_peers_raise_in_time(results):
    res = [r["failures"] for r in results]
    msg0, t0 = res[0]["shape"]
    msg1, t1 = res[1]["shape"]
    # the sender names its own output and the declaration; the receiver names what arrived
    assert msg0 is not None and "rank 0 -> rank 1" in msg0 and "declared p2p shapes" in msg0, msg0
    assert "(2, 3, 9)" in msg0 and "(2, 3, 8)" in msg0, msg0
    assert msg1 is not None and "rank 1 <- rank 0" in msg1 and "(2, 3, 9)" in msg1, msg1
    assert t0 < TIMEOUT and t1 < TIMEOUT, (t0, t1)
    msg, t = res[2]["stuck"]
    assert msg is not None and "pipeline rank 1 (global 3)" in msg and "peer dead or stuck" in msg, msg
    assert TIMEOUT - 0.5 < t < TIMEOUT + 3, t
    # the dead peer is noticed when its connection drops, long before that step's 33 s timeout
    msg, t = res[2]["dead"]
    assert msg is not None and "pipeline rank 1 (global 3)" in msg and "peer dead or stuck" in msg, msg
    assert t < 15, t
