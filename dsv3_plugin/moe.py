"""DeepSeekMoE FFN (paper eq. 12): h' = u + Σ_shared FFN_s(u) + Σ_routed g_i FFN_i(u).

Experts are SwiGLU, w2(silu(w1 x) ⊙ w3 x), with the released names gate_proj (w1), up_proj (w3),
down_proj (w2). Routed experts are stored stacked (`GroupedExperts`: [E, I, H] / [E, H, I]) so that the
computation is grouped: tokens are sorted by expert and each expert multiplies one contiguous slice, instead
of masking the whole batch per expert. No capacity factor and no token dropping (paper §2.1.2).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .balancing import seq_balance_loss
from .config import MoEConfig
from .router import Router

__all__ = ["DenseMLP", "GroupedExperts", "DeepSeekMoE", "grouped_swiglu"]


class DenseMLP(nn.Module):
    """SwiGLU MLP: the dense FFN of the first layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def grouped_swiglu(x_NH: torch.Tensor, counts: list[int], w1_EIH: torch.Tensor, w3_EIH: torch.Tensor,
                   w2_EHI: torch.Tensor) -> torch.Tensor:
    """SwiGLU per expert over rows already sorted by expert; `counts[e]` rows belong to expert e."""
    outs = []
    for e, x_e in enumerate(torch.split(x_NH, counts)):
        if counts[e] == 0:
            continue
        h = F.silu(x_e @ w1_EIH[e].t()) * (x_e @ w3_EIH[e].t())
        outs.append(h @ w2_EHI[e].t())
    if not outs:
        return x_NH.new_zeros(0, w2_EHI.shape[1])
    return torch.cat(outs)


class GroupedExperts(nn.Module):
    """The routed experts of one layer, stacked. Released per-expert keys
    `mlp.experts.{e}.{gate,up,down}_proj.weight` map to rows e of these tensors."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size))
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(p, std=0.006)

    def forward(self, x_TH: torch.Tensor, topk_idx_TK: torch.Tensor, gates_TK: torch.Tensor) -> torch.Tensor:
        T, K = topk_idx_TK.shape
        flat_idx = topk_idx_TK.reshape(-1)                      # [T*K] expert of each (token, slot)
        order = torch.argsort(flat_idx, stable=True)            # group the (token, slot) pairs by expert
        counts = torch.bincount(flat_idx, minlength=self.n_experts).tolist()
        token_of = order // K                                   # source token of each sorted row
        y_NH = grouped_swiglu(x_TH[token_of], counts, self.gate_proj, self.up_proj, self.down_proj)
        y_NH = y_NH * gates_TK.reshape(-1)[order, None].to(y_NH.dtype)
        out_TH = torch.zeros_like(x_TH)
        return out_TH.index_add_(0, token_of, y_NH.to(x_TH.dtype))


class DeepSeekMoE(nn.Module):
    """Router + routed experts + shared experts. After a forward in training, `aux_loss` holds the
    sequence-wise balance loss α·L_Bal (a tensor in the graph; 0-dim zero when α = 0)."""

    def __init__(self, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(hidden_size, cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, hidden_size, cfg.intermediate_size)
        self.shared_experts = (DenseMLP(hidden_size, cfg.intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts > 0 else None)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        B, T, H = x_BTH.shape
        x_TH = x_BTH.reshape(-1, H)
        r = self.gate(x_TH)
        if self.training and self.cfg.seq_aux_alpha > 0:
            self.aux_loss = seq_balance_loss(r.scores_TE.view(B, T, -1), self.cfg.top_k, self.cfg.seq_aux_alpha)
        else:
            self.aux_loss = None
        y_TH = self.experts(x_TH, r.topk_idx_TK, r.gates_TK)
        if self.shared_experts is not None:
            y_TH = y_TH + self.shared_experts(x_TH)
        return y_TH.view(B, T, H)
