"""Expert-parallel DeepSeekMoE (paper §3.1-3.2: experts sharded over an EP group, all-to-all dispatch/combine).

`ExpertParallelMoE` is a `DeepSeekMoE` whose `experts` hold only this rank's E/P routed experts (expert e on EP
rank e // (E/P)); the router and the shared experts are replicated (shared experts run on the rank's own tokens,
paper eq. 12). Node-limited routing is the router's group limit: with `moe.n_group` a multiple of the EP nodes
(blocks of `moe.ranks_per_node` ranks) a token selected from at most `topk_group` = M groups touches at most M
nodes. Routed outputs go through `dispatch.moe_dispatch_combine`, whose asynchronous all-to-alls run while the
shared experts compute (§3.2.1).

NOTE: with `moe.n_group = 1` there is no node limit; configure `n_group` = number of nodes (or a multiple) and
`topk_group` = M to get the paper's node-limited routing.
Design notes: docs/design_notes.md#parallel-expert-parallel
"""

from __future__ import annotations

import torch
from torch import nn

from dsv3_plugin.config import ConfigError, MoEConfig
from dsv3_plugin.model.kernels import ExpertKernel
from dsv3_plugin.model.moe.layer import DeepSeekMoE, DenseMLP, GroupedExperts
from dsv3_plugin.model.moe.router import Router, counting_enabled
from dsv3_plugin.parallel.dispatch import DispatchCodec, moe_dispatch_combine
from dsv3_plugin.parallel.groups import EPGroups

__all__ = ["ExpertParallelMoE", "expert_parallel", "COUNTER_KEYS", "check_node_limit_config"]

COUNTER_KEYS = ("tokens", "routed_rows", "processed_rows", "cross_node_copies", "cross_node_bytes", "copies")


def check_node_limit_config(cfg: MoEConfig, groups: EPGroups) -> None:
    """Groups must not straddle nodes, or the group limit would not bound the nodes a token uses."""
    nodes = groups.num_nodes
    if nodes > 1 and cfg.n_group > 1 and cfg.n_group % nodes:
        raise ConfigError(
            f"dsv3.moe.n_group: must be a multiple of the EP nodes for node-limited routing "
            f"(got {cfg.n_group} groups over {nodes} nodes)"
        )


class ExpertParallelMoE(DeepSeekMoE):
    """DeepSeekMoE with routed experts sharded over `groups.ep_group` (EP rank j owns experts
    [j·E/P, (j+1)·E/P)). Parameter names are DeepSeekMoE's; `experts.*` hold the local slab only."""

    def __init__(
        self,
        hidden_size: int,
        cfg: MoEConfig,
        groups: EPGroups,
        dedup: bool | None = None,
        codec: DispatchCodec | None = None,
        kernel: ExpertKernel | None = None,
    ):
        nn.Module.__init__(self)  # not DeepSeekMoE.__init__: it would allocate all E experts on every rank
        check_node_limit_config(cfg, groups)
        self.cfg = cfg
        self.groups = groups
        self.dedup = cfg.dedup_dispatch if dedup is None else dedup
        self.codec = codec
        self.local_experts = groups.local_expert_range(cfg.n_routed_experts)
        self.gate = Router(hidden_size, cfg)
        self.experts = GroupedExperts(len(self.local_experts), hidden_size, cfg.intermediate_size, kernel)
        self.shared_experts = (
            DenseMLP(hidden_size, cfg.intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        )
        self.aux_loss: torch.Tensor | None = None
        self.dispatch_counters = dict.fromkeys(COUNTER_KEYS, 0)

    @classmethod
    @torch.no_grad()
    def from_dense(
        cls,
        moe: DeepSeekMoE,
        groups: EPGroups,
        dedup: bool | None = None,
        codec: DispatchCodec | None = None,
        share: bool = False,
    ) -> ExpertParallelMoE:
        """Shard a full DeepSeekMoE, keeping this rank's experts. `share=False` copies router, bias and shared
        experts (the source stays usable, e.g. as a reference); `share=True` takes over the source's router
        and shared-expert modules themselves, whatever their class (FP8 linears, a Megatron router). The local
        experts run the source experts' kernel (precision, W deferral: the one expert-kernel seam)."""
        hidden = moe.gate.weight.shape[1]
        w = moe.experts.gate_proj
        # the model's dtype (the Router keeps itself fp32 whatever .to() it gets)
        ep = cls(hidden, moe.cfg, groups, dedup, codec, kernel=moe.experts.kernel)
        ep = ep.to(device=w.device, dtype=w.dtype)
        if share:
            ep.gate = moe.gate
            ep.shared_experts = moe.shared_experts
        else:
            ep.gate.load_state_dict(moe.gate.state_dict())
            ep.gate.tokens_per_expert.copy_(moe.gate.tokens_per_expert)
            if moe.shared_experts is not None:
                ep.shared_experts.load_state_dict(moe.shared_experts.state_dict())
        rows = getattr(moe.experts, "expert_range", None)
        # frozen experts holding every expert at ep = 1 (a LoRA base: FP8 bytes and their block scales, which a copy
        # into fresh parameters would drop): taken over as they are, as `share` takes over the router
        frozen_all = (
            share
            and rows is None
            and moe.experts.gate_proj.shape[0] == len(ep.local_experts)
            and not any(p.requires_grad for p in moe.experts.parameters())
        )
        if rows == ep.local_experts or frozen_all:
            # already this rank's slab (a rank-local build, `training.rank_local`, or all experts, frozen)
            ep.experts = moe.experts
            ep.train(moe.training)
            return ep
        sl = slice(ep.local_experts.start, ep.local_experts.stop)
        for name in ("gate_proj", "up_proj", "down_proj"):
            src = getattr(moe.experts, name)
            dst = getattr(ep.experts, name)
            dst.data = src[sl].detach().clone()
        ep.train(moe.training)
        return ep

    def _expert_fn(
        self, x_NH: torch.Tensor, local_expert_N: torch.Tensor, scale_N: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.training and counting_enabled():
            self.dispatch_counters["processed_rows"] += int(x_NH.shape[0])
        return self.experts.expert_rows(x_NH, local_expert_N, scale_N)

    def routed(self, x_TH: torch.Tensor, r, side=None) -> torch.Tensor:
        # `side` (the shared experts) runs while the dispatched tokens travel (async all-to-all, §3.2.1)
        y_TH, st = moe_dispatch_combine(
            x_TH,
            r.topk_idx_TK,
            r.gates_TK,
            self._expert_fn,
            self.cfg.n_routed_experts,
            self.groups,
            self.dedup,
            self.codec,
            weights_to_experts=True,
            while_dispatching=side,
        )
        self.last_dispatch = st
        if self.training and counting_enabled():
            c = self.dispatch_counters
            c["tokens"] += st.tokens
            c["routed_rows"] += int(r.topk_idx_TK.numel())
            c["cross_node_copies"] += st.cross_node_copies
            c["cross_node_bytes"] += st.cross_node_bytes
            c["copies"] += st.copies
        return y_TH

    def reset_dispatch_counters(self) -> None:
        self.dispatch_counters = dict.fromkeys(COUNTER_KEYS, 0)


def expert_parallel(
    model: nn.Module, groups: EPGroups, dedup: bool | None = None, codec: DispatchCodec | None = None
) -> nn.Module:
    """Replace every (non-parallel) DeepSeekMoE in `model` by its expert-parallel shard, in place."""
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, DeepSeekMoE) and not isinstance(mod, ExpertParallelMoE)
    ]
    for name, mod in targets:
        ep = ExpertParallelMoE.from_dense(mod, groups, dedup, codec, share=True)
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, name.rsplit(".", 1)[-1], ep)
    return model
