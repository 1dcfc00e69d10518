"""Reading a DeepSpeed JSON with a `"dsv3"` block (`read_ds_json`, `load_config`) and the generated key reference
(`reference_table`, pasted into docs/configuration.md).

`load_config(path)` is the public one-liner (`build_model(load_config("ds.json"))`); a bare `"dsv3"` dict goes
through `DSv3Config.from_block`, and a whole run (DeepSpeed keys too) through
`dsv3_plugin.deepspeed.run_config.RunConfig`.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from dsv3_plugin.config.presets import PRESETS
from dsv3_plugin.config.schema import (
    DataConfig,
    DSv3Config,
    FP8Config,
    MemoryConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    ParallelConfig,
    RopeScaling,
    TrainConfig,
    check_numbers,
    value_with_type,
)
from dsv3_plugin.errors import ConfigError
from dsv3_plugin.json_input import read_json

__all__ = ["read_ds_json", "check_ds_dict", "load_config", "reference_table"]


def check_ds_dict(ds: dict) -> dict:
    """The checks a parsed DeepSpeed JSON gets (what `read_ds_json` applies to a file's contents): a "dsv3" block,
    nesting depth, finite numbers, integers within +-10^36.

    Returns:
        A copy the caller may change. Raises ConfigError naming the key.
    """
    if not isinstance(ds, dict):
        raise ConfigError(f"dsv3: a DeepSpeed config must be a path or a dict (got {type(ds).__name__})")
    if "dsv3" not in ds:
        raise ConfigError('dsv3: the DeepSpeed config has no "dsv3" block')
    check_numbers(ds, prefix=())  # iterative: a hostile depth is refused before deepcopy recurses
    return copy.deepcopy(ds)


def read_ds_json(path: str | os.PathLike) -> dict:
    """The one reader of a DeepSpeed JSON file with a "dsv3" block (`RunConfig.load`, `load_config`,
    `dsv3 memory-plan`).

    Args:
        path: the file, read by `dsv3_plugin.json_input.read_json` (a parsed dict goes to `check_ds_dict`).

    Returns:
        The whole DeepSpeed config (not only the block), a new dict.

    Raises:
        ConfigError: the file is not found, not UTF-8, not JSON, nested too deep, holds NaN/inf or duplicate
            keys, is not a JSON object, or has no "dsv3" block; `path` is not a path. The message names the file.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"dsv3: a DeepSpeed config must be a path or a dict (got {type(path).__name__})")
    where = os.fspath(path)
    raw = read_json(where, ConfigError)
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must hold a JSON object (got {value_with_type(raw)})")
    if "dsv3" not in raw:
        raise ConfigError(f'{where}: has no "dsv3" block')
    return raw


def load_config(path: str | os.PathLike) -> DSv3Config:
    """The validated `"dsv3"` block of a DeepSpeed JSON file (`build_model(load_config("ds.json"))`).

    Only the block is validated (its schema, presets and cross-field rules: `DSv3Config.from_block`); a run's
    DeepSpeed keys are `dsv3_plugin.deepspeed.run_config.RunConfig`'s.

    Args:
        path: a DeepSpeed JSON with a "dsv3" block, read by `read_ds_json`.

    Returns:
        The validated `DSv3Config`.

    Raises:
        ConfigError: unreadable file or not a path (a dict goes to `DSv3Config.from_block`), unknown key, wrong
            type, value out of range, unknown preset, or contradicting settings; the message starts with the key
            (e.g. `dsv3.moe.top_k: ...`) or the file.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(
            f'load_config: takes the path of a DeepSpeed JSON (got {type(path).__name__}; a "dsv3" block dict: '
            "DSv3Config.from_block)"
        )
    return DSv3Config.from_block(read_ds_json(path)["dsv3"])


def _type_words(annotation: Any) -> str:
    """A field's type as the reference table writes it (`one of ...`, `optional X`), `|` escaped for markdown."""
    ann = str(annotation).replace("typing.", "").replace("dsv3_plugin.config.schema.", "")
    if ann.startswith("<class"):
        ann = annotation.__name__
    if "Tag(tag=" in ann:  # the tagged union of train.data
        ann = "'synthetic' or object"
    if ann.startswith(("Literal[", "Optional[")):
        ann = ann.replace("Literal[", "one of ").replace("Optional[", "optional ")[:-1]
    if ann.endswith(" | None"):  # `X | None` reads as the table's "optional X"
        ann = "optional " + ann[: -len(" | None")]
    return ann.replace("|", "\\|")


def _range_words(f: Any) -> str:
    """A numeric field's bounds as an interval (`(0, 1000]`, `[1, 1024]`, `>= 0`), '' for other fields."""
    lo = hi = None
    for x in f.metadata:
        for attr, bracket in (("gt", "("), ("ge", "[")):
            if getattr(x, attr, None) is not None:
                lo = (bracket, getattr(x, attr))
        for attr, bracket in (("lt", ")"), ("le", "]")):
            if getattr(x, attr, None) is not None:
                hi = (bracket, getattr(x, attr))

    def num(v: float) -> str:
        return str(v) if isinstance(v, int) else f"{v:.10g}"

    if lo is None and hi is None:
        return ""
    if hi is None:
        return f"{'>' if lo[0] == '(' else '>='} {num(lo[1])}"
    if lo is None:
        return f"{'<' if hi[0] == ')' else '<='} {num(hi[1])}"
    return f"{lo[0]}{num(lo[1])}, {num(hi[1])}{hi[0]}"


def reference_table() -> str:
    """Markdown table of every `"dsv3"` key (type, allowed range, tiny default, meaning), generated from the
    schema (cross-field rules, e.g. `moe.top_k <= moe.n_routed_experts`, are not in the range column)."""
    tiny = DSv3Config.from_block({"preset": "tiny"}).to_dict()
    rows = [
        "| key | type | range | tiny | meaning |",
        "|---|---|---|---|---|",
        "| `preset` | str |  | `tiny` | base preset: " + ", ".join(f"`{p}`" for p in PRESETS) + " |",
    ]
    sections = {
        "model": ModelConfig,
        "moe": MoEConfig,
        "mtp": MTPConfig,
        "parallel": ParallelConfig,
        "fp8": FP8Config,
        "memory": MemoryConfig,
        "train": TrainConfig,
    }
    for sec, cls in sections.items():
        for name, f in cls.model_fields.items():
            val = json.dumps(tiny[sec][name])
            kind, bounds = _type_words(f.annotation), _range_words(f)
            rows.append(f"| `{sec}.{name}` | {kind} | {bounds} | `{val}` | {f.description or ''} |")
            if (sec, name) == ("model", "rope_scaling"):  # its keys' ranges (a nested object)
                for sub, g in RopeScaling.model_fields.items():
                    val = json.dumps(tiny[sec][name][sub])
                    rows.append(
                        f"| `{sec}.{name}.{sub}` | {_type_words(g.annotation)} | {_range_words(g)} | `{val}` | "
                        f"{g.description or ''} |"
                    )
    for name, f in DataConfig.model_fields.items():  # the object form of train.data (not set in the tiny preset)
        default = "required" if f.is_required() else json.dumps(f.get_default(call_default_factory=True))
        rows.append(
            f"| `train.data.{name}` | {_type_words(f.annotation)} | {_range_words(f)} | ({default}) | "
            f"{f.description or ''} |"
        )
    return "\n".join(rows)
