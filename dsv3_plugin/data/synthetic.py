"""Synthetic training data: a seeded sparse Markov chain with Zipf-skewed token popularity.

`dsv3 train` needs data that (1) a tiny model can learn within tens of steps, so "loss falls clearly" is a
real signal, (2) skews the router (a few tokens dominate, so some experts are overloaded at init and the
aux-loss-free bias update has something to fix) and (3) makes the MTP objective learnable: the token two
positions ahead depends on the current one through the chain's two-step transition.

Batches are a pure function of (seed, step, micro-batch, rank): no iterator state, so the data position of a
checkpoint is just the next step index, and a resumed run sees exactly the batches an uninterrupted run sees.

Design notes: docs/design_notes.md#data-synthetic
"""

from __future__ import annotations

import hashlib
import math

import torch

__all__ = ["MarkovData", "batch_seed"]


def batch_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """A 63-bit generator seed for one micro-batch; distinct for every (seed, step, micro, rank)."""
    h = hashlib.blake2b(f"dsv3-data/{seed}/{step}/{micro}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


class MarkovData:
    """Deterministic synthetic token stream; see the module docstring for the construction."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 1234, branching: int = 4, zipf_a: float = 1.1):
        if vocab_size < branching + 1:
            raise ValueError(f"vocab_size must exceed branching (got {vocab_size} <= {branching})")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (got {seq_len})")
        self.vocab_size, self.seq_len, self.seed, self.branching = vocab_size, seq_len, seed, branching
        g = torch.Generator().manual_seed(seed)
        rank_of_token = torch.randperm(vocab_size, generator=g)
        pop_V = (rank_of_token.double() + 1.0).pow(-zipf_a)
        self.popularity_V = (pop_V / pop_V.sum()).float()  # [V]
        # Successor table [V, K]: distinct successors per token, drawn by popularity.
        self.successors_VK = torch.multinomial(
            self.popularity_V.expand(vocab_size, -1), branching, replacement=False, generator=g
        )
        q_K = 1.0 / (torch.arange(branching, dtype=torch.float64) + 1.0) ** 2
        self.branch_probs_K = (q_K / q_K.sum()).float()  # [K]

    @property
    def entropy_rate(self) -> float:
        """H(q) in nats: the best achievable mean next-token loss (after the first position)."""
        q = self.branch_probs_K.double()
        return float(-(q * q.log()).sum())

    @property
    def description(self) -> str:
        """What the run summary says this data is: never a user's data."""
        return 'synthetic Markov chain (dsv3.train.data = "synthetic"; no tokenizer or dataset was read)'

    @property
    def uniform_loss(self) -> float:
        return math.log(self.vocab_size)

    def batch(
        self, step: int, micro: int, rank: int, batch_size: int, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T], labels [B, T]) with labels[b, i] = token i+1 (already shifted)."""
        g = torch.Generator().manual_seed(batch_seed(self.seed, step, micro, rank))
        B, T = batch_size, self.seq_len
        seq_BT1 = torch.empty(B, T + 1, dtype=torch.long)
        seq_BT1[:, 0] = torch.multinomial(self.popularity_V, B, replacement=True, generator=g)
        slots_BT = torch.multinomial(self.branch_probs_K, B * T, replacement=True, generator=g).view(B, T)
        for t in range(T):
            seq_BT1[:, t + 1] = self.successors_VK[seq_BT1[:, t], slots_BT[:, t]]
        seq_BT1 = seq_BT1.to(device)
        return seq_BT1[:, :-1].contiguous(), seq_BT1[:, 1:].contiguous()
