"""Load balancing for DeepSeekMoE: the auxiliary-loss-free bias update and the sequence-wise balance loss.

Aux-loss-free (paper §2.1.2, Algorithm in §4.2), once per optimizer step, with load_i the tokens routed to expert i
over the whole global batch of the step (counts all-reduced over data and expert parallel ranks):
    b_i <- b_i + γ · sign(mean_load - load_i)
Sequence-wise balance loss (eqs. 17-20), per sequence of T real tokens:
    f_i = N_r/(K_r·T) · Σ_t 1[s_{i,t} ∈ TopK(s_t, K_r)]   (plain top-k: no bias, no groups)
    P_i = 1/T · Σ_t s_{i,t} / Σ_j s_{j,t}
    L_Bal = α Σ_i f_i P_i,  averaged over the sequences of the batch.

Design notes (when and over what the counts are taken, padding, packing): docs/design_notes.md#model-moe-balancing
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["seq_balance_loss", "update_expert_bias", "maxvio", "routers_of", "reset_counts"]


def seq_balance_loss(
    scores_BTE: torch.Tensor, top_k: int, alpha: float, token_mask_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """α Σ_i f_i P_i per sequence (eqs. 17-20), mean over the B sequences. scores are the unbiased sigmoids
    [B, T, E]; `token_mask_BT` [B, T] bool (False at padding): statistics over the real tokens only."""
    if token_mask_BT is not None:
        return _masked_seq_balance_loss(scores_BTE, top_k, alpha, token_mask_BT)
    B, T, E = scores_BTE.shape
    with torch.no_grad():
        plain_idx_BTK = scores_BTE.topk(top_k, dim=-1).indices
        hits_BE = torch.zeros(B, E, dtype=scores_BTE.dtype, device=scores_BTE.device)
        hits_BE.scatter_add_(
            1, plain_idx_BTK.reshape(B, -1), torch.ones_like(plain_idx_BTK.reshape(B, -1), dtype=scores_BTE.dtype)
        )
        f_BE = hits_BE * (E / (top_k * T))
    p_BE = (scores_BTE / scores_BTE.sum(dim=-1, keepdim=True)).mean(dim=1)
    return alpha * (f_BE * p_BE).sum(dim=-1).mean()


def _masked_seq_balance_loss(scores_BTE, top_k: int, alpha: float, token_mask_BT: torch.Tensor) -> torch.Tensor:
    B, T, E = scores_BTE.shape
    m_BT = token_mask_BT.to(scores_BTE.dtype)
    n_B = m_BT.sum(dim=1)  # real tokens per sequence
    has_B = n_B > 0
    n_B = n_B.clamp(min=1)
    with torch.no_grad():
        plain_idx_BTK = scores_BTE.topk(top_k, dim=-1).indices
        hits_BE = torch.zeros(B, E, dtype=scores_BTE.dtype, device=scores_BTE.device)
        w_BTK = m_BT[:, :, None].expand(plain_idx_BTK.shape)
        hits_BE.scatter_add_(1, plain_idx_BTK.reshape(B, -1), w_BTK.reshape(B, -1))
        f_BE = hits_BE * (E / top_k) / n_B[:, None]
    p_BE = ((scores_BTE / scores_BTE.sum(dim=-1, keepdim=True)) * m_BT[:, :, None]).sum(dim=1) / n_B[:, None]
    per_seq_B = (f_BE * p_BE).sum(dim=-1)
    return alpha * (per_seq_B * has_B).sum() / has_B.sum().clamp(min=1)


def maxvio(loads_E: torch.Tensor) -> float:
    """MaxVio = max_i load_i / mean load − 1 (paper §4.5.2); 0 for a perfectly balanced batch."""
    mean = loads_E.float().mean()
    return float(loads_E.float().max() / mean - 1) if mean > 0 else 0.0


def routers_of(model: nn.Module) -> list[nn.Module]:
    """Every module holding an aux-loss-free bias, in module order (stable across ranks)."""
    return [m for m in model.modules() if hasattr(m, "e_score_correction_bias") and hasattr(m, "tokens_per_expert")]


def reset_counts(model: nn.Module) -> None:
    for r in routers_of(model):
        r.tokens_per_expert.zero_()


@torch.no_grad()
def update_expert_bias(
    model: nn.Module | Iterable[nn.Module],
    gamma: float,
    group: dist.ProcessGroup | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[dict]:
    """Apply b <- b + γ·sign(mean − load) once, from the counts summed since the last call.

    Counts of all routers are stacked and all-reduced in one collective over `group` (default: the world
    when torch.distributed is initialized). `reduce(counts_LE) -> counts_LE`, when given, replaces that
    all-reduce (e.g. DualPipe: the data-parallel group, then the mirror rank holding the same layers).
    Returns per-router stats: `loads` (list), `maxvio`.
    """
    routers = routers_of(model) if isinstance(model, nn.Module) else list(model)
    if not routers:
        return []
    counts_LE = torch.stack([r.tokens_per_expert.float() for r in routers])  # [L, E]
    if reduce is not None:
        counts_LE = reduce(counts_LE)
    elif dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts_LE, op=dist.ReduceOp.SUM, group=group)
    stats = []
    for r, load_E in zip(routers, counts_LE):
        if gamma:
            delta = torch.sign(load_E.mean() - load_E) * gamma
            # In place on the fp32 buffer: an out-of-place update is lost by modules holding references
            # (torchtitan#1222 saved zeros); the buffer stays fp32 (Megatron-LM#1482).
            r.e_score_correction_bias.add_(delta.to(r.e_score_correction_bias.dtype))
        r.tokens_per_expert.zero_()
        stats.append({"loads": load_E.tolist(), "maxvio": maxvio(load_E)})
    return stats
