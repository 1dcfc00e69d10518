"""A run's `metrics.jsonl`: one JSON line per logged step, written so that it reads back (`metrics_line`: strict
JSON, a non-finite float written as null) and read strictly (`read_jsonl`).

A crash in the middle of a write leaves a torn last line: it is dropped with a note. Anything else that is not a
metrics line is refused naming the file and the line: a torn line before the last, NaN / Infinity / a literal
that overflows to inf, a non-number where the plugin reads a number (plots, summaries, `--resume`), routing
telemetry (`moe_layers`) whose layers or expert counts change from line to line.
"""

from __future__ import annotations

import json
import math

from dsv3_plugin.errors import ConfigError
from dsv3_plugin.json_input import NonFiniteNumber, finite_float, no_constant

__all__ = ["read_jsonl", "metrics_line"]


# Keys of a metrics line the plugin reads back (plots, summaries, --resume): a number or null each.
_NUMBER_KEYS = (
    "loss",
    "lm_loss",
    "mtp_loss",
    "balance_loss",
    "maxvio",
    "maxvio_batch",
    "maxvio_global",
    "gamma",
    "lr",
    "grad_norm",
    "eval_loss",
    "tokens_per_s",
    "tokens_seen",
    "cross_node_per_token",
    "tokens_dropped",
)
_LAYER_NUMBER_KEYS = ("maxvio_batch", "maxvio_global", "cross_node_per_token", "tokens_dropped")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _row_problem(row, experts: dict) -> str | None:
    """Why `row` is not a metrics line (None: it is one). `experts`: {MoE layer: number of experts} of the lines
    before, filled here (every line's expert loads must have one length per layer, the same set of layers)."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"'step' must be an integer >= 0 (got {json.dumps(step)})" if "step" in row else "no 'step'"
    for k in _NUMBER_KEYS:
        if k in row and row[k] is not None and not _is_number(row[k]):
            return f"{k!r} must be a number or null (got {_short(row[k])})"
    if "maxvio_layers" in row and not (
        isinstance(row["maxvio_layers"], list) and all(_is_number(v) for v in row["maxvio_layers"])
    ):
        return "'maxvio_layers' must be a list of numbers"
    layers = row.get("moe_layers")
    if layers is None:
        return None
    if not isinstance(layers, dict) or not layers:
        return f"'moe_layers' must be an object of MoE layers (got {_short(layers)})"
    if experts and set(layers) != set(experts):
        return f"'moe_layers' names layers {sorted(layers)}, the lines before named {sorted(experts)}"
    for name, lay in layers.items():
        where = f"moe_layers[{name!r}]"
        if not isinstance(lay, dict):
            return f"{where} must be an object (got {_short(lay)})"
        loads = lay.get("loads")
        if not isinstance(loads, list) or not loads or not all(_is_number(v) and v >= 0 for v in loads):
            return f"{where}['loads'] must be a non-empty list of numbers >= 0 (got {_short(loads)})"
        if experts.setdefault(name, len(loads)) != len(loads):
            return f"{where}['loads'] has {len(loads)} experts, the lines before had {experts[name]}"
        for k in _LAYER_NUMBER_KEYS:
            if lay.get(k) is not None and not _is_number(lay[k]):
                return f"{where}[{k!r}] must be a number or null (got {_short(lay[k])})"
    return None


def _short(v) -> str:
    t = json.dumps(v)
    return t if len(t) <= 60 else t[:57] + "..."


def read_jsonl(path: str) -> tuple[list[dict], str | None]:
    """The lines of a metrics.jsonl, strictly: each must be a JSON object with an integer `step`, finite numbers
    only (no NaN / Infinity / overflowing literals), numbers (or null) where the plugin reads numbers, and
    `moe_layers` (routing telemetry) with the same layers and one expert count per layer on every line.

    Args:
        path: the file.

    Returns:
        (the rows, a note when its last line was torn — an interrupted write — and dropped; None otherwise; the
        caller decides whether to rewrite the file).

    Raises:
        ConfigError: "PATH:LINE: what is wrong" for the first bad line (a torn line before the last included).
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    lines = raw.split(b"\n")
    rows, torn, experts = [], None, {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = json.loads(line, parse_float=finite_float, parse_constant=no_constant)
        except NonFiniteNumber as e:
            raise ConfigError(
                f"{where}: {e.literal} is not a finite number; metrics lines hold finite numbers (null for none)"
            ) from None
        except RecursionError:
            raise ConfigError(f"{where}: nested too deeply to be a metrics line") from None
        except (ValueError, UnicodeDecodeError) as e:
            if any(x.strip() for x in lines[i + 1 :]):
                raise ConfigError(
                    f"{where}: not a JSON line ({e}); only a torn last line is dropped "
                    "automatically — remove or fix this one"
                ) from None
            torn = f"dropped a torn last line of {path} ({len(line)} bytes; the write was interrupted)"
            continue
        problem = _row_problem(row, experts)
        if problem:
            raise ConfigError(f"{where}: not a metrics line: {problem}")
        rows.append(row)
    return rows, torn


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def metrics_line(rec: dict) -> str:
    """`rec` as one metrics.jsonl line (no newline) that `read_jsonl` reads back: strict JSON, a non-finite float
    (a diverged loss, an overflowed gradient norm) written as null.

    Args:
        rec: the step's metrics.

    Returns:
        The JSON text.
    """
    return json.dumps(_json_safe(rec), allow_nan=False)
