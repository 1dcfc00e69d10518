"""Integrity of checkpoint input: strict JSON side files, finite weights and scales, a sane `config.json`.

Everything a checkpoint directory holds is untrusted input. The reader (`checkpoint/reader.py`) uses the
checks here so that a damaged or hostile directory fails with a `CheckpointError` that names the file and
the tensor or key (CLI exit 2), never with a traceback, a hang, or silently wrong numbers: `load_json` (strict
JSON of regular files inside the directory), `check_finite` (weights and scales; `allow_non_finite=True` skips
it) and `check_released_config` (the shape keys are integers in a plausible range, bounded by the tensor count).

Design notes: docs/design_notes.md#checkpoint-integrity
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.json_input import finite_float, no_constant
from dsv3_plugin.safe_files import read_regular

__all__ = [
    "parse_json",
    "load_json",
    "is_finite",
    "check_finite",
    "nonfinite_counts",
    "fp8_special_codes",
    "check_scale",
    "check_released_config",
    "ALLOW_HINT",
    "FP8_MAX",
]

ALLOW_HINT = "pass --allow-non-finite (allow_non_finite=True) to load it anyway"
# Largest finite magnitude of each FP8 format (E4M3: 448, S.1111.110; E5M2: 57344).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_CHUNK = 1 << 20


# --------------------------------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def parse_json(raw: bytes | str, where: str) -> Any:
    """Strict JSON from bytes/str; any defect (NaN/Infinity, a number that overflows to inf, duplicate keys,
    bad UTF-8, hostile nesting) -> CheckpointError naming `where`."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=no_constant, parse_float=finite_float)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, duplicate keys, NaN/Infinity
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None


_OWN_DIR = object()  # load_json's default root: the directory the file is in


def load_json(path: str, expect: type = dict, what: str = "JSON file", root: object = _OWN_DIR) -> Any:
    """Read `path` as strict JSON whose top level is an `expect` (dict by default).

    Args:
        path: the file.
        expect: the type the top level must have.
        what: what the file is, for messages.
        root: the directory the file must lie in (`safe_files`: a regular file, no link out of it); default the
            file's own directory; None for a file the user named explicitly (`--config FILE`).

    Returns:
        The parsed JSON.

    Raises:
        CheckpointError: naming `path` (missing, not a regular file, a link out of `root`, not strict JSON, ...).
    """
    if root is _OWN_DIR:
        root = os.path.dirname(os.path.abspath(path))
    raw = read_regular(path, CheckpointError, root, limit=64 * 2**20, what=what)
    if len(raw) > 64 * 2**20:
        raise CheckpointError(f"{path}: larger than 64 MiB, not a {what}")
    obj = parse_json(raw, path)
    if not isinstance(obj, expect):
        raise CheckpointError(f"{path}: top level is a JSON {type(obj).__name__}, expected an object ({what})")
    return obj


# --------------------------------------------------------------------------------------------------
def _chunks(t: torch.Tensor):
    flat = t.reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        yield flat[i : i + _CHUNK]


def is_finite(t: torch.Tensor) -> bool:
    """True iff every element of floating tensor `t` is finite (one streaming pass, no full-size temporary)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if t.element_size() == 1:  # raw FP8: decode through the special-code test below
        return fp8_special_codes(t) == 0
    for c in _chunks(t):
        lo, hi = torch.aminmax(c)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
            return False
    return True


def nonfinite_counts(t: torch.Tensor) -> tuple[int, int, int]:
    """(NaN, +Inf, -Inf) counts of a tensor that failed the check (a second full pass: failure path only)."""
    if t.element_size() == 1:
        return fp8_special_codes(t), 0, 0
    nan = pinf = ninf = 0
    for c in _chunks(t):
        nan += int(torch.isnan(c).sum())
        pinf += int((c == float("inf")).sum())
        ninf += int((c == float("-inf")).sum())
    return nan, pinf, ninf


def fp8_special_codes(w_fp8: torch.Tensor) -> int:
    """Number of NaN (E4M3: S.1111.111) or NaN/Inf (E5M2: S.11111.xx) codes in raw FP8 data."""
    u8 = w_fp8.contiguous().view(torch.uint8).reshape(-1)
    mask = 0x7F if w_fp8.dtype == torch.float8_e4m3fn else 0x7C
    n = 0
    for c in _chunks(u8):
        n += int(((c & mask) == mask).sum())
    return n


def _describe(t: torch.Tensor) -> str:
    nan, pinf, ninf = nonfinite_counts(t)
    parts = [f"{n} {k}" for n, k in ((nan, "NaN"), (pinf, "+Inf"), (ninf, "-Inf")) if n]
    return ", ".join(parts) or "non-finite values"


def check_finite(t: torch.Tensor, where: str, allow: bool = False) -> None:
    """Refuse a tensor holding NaN/Inf: CheckpointError naming `where` ("<tensor> in <file>")."""
    if allow or is_finite(t):
        return
    raise CheckpointError(f"{where}: {_describe(t)} among {t.numel()} values (non-finite weights); {ALLOW_HINT}")


def check_scale(scale: torch.Tensor, fp8_dtype: torch.dtype, out_dtype: torch.dtype, where: str) -> None:
    """A block scale must be finite, positive and normal (DeepSeek's quantizer writes amax / 448 > 0: a zero
    scale erases its block, a negative one flips its signs, a subnormal one is not what any quantizer writes), and
    small enough that the largest FP8 value times it stays finite in `out_dtype` (otherwise dequantization would
    produce Inf from finite inputs)."""
    s = scale.float()
    if not is_finite(s):
        raise CheckpointError(
            f"{where}: {_describe(s)} among {s.numel()} block scales (non-finite weight_scale_inv); {ALLOW_HINT}"
        )
    tiny = torch.finfo(torch.float32).tiny
    kinds = ((s == 0, "zero"), (s < 0, "negative"), ((s > 0) & (s < tiny), f"subnormal (< {tiny:g})"))
    parts = [f"{int(m.sum())} {k}" for m, k in kinds if bool(m.any())]
    if parts:
        raise CheckpointError(
            f"{where}: {', '.join(parts)} among {s.numel()} block scales (weight_scale_inv must be positive and "
            f"normal); {ALLOW_HINT}"
        )
    limit = torch.finfo(out_dtype).max / FP8_MAX[fp8_dtype]
    amax = float(s.abs().max()) if s.numel() else 0.0
    if amax > limit:
        raise CheckpointError(
            f"{where}: block scale {amax:g} would overflow {str(out_dtype).replace('torch.', '')} "
            f"(largest FP8 value x scale > {torch.finfo(out_dtype).max:g}); {ALLOW_HINT}"
        )


# --------------------------------------------------------------------------------------------------
_REQUIRED_POS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate_size",
    "moe_intermediate_size",
)
_REQUIRED_NONNEG = ("qk_nope_head_dim",)
_OPTIONAL_NONNEG = (
    "q_lora_rank",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "num_nextn_predict_layers",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_released_config(cfg: dict, cfg_path: str, n_tensors: int | None = None) -> None:
    """The released `config.json` keys that name and shape tensors: present, integers, bounded.

    `n_tensors` (tensors stored in the directory) bounds the layer and expert counts: every layer and
    every routed expert owns at least one stored tensor, so a config implying more is wrong."""
    for k in _REQUIRED_POS + _REQUIRED_NONNEG:
        if k not in cfg:
            raise CheckpointError(f"{cfg_path}: missing key {k!r}")
    for k in _REQUIRED_POS + _REQUIRED_NONNEG + _OPTIONAL_NONNEG:
        v = cfg.get(k)
        if v is None and k in _OPTIONAL_NONNEG:
            continue
        if not _is_int(v):
            raise CheckpointError(f"{cfg_path}: {k} must be an integer (got {v!r})")
        lo = 1 if k in _REQUIRED_POS else 0
        if v < lo or v > 2**31 - 1:
            raise CheckpointError(f"{cfg_path}: {k} = {v} is out of range [{lo}, 2**31 - 1]")
    if "tie_word_embeddings" in cfg and not isinstance(cfg["tie_word_embeddings"], bool):
        raise CheckpointError(
            f"{cfg_path}: tie_word_embeddings must be true or false (got {cfg['tie_word_embeddings']!r})"
        )
    for k in ("rope_scaling", "rope_parameters"):
        if cfg.get(k) is not None and not isinstance(cfg[k], dict):
            raise CheckpointError(f"{cfg_path}: {k} must be an object or null (got {cfg[k]!r})")
    qc = cfg.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict):
            raise CheckpointError(f"{cfg_path}: quantization_config must be an object (got {qc!r})")
        bs = qc.get("weight_block_size", [128, 128])
        if not (isinstance(bs, list) and len(bs) == 2 and all(_is_int(b) and 0 < b <= 2**20 for b in bs)):
            raise CheckpointError(
                f"{cfg_path}: quantization_config.weight_block_size must be two positive integers (got {bs!r})"
            )
    if n_tensors is not None:
        layers = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers") or 0)
        experts = cfg.get("n_routed_experts") or 0
        moe_layers = max(0, layers - (cfg.get("first_k_dense_replace") or 0))
        if layers > n_tensors:
            raise CheckpointError(
                f"{cfg_path}: num_hidden_layers = {cfg['num_hidden_layers']} but the checkpoint "
                f"holds only {n_tensors} tensors (config.json does not describe these weights)"
            )
        if moe_layers * experts > n_tensors:
            raise CheckpointError(
                f"{cfg_path}: n_routed_experts = {experts} in {moe_layers} MoE layers but the "
                f"checkpoint holds only {n_tensors} tensors (config.json does not describe "
                "these weights)"
            )
