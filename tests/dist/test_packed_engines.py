"""Both training engines on packed, padded `Batch`es (2 gloo ranks): the pipelined engine (pp = 2: 1F1B, DualPipe,
DualPipeV with the W split) computes the single-process model's losses, gradients and router-bias update, and its
`eval_loss` the single-process LM cross-entropy sum; the ZeRO engine (pp = 1, dp = 2) the same over both ranks'
data. `eval_loss` changes nothing: parameters, gradients, router biases and loads, optimizer state, train mode.

Why these tolerances: a pipeline stage runs the model's own ops on the same micro-batch (same shapes), so each
micro-batch's losses are the same floats; only their float64 sum over micro-batches / ranks is reordered
(`reorder_bound` over GAS x ranks terms). Gradients are accumulated over micro-batches in another order (and, with
the W split, each deferred weight GEMM runs as one matmul): `model_bound` over the step's tokens, forward +
backward. Router-bias updates are signs of integer loads from identical routing decisions: equal.
"""

import copy

import pytest
import torch
from helpers import run_ranks
from tolerance import check_within, model_bound, reorder_bound

GAS, MBS, SEQ, PAD = 4, 2, 24, 2
DSV3 = {
    "preset": "tiny",
    "model": {"num_hidden_layers": 4},
    "mtp": {"depth": 1},
    "moe": {"bias_update_speed": 0.01},
    "train": {"seq_len": SEQ, "steps": 1, "seed": 1234},
}
DS = {
    "train_micro_batch_size_per_gpu": MBS,
    "gradient_accumulation_steps": GAS,
    "steps_per_print": 10**9,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": DSV3,
}
SCHEDULES = (("1f1b", False), ("dualpipe", True), ("dualpipev", True))


def _batches(seed: int, n: int = GAS):
    """n micro-batches of MBS packed rows (three documents each, positions restarting at 0, -100 after each
    document's last token); every other micro-batch pads its first row's last 5 tokens (token_mask False)."""
    from dsv3_plugin.data.batch import IGNORE_INDEX, Batch

    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(n):
        ids = torch.randint(3, 256, (MBS, SEQ), generator=g)
        labels = torch.full((MBS, SEQ), IGNORE_INDEX)
        pos = torch.zeros(MBS, SEQ, dtype=torch.int64)
        mask = torch.ones(MBS, SEQ, dtype=torch.bool)
        for b in range(MBS):
            end = SEQ - 5 if (m % 2 and b == 0) else SEQ
            cuts = sorted((torch.randperm(end - 2, generator=g)[:2] + 1).tolist())
            for a, z in zip([0, *cuts], [*cuts, end]):
                pos[b, a:z] = torch.arange(z - a)
                labels[b, a : z - 1] = ids[b, a + 1 : z]
            if end < SEQ:
                ids[b, end:] = PAD
                pos[b, end:] = torch.arange(SEQ - end)
                mask[b, end:] = False
        out.append(Batch(ids, labels, pos, mask))
    return out


def _state(module, engine):
    """Everything eval_loss must leave alone: parameters, gradients, router state, optimizer state, step count."""
    snap = {f"p:{n}": p.detach().clone() for n, p in module.named_parameters()}
    snap.update({f"g:{n}": p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
    snap.update({f"b:{n}": b.clone() for n, b in module.named_buffers() if n.endswith(("bias", "tokens_per_expert"))})
    opt = engine.optimizer.state_dict()

    def tensors(x, key):
        if torch.is_tensor(x):
            snap[key] = x.detach().clone()
        elif isinstance(x, dict):
            for k, v in x.items():
                tensors(v, f"{key}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                tensors(v, f"{key}.{i}")

    tensors(opt, "opt")
    snap["steps"] = torch.tensor(engine.global_steps)
    return snap


def _unchanged(before, after):
    if before.keys() != after.keys():
        return f"eval_loss changed which state exists: {sorted(set(before) ^ set(after))[:5]}"
    bad = [k for k in before if not torch.equal(before[k], after[k])]
    return f"eval_loss changed {bad[:5]}" if bad else None


def _reference(model, batches, gamma, short=0):
    """Single process, plain model: the eval CE sum / loss-token count (before training), then per-micro-batch loss
    terms, gradients of mean(loss) and the bias update."""
    from dsv3_plugin.model.moe.balancing import update_expert_bias
    from dsv3_plugin.model.packing import lm_ce_sum

    def evaluate(bs):
        with torch.no_grad():
            ce = sum(
                float(
                    lm_ce_sum(model(b.input_ids, position_ids=b.position_ids, token_mask=b.token_mask).logits, b.labels)
                )
                for b in bs
            )
        return ce, sum(b.loss_tokens for b in bs)

    model.eval()
    evals = evaluate(batches), evaluate(batches[:short])
    model.train()
    terms = []
    for b in batches:
        o = model(b.input_ids, labels=b.labels, position_ids=b.position_ids, token_mask=b.token_mask)
        (o.loss / len(batches)).backward()
        terms.append([float(t.detach()) for t in (o.loss, o.lm_loss, o.mtp_loss, o.balance_loss)])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    loads = [m.gate.tokens_per_expert.clone() for m in model.moe_layers()]
    update_expert_bias(model, gamma, reduce=lambda c: c)  # this process's loads only (no all-reduce)
    return {
        "terms": terms,
        "grads": grads,
        "loads": loads,
        "eval": evals[0],
        "eval_short": evals[1],
        "bias": {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")},
    }


def _pipelined(schedule, split):
    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.deepspeed.run_config import RunConfig
    from dsv3_plugin.deepspeed.train import PipelinedStepEngine
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.training.transforms import build_model

    init_distributed()
    ds = copy.deepcopy(DS)
    ds["dsv3"]["parallel"] = {"pp": 2, "schedule": schedule, "split_weight_grads": split}
    cfg = DSv3Config.from_block(ds["dsv3"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    ref_model = copy.deepcopy(model)
    names = {id(p): n for n, p in model.named_parameters()}
    bufs = {id(b): n for n, b in model.named_buffers()}
    eng = PipelinedStepEngine(model, RunConfig(ds=ds, cfg=cfg))
    pe = eng.pe
    batches = _batches(7)
    out = {"problems": []}

    before = _state(eng.module, pe.engine)
    out["eval_before"] = eng.eval_loss(batches)
    out["eval_short"] = eng.eval_loss(batches[:3])  # fewer than gas: the group is completed with no-loss copies
    out["problems"].append(_unchanged(before, _state(eng.module, pe.engine)))
    out["training_after_eval"] = eng.module.training

    grads = {}
    reduce = pe.engine.allreduce_gradients

    def snapshot_then_reduce(*a, **k):
        grads.update({names[id(p)]: p.grad.detach().clone() for p in eng.module.parameters() if p.grad is not None})
        return reduce(*a, **k)

    pe.engine.allreduce_gradients = snapshot_then_reduce
    gamma = cfg.moe.gamma(0.0)
    res = eng.train_step(batches)
    out["result"] = {k: res[k] for k in ("loss", "lm_loss", "mtp_loss", "balance_loss", "step_tokens")}
    out["w_closures"] = pe.runtime.last_step["w_closures"]
    out["grads"] = grads
    out["bias"] = {
        bufs[id(b)]: b.clone()
        for b in eng.module.buffers()
        if id(b) in bufs and bufs[id(b)].endswith("e_score_correction_bias")
    }
    before = _state(eng.module, pe.engine)  # now with optimizer state (AdamW moments) and gradients
    eng.eval_loss(batches)
    out["problems"].append(_unchanged(before, _state(eng.module, pe.engine)))
    out["ref"] = _reference(ref_model, batches, gamma, short=3)
    return out


def _zero():
    import torch.distributed as dist

    from dsv3_plugin.config import DSv3Config
    from dsv3_plugin.deepspeed.run_config import RunConfig
    from dsv3_plugin.deepspeed.train import ZeroStepEngine
    from dsv3_plugin.parallel.distributed import init_distributed
    from dsv3_plugin.training.transforms import build_model

    init_distributed()
    rank = dist.get_rank()
    ds = copy.deepcopy(DS)
    ds["dsv3"]["parallel"] = {"ep": 2}  # the experts split over both ranks: packed / padded tokens dispatched
    cfg = DSv3Config.from_block(ds["dsv3"])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    ref_model = copy.deepcopy(model)
    run = RunConfig.load(ds, target="engine", world_size=dist.get_world_size(), model_shape=model.cfg)
    eng = ZeroStepEngine(model, run)
    per_rank = [_batches(20 + r) for r in range(2)]
    before = _state(eng.module, eng.engine)
    ev = eng.eval_loss(per_rank[rank])
    problems = [_unchanged(before, _state(eng.module, eng.engine))]
    res = eng.train_step(per_rank[rank])
    ev_after = eng.eval_loss(per_rank[rank])
    # the reference: both ranks' micro-batches through one plain model (dp = 2 averages over 2 x GAS)
    ref = _reference(ref_model, per_rank[0] + per_rank[1], cfg.moe.gamma(0.0))
    bias = {n: b.clone() for n, b in eng.module.named_buffers() if n.endswith("e_score_correction_bias")}
    return {
        "eval": ev,
        "eval_after": ev_after,
        "problems": problems,
        "ref": ref,
        "bias": bias,
        "result": {k: res[k] for k in ("loss", "lm_loss", "mtp_loss", "balance_loss", "step_tokens")},
        "training": eng.module.training,
    }


def _all():
    zero = _zero()  # first: DeepSpeed keeps the pipelined engines' model-parallel unit in global state
    return [_pipelined(s, split) for s, split in SCHEDULES], zero


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all, 2, timeout_s=600)


def _check_terms(result, terms, where, cfg=None):
    """`cfg` given: the engine's forward reorders too (expert parallelism's combine), `model_bound` on top."""
    ref = torch.tensor(terms, dtype=torch.float64).mean(0)
    for i, k in enumerate(("loss", "lm_loss", "mtp_loss", "balance_loss")):
        # the same float32 per micro-batch on both sides; their float64 mean is summed in another order
        bound = float(reorder_bound(len(terms), ref[i].abs() + 1e-30, torch.float64))
        if cfg is not None:
            bound += float(model_bound(ref[i].float(), cfg, MBS * SEQ, passes=1))
        assert abs(result[k] - float(ref[i])) <= bound, (where, k, result[k], float(ref[i]))


@pytest.mark.dist
@pytest.mark.parametrize("which", range(len(SCHEDULES)))
def test_pipelined_engine_on_packed_batches_equals_single_process(runs, which):
    from dsv3_plugin.config import DSv3Config

    schedule, split = SCHEDULES[which]
    cfg = DSv3Config.from_block({**DSV3})
    tokens = GAS * MBS * SEQ
    problems = []
    for r, per in enumerate(runs):
        got = per[0][which]
        ref = got["ref"]
        where = f"{schedule} rank {r}"
        problems += [p for p in got["problems"] if p]
        assert got["training_after_eval"] is True
        _check_terms(got["result"], ref["terms"], where)
        assert got["result"]["step_tokens"] == GAS * MBS * SEQ  # input tokens, padding included
        if split:
            assert got["w_closures"] > 0, where
        # eval: the same per-micro-batch CE sums, summed in float64 (pipeline: loss rank, then all-reduce)
        for ev, (ce, n) in ((got["eval_before"], ref["eval"]), (got["eval_short"], ref["eval_short"])):
            assert ev[1] == n, (where, ev, n)
            assert abs(ev[0] - ce) <= float(reorder_bound(GAS, abs(ce), torch.float64)), (where, ev, ce)
        # gradients of this rank's stages: the accumulation over micro-batches (and the W split's GEMMs) reorder
        assert got["grads"] and set(got["grads"]) <= set(ref["grads"]), where
        for n, g in got["grads"].items():
            g_ref = ref["grads"][n]
            problems.append(
                check_within(
                    g,
                    g_ref,
                    model_bound(g_ref, cfg, tokens, passes=2),
                    f"{where} grad {n}: pipeline accumulation vs one process",
                )
            )
        # the bias update: signs of the same integer loads (padding not counted on either side)
        assert got["bias"] and all(torch.equal(b, ref["bias"][n]) for n, b in got["bias"].items()), where
        assert any(float(b.abs().sum()) > 0 for b in got["bias"].values()), where
    problems = [p for p in problems if p]
    assert not problems, "\n".join(problems[:5])


@pytest.mark.dist
def test_zero_engine_on_packed_batches_and_eval_loss(runs):
    """pp = 1, dp = 2, ep = 2: each rank's experts compute the other rank's tokens too, and the combine sums the k
    expert outputs of a token in another order than one process does (`model_bound`, forward only); the routing
    decisions, hence the integer loads and the bias update, are the same."""
    from dsv3_plugin.config import DSv3Config

    cfg = DSv3Config.from_block({**DSV3, "parallel": {"ep": 2}})
    z0, z1 = runs[0][1], runs[1][1]
    ref = z0["ref"]
    for r, z in enumerate((z0, z1)):
        assert not [p for p in z["problems"] if p], z["problems"]
        assert z["training"] is True
        _check_terms(z["result"], ref["terms"], f"zero rank {r}", cfg)
        assert z["result"]["step_tokens"] == 2 * GAS * MBS * SEQ
        # eval over both ranks' batches (before the step: the reference's weights), the same on every rank
        ce, n = ref["eval"]
        bound = float(reorder_bound(2 * GAS, ce, torch.float64) + model_bound(torch.tensor(ce), cfg, MBS * SEQ, 1))
        assert z["eval"][1] == n and abs(z["eval"][0] - ce) <= bound, (z["eval"], ce, bound)
        assert z["eval_after"] != z["eval"]  # the step changed the weights, so the loss: eval reads the model
        assert all(torch.equal(b, ref["bias"][n]) for n, b in z["bias"].items())
    assert z0["eval"] == z1["eval"] and z0["eval_after"] == z1["eval_after"]
