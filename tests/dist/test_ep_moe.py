"""Expert-parallel DeepSeekMoE on 4 gloo ranks (EP=4 over 4 or 2 nodes, and EP=2 x DP=2) equals the single-process layer (EP = 1) on the same
tokens and weights: outputs <= 1e-6, gradients <= 1e-5 relative; with and without shared experts, node
limits and node-deduplicated dispatch; EP = world and EP x DP. Also: router counts, no dropped tokens,
cross-node copies <= M per token with dedup."""
import torch
import torch.distributed as dist

from dsv3_plugin.config import MoEConfig
from dsv3_plugin.distributed import init_distributed
from dsv3_plugin.moe import DeepSeekMoE
from dsv3_plugin.moe_parallel import ExpertParallelMoE
from dsv3_plugin.parallel_groups import build_ep_groups
from helpers import run_ranks

H = 16


def _cfg(shared, M):
    return MoEConfig(n_routed_experts=8, n_shared_experts=shared, intermediate_size=8, top_k=4, n_group=4,
                     topk_group=M, route_scale=2.5, seq_aux_alpha=0.01)


def _reference_module(cfg):
    torch.manual_seed(3)
    m = DeepSeekMoE(H, cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
        m.gate.e_score_correction_bias.normal_(0, 0.05)
    return m.train()


def _data(rank):
    g = torch.Generator().manual_seed(50 + rank)
    T = 3 + 2 * rank                                # ranks hold different numbers of tokens
    return torch.randn(2, T, H, generator=g), torch.randn(2, T, H, generator=g)


def _rel(a, b):
    assert b.abs().max() > 0, "reference gradient is zero: the comparison would prove nothing"
    return float((a - b).abs().max() / b.abs().max())


def _one(ep, rpn, shared, M, dedup):
    rank = dist.get_rank()
    groups = build_ep_groups(ep, rpn)
    cfg = _cfg(shared, M)
    ref = _reference_module(cfg)
    par = ExpertParallelMoE.from_dense(ref, groups, dedup=dedup)
    # reference: every rank of my EP group's tokens through the full layer, one forward per rank
    ref_out = {}
    for r in groups.ep_ranks:
        x, gout = _data(r)
        x.requires_grad_(True)
        out = ref(x)
        ((out * gout).sum() + ref.aux_loss).backward()
        ref_out[r] = (out.detach(), x.grad)
    x, gout = _data(rank)
    x.requires_grad_(True)
    out = par(x)
    ((out * gout).sum() + par.aux_loss).backward()
    errs = {"out": float((out.detach() - ref_out[rank][0]).abs().max()), "x": _rel(x.grad, ref_out[rank][1])}
    sl = slice(par.local_experts.start, par.local_experts.stop)
    for n in ("gate_proj", "up_proj", "down_proj"):
        errs[f"experts.{n}"] = _rel(getattr(par.experts, n).grad, getattr(ref.experts, n).grad[sl])
    # replicated params: DP would sum their gradients over the ranks; the reference summed over tokens
    repl = [("gate.weight", par.gate.weight, ref.gate.weight)]
    if shared:
        repl += [(f"shared.{n}", getattr(par.shared_experts, n).weight, getattr(ref.shared_experts, n).weight)
                 for n in ("gate_proj", "up_proj", "down_proj")]
    for name, p, q in repl:
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=groups.ep_group)
        errs[name] = _rel(gsum, q.grad)
    counts = par.gate.tokens_per_expert.clone()
    dist.all_reduce(counts, group=groups.ep_group)
    errs["counts"] = float((counts - ref.gate.tokens_per_expert).abs().max())
    c = torch.tensor([par.dispatch_counters["routed_rows"], par.dispatch_counters["processed_rows"]])
    dist.all_reduce(c, group=groups.ep_group)
    errs["dropped"] = float(c[0] - c[1])
    errs["cross_per_token_over_M"] = par.last_dispatch.cross_node_per_token - (M if dedup else cfg.top_k)
    return errs


def _model_level(ep, rpn):
    """Whole tiny model (MoE layers incl. the MTP block's) with expert_parallel: same loss and logits as EP=1,
    dense-parameter gradients equal after summing over the EP group."""
    from dsv3_plugin.config import load_config
    from dsv3_plugin.model import DSv3Model
    from dsv3_plugin.moe_parallel import expert_parallel
    rank = dist.get_rank()
    groups = build_ep_groups(ep, rpn)
    cfg = load_config({"preset": "tiny", "parallel": {"ep": ep}, "moe": {"ranks_per_node": rpn}})
    ref = DSv3Model(cfg)
    ref.reset_parameters(seed=5)
    par = DSv3Model(cfg)
    par.load_state_dict(ref.state_dict())
    expert_parallel(par, groups)
    ref_loss = {}
    for r in groups.ep_ranks:
        ids = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(70 + r))
        out = ref(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        ref_loss[r] = (float(out.loss.detach()), out.logits.detach())
    ids = torch.randint(0, cfg.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(70 + rank))
    out = par(ids[:, :-1], labels=ids[:, 1:])
    out.loss.backward()
    g = par.embed_tokens.weight.grad.clone()
    dist.all_reduce(g, group=groups.ep_group)
    return {"loss": abs(float(out.loss.detach()) - ref_loss[rank][0]),
            "logits": float((out.logits.detach() - ref_loss[rank][1]).abs().max()),
            "embed_grad": _rel(g, ref.embed_tokens.weight.grad)}


def _run(layouts):
    init_distributed()
    out = [(("model", 4, 2), _model_level(4, 2))]
    for ep, rpn in layouts:
        for shared in (1, 0):
            for M, dedup in ((2, True), (2, False), (4, True)):  # M=4 of 4 groups: no node limit
                out.append(((ep, rpn, shared, M, dedup), _one(ep, rpn, shared, M, dedup)))
    return out


def _check(results):
    for rank_res in results:
        for key, e in rank_res:
            if key[0] == "model":
                assert e["loss"] <= 1e-6 and e["logits"] <= 1e-5 and e["embed_grad"] <= 1e-5, e
                continue
            assert e["out"] <= 1e-6, (key, e)
            for n, v in e.items():
                if n not in ("out", "counts", "dropped", "cross_per_token_over_M"):
                    assert v <= 1e-5, (key, n, e)
            assert e["counts"] == 0 and e["dropped"] == 0, (key, e)
            assert e["cross_per_token_over_M"] <= 0, (key, e)


def test_ep4_and_ep2xdp2_equal_ep1():
    _check(run_ranks(_run, 4, [(4, 1), (4, 2), (2, 1)]))
