"""Decoding: greedy, plain or with MTP self-speculative decoding (paper §5.4.3: the depth-1 MTP module drafts
the token after next, the main model verifies it), or sampled (temperature, top-p: `model.sampling`) one token per
forward; optional stop ids (EOS) and streaming.

Speculative step, for s whose next token n = argmax P(. | s) is known: draft d = argmax of the MTP head at the
last position (eqs. 21-23, the one MTP block); one main forward over s + [n, d] gives v = argmax P(. | s, n) and,
if v == d, also the token after d. Accept d iff v == d. The output equals plain greedy decoding.
NOTE: no KV cache: every forward recomputes the whole prefix (both modes alike).

Public API: `generate`, `greedy_generate`, `mtp_draft`, `GenerationResult`.

Design notes: docs/design_notes.md#model-generate
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsv3_plugin.model.sampling import check_sampling, choose_next

__all__ = ["GenerationResult", "generate", "greedy_generate", "mtp_draft"]


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only (prompt excluded)
    forward_passes: int  # main-model forwards
    drafts: int = 0  # MTP drafts proposed
    accepted: int = 0  # drafts the main model confirmed
    accept_history: list[bool] = field(default_factory=list)
    stop: str = "length"  # "eos": a stop id was produced; "length": max_new_tokens reached

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafts if self.drafts else None

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(1, self.forward_passes)

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "forward_passes": self.forward_passes,
            "drafts": self.drafts,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_forward": self.tokens_per_forward,
            "stop": self.stop,
        }


@torch.no_grad()
def mtp_draft(
    model, seq_1T: torch.Tensor, hidden_1TH: torch.Tensor, next_token: int, vocab_limit: int | None = None
) -> int:
    """Depth-1 MTP guess for the token after `next_token`, given sequence `seq_1T` [1, T] and the main
    model's final-normed hidden states for it `hidden_1TH` [1, T, H]; the argmax over ids [0, vocab_limit)."""
    mtp = model.mtp[0]
    T = seq_1T.shape[1]
    nxt = torch.tensor([[next_token]], dtype=seq_1T.dtype, device=seq_1T.device)
    emb_1TH = model.embed_tokens(torch.cat([seq_1T[:, 1:], nxt], dim=1))  # Emb(t_{i+1}), i = 0..T-1
    cos, sin = model.rope(T, hidden_1TH.device, hidden_1TH.dtype)
    h_1TH = mtp(hidden_1TH, emb_1TH, cos, sin)
    logits_V = model.lm_head(mtp.norm(h_1TH[:, -1]))[0]
    return choose_next(logits_V, vocab_limit=vocab_limit)


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    speculative: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids: tuple[int, ...] | list[int] = (),
    vocab_limit: int | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> GenerationResult:
    """Decode up to `max_new_tokens` tokens after `prompt_ids` (batch of one), greedy or sampled.

    Args:
        model: a `DSv3Model` (its MTP module is needed for `speculative="mtp"`).
        prompt_ids: the prompt's token ids (at least one).
        max_new_tokens: the most tokens to produce.
        speculative: "mtp": draft with the depth-1 MTP module, verify with the main model (greedy only; the
            output equals plain greedy decoding). None: one main forward per token.
        temperature: 0: greedy; > 0: sample (`sampling.choose_next`) without speculation.
        top_p: the nucleus mass when sampling, in (0, 1].
        generator: the random source when sampling (on the model's device).
        stop_ids: stop after producing any of these (e.g. the tokenizer's EOS); it is kept in `tokens`, as
            transformers' `generate` keeps it.
        vocab_limit: produce only ids [0, vocab_limit) (the tokenizer's entries); None: all `vocab_size` rows.
        on_tokens: called with `[token]` for each new token as soon as the main model has confirmed it, for
            streaming.

    Returns:
        A `GenerationResult`: `tokens` (generated only), forward and draft counts, `stop` ("eos" or "length").

    Raises:
        ValueError: an empty prompt, a prompt id outside the vocabulary, a prompt plus `max_new_tokens` longer
            than the model's `max_position_embeddings`, bad sampling settings, speculation with sampling, or a
            model without MTP for `speculative="mtp"` (each message names the flag).
    """
    if speculative not in (None, "mtp"):
        raise ValueError(f"--speculative {speculative!r}: only 'mtp' is supported")
    if speculative == "mtp" and len(getattr(model, "mtp", [])) == 0:
        raise ValueError("--speculative mtp: the model has no MTP module (num_nextn_predict_layers = 0)")
    check_sampling(temperature, top_p)
    if speculative == "mtp" and temperature > 0:
        raise ValueError(
            "--speculative mtp: greedy decoding only (--temperature 0); sampling decodes one token per forward"
        )
    if not prompt_ids:
        raise ValueError("the prompt is empty: need at least one token")
    V = model.lm_head.weight.shape[0]
    bad = [t for t in prompt_ids if not 0 <= t < V]
    if bad:
        raise ValueError(f"--prompt-ids: token {bad[0]} outside the vocabulary [0, {V})")
    if vocab_limit is not None and not 0 < vocab_limit <= V:
        raise ValueError(f"vocab_limit {vocab_limit}: must be in [1, {V}] (the model's vocab_size)")
    cfg = getattr(model, "cfg", None)
    max_pos = cfg.model.max_position_embeddings if cfg is not None else None
    if max_pos is not None and len(prompt_ids) + max_new_tokens > max_pos:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens}: the prompt's {len(prompt_ids)} tokens + {max_new_tokens} new "
            f"exceed max_position_embeddings {max_pos}"
        )
    model.eval()
    dev = model.lm_head.weight.device
    seq = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
    res = GenerationResult(tokens=[], forward_passes=0)
    if max_new_tokens <= 0:
        return res
    stops = set(stop_ids)

    def choose(logits_V: torch.Tensor) -> int:
        return choose_next(logits_V, temperature, top_p, generator, vocab_limit)

    def emit(tok: int) -> bool:
        """Record a confirmed token; True when decoding is over."""
        res.tokens.append(tok)
        if on_tokens is not None:
            on_tokens([tok])
        if tok in stops:
            res.stop = "eos"
            return True
        return len(res.tokens) >= max_new_tokens

    out = model(seq)
    res.forward_passes += 1
    nxt = choose(out.logits[0, -1])
    hidden = out.hidden
    while not emit(nxt):
        if speculative is None:
            seq = torch.cat([seq, seq.new_tensor([[nxt]])], dim=1)
            out = model(seq)
            res.forward_passes += 1
            nxt, hidden = choose(out.logits[0, -1]), out.hidden
            continue
        # the 4-argument call when no limit is set: callers may substitute mtp_draft (tests use an oracle)
        if vocab_limit is None:
            draft = mtp_draft(model, seq, hidden, nxt)
        else:
            draft = mtp_draft(model, seq, hidden, nxt, vocab_limit)
        cand = torch.cat([seq, seq.new_tensor([[nxt, draft]])], dim=1)
        out = model(cand)
        res.forward_passes += 1
        res.drafts += 1
        verified = choose(out.logits[0, -2])
        ok = verified == draft
        res.accept_history.append(ok)
        if ok:
            res.accepted += 1
            if emit(draft):
                break
            seq, hidden = cand, out.hidden
            nxt = choose(out.logits[0, -1])
        else:
            seq, hidden = cand[:, :-1], out.hidden[:, :-1]
            nxt = verified
    return res


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, speculative: str | None = None
) -> GenerationResult:
    """Greedy decoding of `max_new_tokens` tokens after `prompt_ids` (batch of one); `speculative="mtp"`
    drafts with the depth-1 MTP module and verifies with the main model (same output). `generate` with its
    defaults: no stop token, the whole vocabulary."""
    return generate(model, prompt_ids, max_new_tokens, speculative=speculative)
