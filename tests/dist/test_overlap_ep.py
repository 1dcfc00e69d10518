"""Computation-communication overlap of DualPipe's FB pairs (DeepSeek-V3 §3.2.1, Fig. 4) on 4 gloo ranks,
pp 2 x dp 2 with EP 2 carved from each stage's data-parallel group, one spawn for everything:

- the asynchronous all-to-all (`dispatch.exchange_start`, started then waited for) equals the synchronous
  `AllToAll` bit for bit, forward and backward, plain and with the FP8 dispatch codec;
- DualPipe and DualPipeV steps with the stages' overlap hook (`DSv3Stage.overlapped_forward_backward`: the two
  chunks of each FB op as lock-step lanes) equal the same steps run F then B: losses and every gradient
  `torch.equal` (each chunk runs exactly the plain forward / plain backward ops), with FP8 dispatch on and off,
  per-expert and node-deduplicated dispatch, lanes taking turns (own EP groups for the backward lane) and in
  lock step (shared groups); the hook really ran (FB ops through it, the turn passed between the lanes);
- `dsv3 train`'s pipelined engine (through `python -m benchmarks overlap`'s per-rank measurement: two engines, two
  steps each, tiny model): `parallel.overlap_ep_comm` switches the FB path (hook vs none) and both give the same
  losses, the second step's after an optimizer step; the bench's summary and timeline (no timing asserted).
"""

import dataclasses

import pytest
import torch
from helpers import run_ranks

PP, DP, EP = 2, 2, 2
C, MB, T = 4, 1, 16  # micro-batches per step, sequences per micro-batch, tokens
BASE = {
    "preset": "tiny",
    "model": {"num_hidden_layers": 4},
    "moe": {"ranks_per_node": 1},
    "train": {"seq_len": T, "seed": 1234},
}
# each schedule runs with and without FP8 dispatch; the two dispatch modes alternate between them
# (schedule, FP8 dispatch, node-deduplicated dispatch, lockstep lanes). The lanes take turns as their all-to-alls
# arrive, the backward lane on the second EP groups; the last case takes the groups' second groups away, so the
# lanes pass the turn in program order on shared groups (the CUDA path's order, run on gloo).
CASES = [
    ("dualpipe", False, False, False),
    ("dualpipe", True, True, False),
    ("dualpipev", False, True, False),
    ("dualpipev", True, False, False),
    ("dualpipev", False, True, True),
]
NAMES = [f"{s} fp8_dispatch={f} dedup={d}" + (" lockstep" if ls else "") for s, f, d, ls in CASES]


def _async_vs_sync(groups):
    """exchange_start + wait == AllToAll (forward values, input gradients), plain and FP8-encoded payloads."""
    from dsv3_plugin.parallel.dispatch import AllToAll, FP8Codec, exchange_start

    g = torch.Generator().manual_seed(10 + groups.ep_rank)
    send = [3, 5] if groups.ep_rank == 0 else [4, 2]
    recv = [3, 4] if groups.ep_rank == 0 else [5, 2]
    out = []
    for codec in (None, FP8Codec()):
        x = torch.randn(sum(send), 64, generator=g)
        w = torch.rand(sum(send), 1, generator=g)
        ids = torch.randint(0, 8, (sum(send),), generator=g).to(torch.uint8)
        gy = torch.randn(sum(recv), 64, generator=g)
        gw = torch.randn(sum(recv), 1, generator=g)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        ya, ida, va = exchange_start([xa, ids, wa], recv, send, groups.ep_group, EP, codecs=[codec, None, None]).wait()
        torch.autograd.backward([ya, va], [gy, gw])
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        ys = AllToAll.apply(xs, recv, send, groups.ep_group, codec)
        vs = AllToAll.apply(ws, recv, send, groups.ep_group)
        ids_s = AllToAll.apply(ids, recv, send, groups.ep_group)
        torch.autograd.backward([ys, vs], [gy, gw])
        out.append(
            all(
                torch.equal(a, b) for a, b in [(ya, ys), (va, vs), (ida, ids_s), (xa.grad, xs.grad), (wa.grad, ws.grad)]
            )
        )
    return out


def _pipeline_case(schedule, fp8_dispatch, dedup, lockstep, pg):
    """One step with the overlap hook and one F-then-B, same stages, inputs and criterion."""
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.parallel.dispatch import FP8Codec
    from dsv3_plugin.parallel.expert_parallel import expert_parallel
    from dsv3_plugin.parallel.groups import build_ep_groups
    from dsv3_plugin.parallel.overlap import wait_clock
    from dsv3_plugin.parallel.pipeline import PipelineRuntime
    from dsv3_plugin.parallel.pipeline.stages import DSv3PipelineLoss, build_stages, n_stages_of, stage_ids_for_rank
    from dsv3_plugin.training.transforms import build_model

    cfg = DSv3Config.from_block({**BASE, "parallel": {"pp": PP, "ep": EP, "schedule": schedule}})
    torch.manual_seed(0)
    model = build_model(cfg)
    stages = build_stages(model, n_stages_of(schedule, PP), stage_ids_for_rank(schedule, PP, pg.pp_rank))
    groups = build_ep_groups(EP, 1, pp=PP, dp_group=pg.dp_group)
    if lockstep:
        groups = dataclasses.replace(groups, ep_group_b=None, node_group_b=None)
    expert_parallel(torch.nn.ModuleList(stages), groups, dedup=dedup, codec=FP8Codec() if fp8_dispatch else None)
    gen = torch.Generator().manual_seed(50 + pg.dp_rank)
    ids = torch.randint(0, cfg.model.vocab_size, (C * MB, T), generator=gen)
    labels = torch.randint(0, cfg.model.vocab_size, (C * MB, T), generator=gen)
    params = [p for st in stages for p in st.parameters()]
    res = {}
    for overlap in (True, False):
        for p in params:
            p.grad = None
        rt = PipelineRuntime(stages, schedule=schedule, process_group=pg.pp_group, overlap=overlap)
        h0, l0 = wait_clock().handovers, wait_clock().lockstep_pairs
        out = rt.step(ids, num_chunks=C, criterion=DSv3PipelineLoss(cfg, scale=1.0 / C), labels=(labels,))
        res[overlap] = {
            "losses": out.losses,
            "grads": [None if p.grad is None else p.grad.clone() for p in params],
            "fb_hook": rt.last_step["fb_hook"],
            "handovers": wait_clock().handovers - h0,
            "lockstep_pairs": wait_clock().lockstep_pairs - l0,
            "a2a_waits": rt.last_step["a2a_wait_s"],
        }
    on, off = res[True], res[False]
    return {
        "losses_equal": (on["losses"] is None and off["losses"] is None) or torch.equal(on["losses"], off["losses"]),
        "has_losses": on["losses"] is not None,
        "grads_equal": all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(on["grads"], off["grads"])
        ),
        "n_grads": sum(g is not None for g in on["grads"]),
        "fb_hook": (on["fb_hook"], off["fb_hook"]),
        "handovers": (on["handovers"], off["handovers"]),
        "lockstep": on["lockstep_pairs"] == on["fb_hook"] > 0 and not off["lockstep_pairs"],
        "turns": on["lockstep_pairs"] == off["lockstep_pairs"] == 0,
    }


def _main():
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.parallel.groups import build_ep_groups, pipeline_groups

    init_distributed("gloo")
    torch.set_num_threads(1)
    pg = pipeline_groups(PP, timeout_s=120)
    res = {"async": _async_vs_sync(build_ep_groups(EP, 1, pp=PP, dp_group=pg.dp_group))}
    res["pipeline"] = {name: _pipeline_case(*case, pg) for name, case in zip(NAMES, CASES)}
    from benchmarks.overlap import _rank_main

    res["bench"] = _rank_main(BENCH)  # two PipelinedEngines, parallel.overlap_ep_comm true / false
    return res


BENCH = {
    "pp": PP,
    "ep": EP,
    "schedule": "dualpipev",
    "preset": "tiny",
    "layers": 8,
    "seq_len": T,
    "mtp_depth": 0,
    "micro_batch": MB,
    "chunks": C,
    "steps": 1,
    "fp8_dispatch": False,
}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_main, PP * DP, timeout_s=600)


@pytest.mark.dist
def test_async_all_to_all_equals_sync(ranks):
    for r in ranks:
        assert r["async"] == [True, True]  # plain, FP8 dispatch codec


@pytest.mark.dist
@pytest.mark.parametrize("case", NAMES)
def test_overlap_hook_equals_f_then_b(ranks, case):
    for rank, r in enumerate(ranks):
        c = r["pipeline"][case]
        assert c["fb_hook"][0] > 0 and c["fb_hook"][1] == 0, (rank, c["fb_hook"])  # the hook ran (only with it)
        assert c["handovers"][0] > 0 and c["handovers"][1] == 0, (rank, c["handovers"])  # the lanes alternated
        assert c["lockstep"] if case.endswith("lockstep") else c["turns"], (case, rank)
        assert c["n_grads"] > 0
        assert c["losses_equal"], (case, rank)
        assert c["grads_equal"], (case, rank)
    assert ranks[0]["pipeline"][case]["has_losses"]  # the loss rank of DualPipe(V): pipeline rank 0


@pytest.mark.dist
def test_train_key_switches_the_fb_path(ranks):
    """`dsv3 train`'s engine with parallel.overlap_ep_comm true runs every FB op through the hook, false none;
    the losses of both steps (the second after an optimizer step) are equal on every rank."""
    for r in ranks:
        b = r["bench"]
        assert b["engines_overlap_ep"] == [True, False]
        assert b["hook"]["fb_hook"] == b["n_fb"] and b["sequential"]["fb_hook"] == 0
        assert b["losses_equal"] and len(b["losses"]) == 2


@pytest.mark.dist
def test_bench_overlap_measures_both_variants(ranks, tmp_path):
    from benchmarks.overlap import summarize
    from dsv3_plugin.parallel.pipeline.overlap_timeline import plot_overlap_timeline

    res = summarize([r["bench"] for r in ranks], BENCH)
    assert res["losses_equal"]
    assert {"ours", "baseline", "ratio", "fb_pair_wall_s", "step_wall_s"} <= res.keys()
    for row in res["ranks"]:
        assert row["fb_pairs"] > 0
        assert row["hook"]["fb_pairs_through_hook"] == row["fb_pairs"]
        assert row["sequential"]["fb_pairs_through_hook"] == 0
        for v in ("hook", "sequential"):
            fb = row[v]["per_op"]["FB"]
            assert fb["op_s"] > 0 and fb["a2a_wait_s"] >= 0 and fb["compute_s"] > 0
    ev = res["_events"]  # pipeline rank 0's middle FB pair: both chunks compute and communicate
    assert {(e["lane"], e["chunk"]) for e in ev} == {("compute", "F"), ("compute", "B"), ("comm", "F"), ("comm", "B")}
    assert {e["label"] for e in ev if e["lane"] == "compute"} == {"attention", "mlp"}
    assert {e["label"] for e in ev if e["lane"] == "comm"} == {"dispatch", "combine"}
    assert all(e["end"] >= e["start"] for e in ev)
    assert 0 <= res["timeline_pair"]["exposed_s"] <= res["timeline_pair"]["pair_s"]
    path = plot_overlap_timeline(ev, str(tmp_path / "pair.png"), "smoke")
    assert (tmp_path / "pair.png").stat().st_size > 0 and path.endswith("pair.png")
