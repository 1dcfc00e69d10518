"""Chat conversations -> token ids and a loss mask over the assistant's tokens, with the tokenizer's own template.

Supervised fine-tuning (as Megatron-LM's SFT dataset and DeepSeek-V3's own SFT) trains only on what the assistant
says: its content and the end-of-turn token of its turn. The conversation is rendered by the tokenizer's
`chat_template` (never a re-implementation); assistant message i spans from the rendering of `messages[:i]` with
the generation prompt to the rendering of `messages[:i + 1]`, provided each rendering is a token prefix of the
next (checked; a template that is not prefix-stable is refused).

Mask convention: `mask[t] == 1` means token t is a training TARGET (the loss of predicting it from tokens < t counts).

Public API: `ROLES`, `check_messages`, `encode_chat`.
Design notes: docs/design_notes.md#data-chat
"""

from __future__ import annotations

from collections.abc import Mapping

from dsv3_plugin.errors import DataError

__all__ = ["ROLES", "check_messages", "encode_chat"]

ROLES = ("system", "user", "assistant")


def check_messages(messages, where: str) -> list[dict]:
    """Validate one conversation's `messages` (a list of `{"role": system|user|assistant, "content": str}`).

    Args:
        messages: the value of a record's `"messages"` key.
        where: `file:line` of the record, for the error message.

    Returns:
        `messages` itself (a list of dicts), unchanged.

    Raises:
        DataError: not a list, a message that is not an object, a missing role/content, an unknown role or a
            content that is not a string; the message names `where` and the message index.
    """
    if not isinstance(messages, list):
        raise DataError(
            f"{where}: 'messages' must be a list of {{role, content}} objects (got {type(messages).__name__})"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise DataError(
                f"{where}: messages[{i}] must be an object with 'role' and 'content' (got {type(m).__name__})"
            )
        for key in ("role", "content"):
            if key not in m:
                raise DataError(f"{where}: messages[{i}] has no '{key}' key")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}]: unknown role {m['role']!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}: messages[{i}] ({m['role']}): 'content' must be a string (got {type(m['content']).__name__})"
            )
    return messages


def _render(tokenizer, messages: list, generation_prompt: bool, where: str) -> list[int]:
    """Token ids of `messages` as the tokenizer's chat template renders them."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 errors and transformers' ValueErrors: the template, not our code, refused
        raise DataError(f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {e})") from None
    # transformers 5 returns a BatchEncoding (a Mapping); older versions a plain list of ids
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(t) for t in ids]


def encode_chat(tokenizer, messages: list, where: str) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and the mask of its assistant tokens.

    Args:
        tokenizer: a transformers tokenizer with a `chat_template` (`dsv3_plugin.data.tokenizer.load_tokenizer`).
        messages: a validated conversation (`check_messages`).
        where: `file:line` of the record, for error messages.

    Returns:
        `(ids, mask)`, two lists of length T: `ids` is the template's full rendering (BOS included, as the template
        emits it); `mask[t] == 1` exactly for the tokens the template emits for an assistant turn after its
        generation prompt (the content and the end-of-turn token), 0 for system/user/template tokens. All zeros
        when there is no assistant turn.

    Raises:
        DataError: no chat template; an assistant turn first (the template cannot render the empty prefix that
            would mark its start); a template that does not render prefix-stably; the template failing.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat_template (needed for chat data)")
    full = _render(tokenizer, messages, False, where)
    mask = [0] * len(full)
    prev_end = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise DataError(
                f"{where}: messages[0] is an assistant turn: where it starts cannot be found (the chat template "
                f"renders no empty conversation); start the conversation with a system or user message"
            )
        start = _render(tokenizer, messages[:i], True, where)
        end = _render(tokenizer, messages[: i + 1], False, where)
        # Each rendering must be a token prefix of the next: otherwise token positions of the prefix do not
        # name the same tokens in the full conversation and the span would be wrong.
        if not (len(start) >= prev_end and end[: len(start)] == start and full[: len(end)] == end):
            raise DataError(
                f"{where}: the chat template does not render prefix-stably at messages[{i}] (the rendering of the "
                f"conversation up to this assistant turn is not a token prefix of the whole): cannot mask the "
                f"assistant tokens"
            )
        mask[len(start) : len(end)] = [1] * (len(end) - len(start))
        prev_end = len(end)
    return full, mask
