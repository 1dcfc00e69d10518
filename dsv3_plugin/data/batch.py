"""One micro-batch as every training path passes it: tokens, shifted labels, and what packing and padding need.

Packed windows (Megatron-LM's `--reset-position-ids --reset-attention-mask --eod-mask-loss`): several documents
share one row; `position_ids` restart at 0 where a document starts, attention does not cross a document start,
and the label of a document's last token (the next document's first token) is -100. Unpacked rows hold one
document, padded at the end: `token_mask` is False at padding, which is neither trained on (labels -100) nor
counted in the experts' loads (the bias update, MaxVio).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Batch", "IGNORE_INDEX", "document_ids"]

IGNORE_INDEX = -100  # a label that contributes nothing to the LM or MTP losses (torch's and Megatron's convention)


class Batch(NamedTuple):
    """One micro-batch.

    Attributes:
        input_ids: [B, T] int64.
        labels: [B, T] int64: `labels[:, t]` is the token after position t; IGNORE_INDEX where there is no loss
            (masked prompt tokens, a document's last token in a packed row, padding).
        position_ids: [B, T] int64, restarting at 0 at every document start; None: one document per row
            (positions 0..T-1, plain causal attention).
        token_mask: [B, T] bool, False at padding (not counted in the expert loads); None: no padding.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None

    def to(self, device) -> Batch:
        """The same batch on `device`."""
        return Batch(*(None if t is None else t.to(device) for t in self))

    @property
    def loss_tokens(self) -> int:
        """Positions whose label is trained on."""
        return int((self.labels != IGNORE_INDEX).sum())


def document_ids(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T] int64: the index of the document each position belongs to within its row (a new document
    starts wherever `position_ids` is 0, and at column 0)."""
    starts_BT = position_ids_BT == 0
    starts_BT[:, 0] = True
    return starts_BT.long().cumsum(dim=1) - 1
