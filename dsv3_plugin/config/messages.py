"""Error wording of the `"dsv3"` block: a pydantic error or a bad number as one line led by the dotted key
(`dsv3.moe.top_k: must be an integer (got "8", a string)`), and the JSON names of values."""

from __future__ import annotations

import json
from typing import Any

from dsv3_plugin.errors import ConfigError
from dsv3_plugin.json_input import check_tree

__all__ = ["MAX_INT", "check_numbers", "json_type", "value_with_type", "short_json", "pydantic_message"]

# NOTE: integers are bounded by 10^36, not int64: sizes beyond int64 are refused by the memory estimate
# (`training/memory_estimate.py`), which names the key and the bytes; this bound only keeps every product of sizes in
# that estimate within a double (10^36^4 << 1.8e308).
MAX_INT = 10**36


def _dsv3_key_path(loc: tuple) -> str:
    """pydantic's error location (("moe", "top_k")) as the key the user wrote ("dsv3.moe.top_k")."""
    if tuple(loc[:2]) == ("train", "data") and len(loc) > 2 and loc[2] in ("name", "object"):
        loc = (*loc[:2], *loc[3:])  # drop the union member's tag (see `_data_kind`)
    return ".".join(["dsv3", *(str(p) for p in loc)])


def json_type(x: Any) -> str:
    """The JSON name of a value's type (what the user wrote), for error messages."""
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, (int, float)):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, (list, tuple)):
        return "array"
    if isinstance(x, dict):
        return "object"
    return type(x).__name__


def value_with_type(x: Any) -> str:
    """`"4", a string` / `[1], an array` / `null`: the offending value and its JSON type, for messages."""
    if x is None:
        return "null"
    t = json_type(x)
    return f"{short_json(x)}, {'an' if t[0] in 'aeiou' else 'a'} {t}"


def short_json(x: Any, limit: int = 60) -> str:
    """A short JSON-like rendering of an offending value (long inputs are cut)."""
    try:
        r = json.dumps(x)
    except (TypeError, ValueError):
        r = repr(x)
    return r if len(r) <= limit else r[: limit - 3] + "..."


# pydantic error type -> our wording (the key path comes first, the offending value last)
_TYPE_WORDS = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "finite_number": "must be a finite number",
    "int_from_float": "must be an integer",
}


def pydantic_message(err: dict) -> str:
    where, kind, value = _dsv3_key_path(err["loc"]), err["type"], err.get("input")
    if kind == "missing":
        return f"{where}: required key is missing"
    if kind == "extra_forbidden":
        return f"{where}: unknown key (got {short_json(value)})"
    if kind in _TYPE_WORDS:
        return f"{where}: {_TYPE_WORDS[kind]} (got {value_with_type(value)})"
    ctx = err.get("ctx") or {}
    for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if kind.startswith(("greater_than", "less_than")) and key in ctx:
            return f"{where}: must be {op} {ctx[key]:.10g} (got {short_json(value)})"
    return f"{where}: {err['msg']} (got {short_json(value)})"


def check_numbers(obj: Any, prefix: tuple = ("dsv3",)) -> None:
    """No NaN/inf anywhere and no integer beyond +-10^36: `ConfigError` naming the dotted key. Runs before
    the schema so that the first error is about the key that is wrong."""
    check_tree(obj, ".".join(str(p) for p in prefix) or "the DeepSpeed config", ConfigError, prefix=prefix)
    stack = [(prefix, obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, int) and not isinstance(x, bool) and not -MAX_INT <= x <= MAX_INT:
            digits = len(str(abs(x)))
            raise ConfigError(
                f"{'.'.join(str(p) for p in path)}: must be within +-10^36 (got a {digits}-digit integer)"
            )
        if isinstance(x, dict):
            stack.extend((path + (k,), v) for k, v in x.items())
        elif isinstance(x, list):
            stack.extend((path + (i,), v) for i, v in enumerate(x))
