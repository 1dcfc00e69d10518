"""Reading a fine-tuning corpus: the records of `.jsonl`, `.txt`, `.parquet`, `.json` and `.arrow` files, in file
order, one at a time (the corpus is never held), each tagged with where it came from.

`parse_record` turns a record into the text or the validated conversation, or a skip reason; every bad input is
a `DataError` naming the file and line (or row).

Public API: `SUFFIXES`, `Record`, `check_inputs`, `iter_records`, `parse_record`.

Design notes: docs/design_notes.md#data-sources
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from typing import NamedTuple

from dsv3_plugin.data.chat import check_messages
from dsv3_plugin.errors import DataError

__all__ = ["SUFFIXES", "Record", "check_inputs", "iter_records", "parse_record"]

# file suffix -> how it is read ("jsonl", "txt", or the `datasets` packaged builder's name)
SUFFIXES = {".jsonl": "jsonl", ".txt": "txt", ".parquet": "parquet", ".json": "json", ".arrow": "arrow"}


class Record(NamedTuple):
    """One input record before decoding.

    Attributes:
        where: `file:line` (jsonl), `file` (txt) or `file:row N` (datasets loaders, 1-based): for error messages.
        kind: "jsonl" (`raw` is one line's bytes), "txt" (`raw` is the file's bytes) or "row" (`row` is a dict).
        raw: undecoded bytes, or None.
        row: a row from a `datasets` loader, or None.
    """

    where: str
    kind: str
    raw: bytes | None = None
    row: dict | None = None


def check_inputs(paths) -> list[str]:
    """The input paths, checked before anything is read or written.

    Raises:
        DataError: no inputs, a missing path or a directory, or an unsupported suffix (the message names the path).
    """
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("no input files given")
    for p in paths:
        if not os.path.exists(p) or os.path.isdir(p):  # a named pipe is fine: it is read once, in order
            raise DataError(f"{p}: input file does not exist" if not os.path.exists(p) else f"{p}: is a directory")
        if os.path.splitext(p)[1].lower() not in SUFFIXES:
            raise DataError(f"{p}: unsupported input type (expected one of {', '.join(SUFFIXES)})")
    return paths


def iter_records(path: str) -> Iterator[Record]:
    """The records of one input file, in file order (see the module docstring for the formats).

    Args:
        path: a file accepted by `check_inputs`.

    Yields:
        `Record`s. Blank `.jsonl` lines are yielded too (as `raw` whitespace) so that they are counted as skipped.

    Raises:
        DataError: the `datasets` loader cannot read the file (the message names it).
    """
    kind = SUFFIXES[os.path.splitext(path)[1].lower()]
    if kind == "jsonl":
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                yield Record(f"{path}:{lineno}", "jsonl", raw=line)
    elif kind == "txt":
        with open(path, "rb") as f:
            yield Record(path, "txt", raw=f.read())
    else:
        yield from _datasets_rows(path, kind)


@contextlib.contextmanager
def _datasets_logs_off():
    """datasets logs a reader's failure before raising it; the DataError below carries the same message, and the
    CLI's error is one line."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _datasets_rows(path: str, builder: str) -> Iterator[Record]:
    import datasets

    try:
        with _datasets_logs_off():
            ds = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
            rows = iter(ds)
    except Exception as e:  # whatever the third-party loader raises for a file it cannot read
        raise DataError(f"{path}: datasets' {builder} loader cannot read it ({type(e).__name__}: {e})") from None
    n = 0
    while True:
        try:
            with _datasets_logs_off():
                row = next(rows)
        except StopIteration:
            return
        except Exception as e:
            raise DataError(
                f"{path}:row {n + 1}: datasets' {builder} loader failed ({type(e).__name__}: {e})"
            ) from None
        n += 1
        yield Record(f"{path}:row {n}", "row", row=row)


def _decode(raw: bytes, where: str, whole_file: bool = False) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if whole_file:  # a .txt document: name the line that holds the bad byte
            line = raw.count(b"\n", 0, e.start) + 1
            where = f"{where}:{line}"
        raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def parse_record(rec: Record, *, chat: bool, text_key: str = "text") -> tuple[str | list | None, str | None]:
    """Decode and validate one record.

    Args:
        rec: from `iter_records`.
        chat: read `"messages"` (a conversation) instead of `text_key`.
        text_key: the text field of `.jsonl` / datasets rows (ignored for `.txt`).

    Returns:
        `(payload, None)` with the text (str) or the conversation (list of message dicts), or `(None, reason)`
        for a record that is skipped: "blank_line" (an empty `.jsonl` line), "empty_text" (empty or whitespace
        only), "no_assistant_turn" (a conversation without an assistant message).

    Raises:
        DataError: not UTF-8, malformed JSON, not a JSON object, a missing key, a text that is not a string, or a
            bad conversation (`check_messages`); the message names `rec.where`.
    """
    if rec.kind == "txt":
        if chat:
            raise DataError(
                f"{rec.where}: a .txt file is one plain-text document; --chat reads .jsonl/.parquet/.json/.arrow"
            )
        obj = {text_key: _decode(rec.raw, rec.where, whole_file=True)}
    elif rec.kind == "jsonl":
        line = _decode(rec.raw, rec.where)
        if not line.strip():
            return None, "blank_line"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{rec.where}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{rec.where}: expected a JSON object per line (got {type(obj).__name__})")
    else:
        obj = rec.row
    if chat:
        if "messages" not in obj:
            raise DataError(f"{rec.where}: no 'messages' key (chat data: {{\"messages\": [{{role, content}}, ...]}})")
        messages = check_messages(obj["messages"], rec.where)
        if not any(m["role"] == "assistant" for m in messages):
            return None, "no_assistant_turn"
        return messages, None
    if text_key not in obj:
        raise DataError(f"{rec.where}: no '{text_key}' key (choose the text field with --text-key)")
    text = obj[text_key]
    if not isinstance(text, str):
        raise DataError(f"{rec.where}: '{text_key}' must be a string (got {type(text).__name__})")
    if not text.strip():
        return None, "empty_text"
    return text, None
