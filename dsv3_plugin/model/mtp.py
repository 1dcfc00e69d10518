"""Multi-Token Prediction (paper §2.2, eqs. 21-25): depth k (1..D) at position i combines the previous depth's
representation h^{k-1}_i with the embedding of token t_{i+k} and predicts t_{i+k+1}:

    h'^k_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])     (eq. 21)
    h^k    = TRM_k(h'^k_{1:T-k})                                   (eq. 22)
    P^k    = OutHead(shared_head.norm(h^k))                        (eq. 23)
    L^k    = CE(P^k, t_{k+2:T+1}) summed / T  (the *full* T)       (eq. 24)
    L_MTP  = λ/D Σ_k L^k                                           (eq. 25)

NOTE: the embedding half comes first in eh_proj's input, as the released weights are laid out (eq. 21 writes the
other order); h^0 is the main model's hidden state after the final RMSNorm; with masked labels eq. 24's T is the
number of the main model's loss tokens. Design notes: docs/design_notes.md#model-mtp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.model.norm import RMSNorm

__all__ = ["MTPLayer", "mtp_depth_loss"]


class MTPLayer(nn.Module):
    """Released names at `model.layers.{num_hidden_layers + k - 1}`: enorm, hnorm, eh_proj, the decoder block,
    shared_head.norm (here `norm`); shared_head.head / embed_tokens are the main model's."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer = layer
        self.norm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        h_prev_BSH: torch.Tensor,
        emb_BSH: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h_prev, emb: [B, S, H] aligned (S = T - k); cos/sin, attn_mask, token_mask [B, S]: the main model's
        restricted to the S rows (`packing.mtp_rows`). Returns h^k [B, S, H] (before `norm`)."""
        x = self.eh_proj(torch.cat([self.enorm(emb_BSH), self.hnorm(h_prev_BSH)], dim=-1))
        if attn_mask is None and token_mask is None:
            return self.layer(x, cos, sin)
        return self.layer(x, cos, sin, attn_mask, token_mask)


def mtp_depth_loss(
    logits_BSV: torch.Tensor,
    labels_BS: torch.Tensor,
    full_T: int,
    n_loss_tokens: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """L^k of eq. 24: token CE summed over the S = T - k predicted positions (labels -100 ignored), divided by
    B·T (full T) or, when given, by `n_loss_tokens` (the main model's loss tokens: module NOTE; at least 1)."""
    B = logits_BSV.shape[0]
    ce = F.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), labels_BS.reshape(-1), ignore_index=-100, reduction="sum"
    )
    if n_loss_tokens is None:
        return ce / (B * full_T)
    if torch.is_tensor(n_loss_tokens):
        return ce / n_loss_tokens.clamp(min=1)
    return ce / max(int(n_loss_tokens), 1)
