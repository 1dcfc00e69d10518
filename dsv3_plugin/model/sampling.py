"""The next token from one row of logits: greedy (argmax), or sampled at a temperature from the nucleus (top-p).

Nucleus sampling is Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR 2020), §3.1: keep the
smallest set of most likely tokens whose probability mass reaches p, renormalise, sample. Temperature T divides
the logits before the softmax (T -> 0 tends to greedy; T = 0 is taken to mean greedy exactly).

Randomness comes only from the caller's `torch.Generator`, so a seed fixes the sampled text (on one device and
torch build). `vocab_limit` restricts the choice to the first ids: a checkpoint's embedding may have more rows
than its tokenizer has entries (DeepSeek-V3: 129,280 rows, ~128.8k entries), and those extra ids have no text.

Public API: `check_sampling`, `choose_next`.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_sampling", "choose_next"]


def check_sampling(temperature: float, top_p: float) -> None:
    """Refuse sampling settings that have no meaning.

    Args:
        temperature: >= 0 and finite (0: greedy).
        top_p: in (0, 1] (1: the whole distribution).

    Raises:
        ValueError: naming the command-line flag (`--temperature` / `--top-p`) and the value.
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature: must be a finite number >= 0, 0 meaning greedy (got {temperature})")
    if not (0 < top_p <= 1):  # also refuses NaN
        raise ValueError(f"--top-p: must be in (0, 1] (got {top_p})")


def choose_next(
    logits_V: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    vocab_limit: int | None = None,
) -> int:
    """The next token id from the logits of one position.

    Args:
        logits_V: [V] logits (any float dtype; the softmax runs in float32).
        temperature: 0: argmax (the first index among equal maxima, as `torch.argmax`); > 0: sample from
            softmax(logits / temperature) restricted to the top-p nucleus.
        top_p: the nucleus' probability mass, in (0, 1]; the most likely token is always kept, so a tiny top_p
            gives the argmax.
        generator: the random source for sampling (on the logits' device); None: torch's global generator.
        vocab_limit: choose among ids [0, vocab_limit) only; None: all V.

    Returns:
        The chosen id, an int in [0, vocab_limit or V).
    """
    if vocab_limit is not None:
        logits_V = logits_V[:vocab_limit]
    if temperature == 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V.float() / temperature, dim=-1)
    # stable: among equal probabilities the lower id comes first, so the kept set (and a tiny top_p's choice)
    # agrees with argmax's first-index rule
    sorted_p, order = torch.sort(probs, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep = mass_before < top_p  # the smallest prefix whose mass reaches top_p (the first token always: 0 < p)
    kept = sorted_p[keep]
    pick = torch.multinomial(kept / kept.sum(), 1, generator=generator)
    return int(order[keep][pick])
