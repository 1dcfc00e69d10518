"""Packed documents and padding inside the model: per-row RoPE positions, the document-causal attention mask, the
MTP targets that stay inside a document, and the MTP modules' share of all of it.

Packed windows (Megatron-LM's `--reset-position-ids --reset-attention-mask --eod-mask-loss`): several documents
share one row of T tokens; `position_ids` [B, T] restart at 0 where a document starts. Then

- RoPE rotates each token by its position inside its document (cos/sin gathered per row, broadcast over heads);
- attention is causal AND block-diagonal by document: token i attends to j iff j <= i and doc(j) == doc(i);
- the MTP target at depth k of position i (token i+k+1, paper §2.2 eq. 24) is dropped when that token lies in
  another document than position i (the main target of a document's last token is already -100 in the labels).

Design notes: docs/design_notes.md#model-packing
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "document_ids",
    "document_causal_mask",
    "rope_tables",
    "mtp_labels",
    "mtp_rows",
    "lm_ce_sum",
    "lm_mean",
]

IGNORE_INDEX = -100  # labels that contribute nothing (torch's cross_entropy default, Megatron's SFT convention)


def document_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] int64: the index of each position's document within its row (a document starts wherever
    the position is 0, and at column 0)."""
    starts_BT = position_ids_BT == 0
    starts_BT[:, 0] = True
    return starts_BT.long().cumsum(dim=1) - 1


def document_causal_mask(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, 1, T, T] bool (True = may attend): causal and inside one document. Every row keeps its
    diagonal, so no softmax row is empty."""
    T = position_ids_BT.shape[1]
    doc_BT = document_ids(position_ids_BT)
    same_BTT = doc_BT[:, :, None] == doc_BT[:, None, :]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=position_ids_BT.device).tril()
    return (same_BTT & causal_TT).unsqueeze(1)


def rope_tables(rotary, T: int, position_ids_BT: torch.Tensor | None, device, dtype):
    """(cos, sin, attn_mask) for one forward. Without `position_ids`: the tables of positions 0..T-1, [T, d_R/2],
    and no mask (the plain causal path, `is_causal=True`). With them: [B, 1, T, d_R/2] tables (broadcast over
    heads in `rope.apply_rope`) and `document_causal_mask`."""
    if position_ids_BT is None:
        cos, sin = rotary(torch.arange(T, device=device), dtype)
        return cos, sin, None
    cos, sin = rotary(position_ids_BT, dtype)  # [B, T, d_R/2]
    return cos.unsqueeze(1), sin.unsqueeze(1), document_causal_mask(position_ids_BT)


def mtp_rows(cos, sin, attn_mask, token_mask_BT, k: int):
    """What MTP depth k (S = T - k rows; row i combines position i and token i+k) sees: the first S positions'
    tables and mask, and as its token mask the rows whose two inputs are both real tokens (a row reading a padded
    token at i+k is not counted in the loads, as a forward over the unpadded sequence would not have it)."""
    S = cos.shape[-2] - k
    cos, sin = cos[..., :S, :], sin[..., :S, :]
    if attn_mask is not None:
        attn_mask = attn_mask[..., :S, :S]
    if token_mask_BT is not None:
        token_mask_BT = token_mask_BT[:, :S] & token_mask_BT[:, k:]
    return cos, sin, attn_mask, token_mask_BT


def mtp_labels(labels_BT: torch.Tensor, k: int, position_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The targets of MTP depth k, [B, T-k]: row i predicts token i+k+1 = `labels[:, i+k]`; with `position_ids`,
    IGNORE_INDEX where that token is not in position i's document. Token T (past the window) belongs to position
    T-1's document when its label is given (the document goes on)."""
    lab_BS = labels_BT[:, k:]
    if position_ids_BT is None:
        return lab_BS
    S = lab_BS.shape[1]
    doc_BT = document_ids(position_ids_BT)
    doc_of_next_BT = torch.cat([doc_BT[:, 1:], doc_BT[:, -1:]], dim=1)  # document of token j+1 (label j)
    inside_BS = doc_BT[:, :S] == doc_of_next_BT[:, k:]
    return lab_BS.masked_fill(~inside_BS, IGNORE_INDEX)


def lm_ce_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """The LM cross-entropy summed over the loss tokens (labels != -100), in fp32, 0-dim: what an evaluation adds
    up over micro-batches and ranks before dividing by the total count of loss tokens."""
    V = logits_BTV.shape[-1]
    return F.cross_entropy(
        logits_BTV.reshape(-1, V).float(), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def lm_mean(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, n_loss_tokens: torch.Tensor) -> torch.Tensor:
    """The LM loss: token cross-entropy averaged over the loss tokens (fp32, 0-dim); 0 for a micro-batch without
    any (a window of prompt tokens only), where the plain mean is 0/0 = NaN (its gradient is zero either way).
    `n_loss_tokens`: (labels != -100).sum(), a tensor (no host sync)."""
    V = logits_BTV.shape[-1]
    mean = F.cross_entropy(logits_BTV.reshape(-1, V).float(), labels_BT.reshape(-1), ignore_index=IGNORE_INDEX)
    return torch.where(n_loss_tokens > 0, mean, torch.zeros_like(mean))
