"""Reading a JSON file someone else wrote: every way it can be malformed is one clear error naming the file.

`json.load` alone turns hostile-but-realistic files into tracebacks or silent surprises: a non-UTF-8 file, 10 000
nested brackets (`RecursionError`), `NaN` / `Infinity` / `1e400` accepted as non-finite floats, a key given twice
silently keeping the last value, an integer of 5 000 digits. `read_json` refuses each of these with `error_cls` (a
`ConfigError` for configs), non-finite numbers reported with the dotted path of their key.

NOTE: a UTF-8 BOM is accepted and skipped (RFC 8259 §8.1 lets parsers ignore it; Notepad writes one); any other
encoding is refused with its name.

Design notes: docs/design_notes.md#json-input
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

__all__ = [
    "read_json",
    "loads_checked",
    "check_tree",
    "finite_float",
    "no_constant",
    "NonFiniteNumber",
    "MAX_DEPTH",
    "MAX_BYTES",
]

MAX_DEPTH = 64  # a DeepSpeed / HF config is nested < 6 levels deep
MAX_BYTES = 64 * 1024**2  # the largest legitimate input (a 671B model's safetensors index) is ~10 MB
_MAX_INT_DIGITS = 4000  # below CPython's int-parsing limit (4300 digits), which raises a bare ValueError


class NonFiniteNumber(ValueError):
    """A JSON number that is not a finite 64-bit float: `NaN`, `Infinity`, `-Infinity` (not JSON at all), or a
    literal that overflows to inf (`1e400`), which would be written back as `Infinity`. `literal` is the text."""

    def __init__(self, literal: str, overflow: bool):
        self.literal = literal
        super().__init__(
            f"the number {literal} overflows a 64-bit float" if overflow else f"{literal} is not valid JSON"
        )


def finite_float(literal: str) -> float:
    """`parse_float` for `json.loads`: the literal as a float, or `NonFiniteNumber` when it overflows to inf.

    Args:
        literal: the number's text.

    Returns:
        The float.
    """
    f = float(literal)
    if not math.isfinite(f):
        raise NonFiniteNumber(literal, overflow=True)
    return f


def no_constant(name: str) -> float:
    """`parse_constant` for `json.loads`: `NaN`, `Infinity` and `-Infinity` are refused (`NonFiniteNumber`).

    Args:
        name: the constant's text.

    Returns:
        Never.
    """
    raise NonFiniteNumber(name, overflow=False)


def _fmt_path(path: tuple) -> str:
    return ".".join(str(p) for p in path) if path else "(top level)"


def check_tree(
    obj: Any,
    where: str,
    error_cls: type = ValueError,
    overflowed: list | None = None,
    max_depth: int = MAX_DEPTH,
    prefix: tuple = (),
) -> None:
    """Refuse non-finite floats (naming their dotted path) and nesting deeper than `max_depth`, iteratively
    (no recursion, so a hostile depth cannot crash the check itself). `overflowed` holds the literals that
    the parser turned into inf, in document order (dicts keep insertion order, so the walk meets them in the
    same order)."""
    stack = [(prefix, obj, len(prefix))]
    pending = list(overflowed or [])
    while stack:
        path, x, depth = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            lit = pending.pop(0) if pending else repr(x)
            raise error_cls(f"{_fmt_path(path)}: must be a finite number (got {lit})")
        if isinstance(x, (dict, list)):
            if depth >= max_depth:
                raise error_cls(f"{where}: nested deeper than {max_depth} levels (at {_fmt_path(path[:8])}...)")
            items = x.items() if isinstance(x, dict) else enumerate(x)
            # reversed, so that the stack pops them in document order (matches `overflowed`)
            for k, v in reversed(list(items)):
                stack.append((path + (k,), v, depth + 1))


def loads_checked(text: str, where: str, error_cls: type = ValueError, max_depth: int = MAX_DEPTH) -> Any:
    """`json.loads` with the refusals listed in the module docstring (`where` names the source)."""
    overflowed: list[str] = []

    def parse_float(s: str) -> float:
        f = float(s)
        if not math.isfinite(f):
            overflowed.append(f"{s}, which overflows a 64-bit float")
        return f

    def parse_constant(s: str) -> float:  # NaN, Infinity, -Infinity
        overflowed.append(s)
        return float(s.replace("Infinity", "inf"))

    def parse_int(s: str) -> int:
        if len(s) > _MAX_INT_DIGITS:
            raise error_cls(f"{where}: an integer literal has {len(s)} digits (more than {_MAX_INT_DIGITS})")
        return int(s)

    def no_duplicates(pairs: list) -> dict:
        out = {}
        for k, v in pairs:
            if k in out:
                raise error_cls(f"{where}: key {k!r} appears twice in one object (JSON would keep only the last)")
            out[k] = v
        return out

    try:
        obj = json.loads(
            text,
            parse_float=parse_float,
            parse_constant=parse_constant,
            parse_int=parse_int,
            object_pairs_hook=no_duplicates,
        )
    except json.JSONDecodeError as e:
        raise error_cls(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise error_cls(f"{where}: nested deeper than {max_depth} levels") from None
    check_tree(obj, where, error_cls, overflowed, max_depth)
    return obj


def read_json(
    path: str | os.PathLike, error_cls: type = ValueError, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH
) -> Any:
    """Read and parse a UTF-8 JSON file (BOM accepted); every refusal is `error_cls("<path>: ...")`."""
    where = os.fspath(path)
    try:
        if os.path.isdir(where):
            raise error_cls(f"{where}: is a directory, not a JSON file")
        size = os.path.getsize(where)
        if size > max_bytes:
            raise error_cls(f"{where}: {size} bytes is too large for a JSON config (limit {max_bytes})")
        with open(where, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error_cls(f"{where}: file not found") from None
    except OSError as e:
        raise error_cls(f"{where}: cannot be read ({e.strerror or e})") from None
    enc = json.detect_encoding(raw)
    if enc not in ("utf-8", "utf-8-sig"):
        raise error_cls(f"{where}: is {enc.upper()}-encoded; save it as UTF-8 (JSON files must be UTF-8)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error_cls(
            f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8 (a latin-1 or other 8-bit encoding is not accepted)"
        ) from None
    return loads_checked(text, where, error_cls, max_depth)
