"""PEFT adapter directories (peft 0.21.2's LoRA format for transformers 5's DeepseekV3) <-> native adapters.

`adapter_config.json` as peft writes it; `adapter_model.safetensors` keys `base_model.model.<module>.lora_{A,B}.weight`.
Attention projections are `target_modules`. NOTE: peft 0.21.2 rewrites the target_modules `gate_proj` / `up_proj` /
`down_proj` of DeepseekV3 into the fused routed experts, so the dense and shared-expert MLPs are `target_parameters`
(`mlp.gate_proj.weight`, ...: the same keys). Routed experts are `target_parameters` `mlp.experts.gate_up_proj`
[E, 2I, H] (inner wrapper: `mlp.experts.base_layer.*` when down_proj is adapted too) and `mlp.experts.down_proj`:
lora_A [E·R, d_in] with rows e·R + k, lora_B [d_out, R·E] with columns k·E + e; gate and up together are one
rank-2r adapter, A = [A_gate; A_up], B = blockdiag(B_gate, B_up), its alpha_pattern keeping the scale s of `lora_names`.
The LoRA config also travels in the safetensors metadata (`dsv3.lora`) so reading restores it exactly.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping

import torch

from dsv3_plugin.checkpoint.convert import atomic_output_dir
from dsv3_plugin.checkpoint.integrity import is_finite, load_json
from dsv3_plugin.checkpoint.lora_names import (
    MLP_TARGETS,
    adapter_sites,
    config_groups,
    config_targets,
    group_modules,
)
from dsv3_plugin.checkpoint.names import parse_native
from dsv3_plugin.checkpoint.reader import read_safetensors_header
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter
from dsv3_plugin.config import LORA_TARGETS, DSv3Config, LoRAConfig
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.safe_files import opened_path

__all__ = [
    "write_peft_adapter",
    "write_peft_files",
    "peft_adapter_bytes",
    "read_peft_adapter",
    "peft_config_dict",
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_VERSION = "0.21.2"  # the peft release whose format this writes (and whose loader the tests run)
_META = "dsv3.lora"
_PREFIX = "base_model.model."
_GATE_UP = "mlp.experts.gate_up_proj"
_DOWN = "mlp.experts.down_proj"
# target_parameters of the dense / shared-expert MLPs: (kind, target)
_MLP_PARAMS = {f"mlp.{t}.weight": ("dense", t) for t in MLP_TARGETS} | {
    f"mlp.shared_experts.{t}.weight": ("shared", t) for t in MLP_TARGETS
}
_ATTN = tuple(t for t in LORA_TARGETS if t not in MLP_TARGETS)
# config keys of peft's LoraConfig that must keep their default for plain LoRA (anything else is another method)
_PLAIN = {
    "alora_invocation_tokens": None, "arrow_config": None, "corda_config": None, "eva_config": None,
    "exclude_modules": None, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "lora_bias": False, "lora_ga_config": None, "megatron_config": None,
    "modules_to_save": None, "monteclora_config": None, "trainable_token_indices": None, "use_bdlora": None,
    "use_dora": False, "use_qalora": False, "velora_config": None, "fan_in_fan_out": False,
}  # fmt: skip


def peft_config_dict(
    lora: LoRAConfig,
    target_modules: list[str],
    target_parameters: list[str],
    rank_pattern: dict,
    alpha_pattern: dict,
    base_model_name_or_path: str,
) -> dict:
    """`adapter_config.json` as peft 0.21.2's `save_pretrained` writes it for this LoRA (every key, peft's
    defaults for the ones plain LoRA leaves alone; `target_parameters` null when empty, as peft's default)."""
    return {
        **_PLAIN,
        "auto_mapping": None,
        "alpha_pattern": alpha_pattern,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "ensure_weight_tying": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "loftq_config": {},
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "megatron_core": "megatron.core",
        "peft_type": "LORA",
        "peft_version": PEFT_VERSION,
        "qalora_group_size": 16,
        "r": lora.rank,
        "rank_pattern": rank_pattern,
        "revision": None,
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        "task_type": "CAUSAL_LM",
        "use_rslora": lora.use_rslora,
    }


def _layer(module: str) -> int:
    return int(module.split(".")[1])


def _gate_up_alpha(lora: LoRAConfig, R: int) -> float:
    """alpha' with alpha' / R (or / sqrt(R)) = s: the rank-R gate_up adapter keeps the scale of its rank-r parts."""
    if R == lora.rank:
        return lora.alpha
    return lora.alpha * math.sqrt(R / lora.rank) if lora.use_rslora else lora.alpha * R / lora.rank


def _expert_to_peft(A_ERI: torch.Tensor, B_EOR: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, in], [E, out, R] -> peft's lora_A [E·R, in], lora_B [out, R·E] (column k·E + e)."""
    E, R, _ = A_ERI.shape
    return A_ERI.reshape(E * R, -1).contiguous(), B_EOR.permute(1, 2, 0).reshape(B_EOR.shape[1], R * E).contiguous()


def _expert_from_peft(A: torch.Tensor, B: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_expert_to_peft`: -> [E, R, in], [E, out, R]."""
    R = A.shape[0] // E
    return A.reshape(E, R, -1).contiguous(), B.reshape(B.shape[0], R, E).permute(2, 0, 1).contiguous()


def _plan(sites, adapters, cfg: DSv3Config, lora: LoRAConfig):
    """(peft key -> tensor, target_modules, target_parameters, rank_pattern, alpha_pattern) of checked sites."""
    L = cfg.model.num_hidden_layers
    groups: dict[tuple[str, str], set[str]] = {}
    for s in sites:
        if s.key.scope != "layer":
            raise CheckpointError(f"{s.a}: an MTP-layer adapter; transformers' DeepseekV3 has no MTP layer")
        groups.setdefault((s.kind, s.target), set()).add(s.module)
    for (kind, target), mods in sorted(groups.items()):
        for m in group_modules(cfg, kind, target):  # peft adapts a target on every layer that has it
            if m not in mods:
                p = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[target] + "_" if kind == "experts" else ""
                raise CheckpointError(f"{m}.{p}lora_A: missing (peft adapts {target} on every layer)")
    params = [p for p, g in _MLP_PARAMS.items() if g in groups]
    expert_t = {t for k, t in groups if k == "experts"}
    gu = [t for t in ("gate_proj", "up_proj") if t in expert_t]
    params += [_GATE_UP] if gu else []
    params += [_DOWN] if "down_proj" in expert_t else []
    ranks, alphas = {}, {}
    R = lora.rank * len(gu)
    if len(gu) == 2:
        ranks[re.escape(_GATE_UP)] = R
        alphas[re.escape(_GATE_UP)] = _gate_up_alpha(lora, R)
    out: dict[str, torch.Tensor] = {}
    by_module: dict[str, dict] = {}
    for s in sites:
        by_module.setdefault(s.module, {})[s.target] = s
    for module, ts in sorted(by_module.items(), key=lambda kv: (_layer(kv[0]), kv[0])):
        s0 = next(iter(ts.values()))
        if s0.kind != "experts":
            w = s0.released(L).removesuffix(".weight")
            out[f"{_PREFIX}{w}.lora_A.weight"] = adapters[s0.a].contiguous()
            out[f"{_PREFIX}{w}.lora_B.weight"] = adapters[s0.b].contiguous()
            continue
        pre = f"{_PREFIX}model.layers.{_layer(module)}.mlp.experts"
        if gu:  # peft wraps the experts' parameters in registration order: gate_up_proj inside, down_proj outside
            I = s0.shape[0] if s0.target != "down_proj" else s0.shape[1]
            A = torch.cat([adapters[ts[t].a] for t in gu], dim=1)  # [E, R, H]
            E = A.shape[0]
            B = A.new_zeros(E, 2 * I, R)
            for j, t in enumerate(("gate_proj", "up_proj")):
                if t in ts:
                    k = gu.index(t)
                    B[:, j * I : (j + 1) * I, k * lora.rank : (k + 1) * lora.rank] = adapters[ts[t].b]
            key = pre + (".base_layer" if "down_proj" in ts else "")
            out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = _expert_to_peft(A, B)
        if "down_proj" in ts:
            d = ts["down_proj"]
            out[f"{pre}.lora_A.weight"], out[f"{pre}.lora_B.weight"] = _expert_to_peft(adapters[d.a], adapters[d.b])
    modules = sorted({t for k, t in groups if k == "attn"})
    return out, modules, params, ranks, alphas


def write_peft_adapter(
    dst: str | os.PathLike,
    adapters: Mapping[str, torch.Tensor],
    cfg: DSv3Config,
    lora: LoRAConfig,
    base_model_name_or_path: str = "",
) -> str:
    """Write native adapters as a PEFT LoRA adapter directory (atomically: a hidden sibling renamed at the end).

    Args:
        dst: the directory to create (must not exist).
        adapters: {native name: tensor} (`lora_names` naming), checked against `cfg` and `lora`.
        cfg: the base model's config; lora: the adapters' config.
        base_model_name_or_path: written as peft's `base_model_name_or_path`.

    Returns:
        `dst`.

    Raises:
        CheckpointError: bad adapters (`adapter_sites`), or what peft cannot express: MTP-layer adapters, a target
            adapted on some layers only, `lora.bias_update`.
    """
    with atomic_output_dir(os.fspath(dst), peft_adapter_bytes(adapters) + (1 << 16)) as tmp:
        write_peft_files(tmp, adapters, cfg, lora, base_model_name_or_path)
    return os.fspath(dst)


def peft_adapter_bytes(adapters: Mapping[str, torch.Tensor]) -> int:
    """Bytes of tensor data `write_peft_files` writes for `adapters` (peft's layout holds the same elements)."""
    return sum(t.numel() * t.element_size() for t in adapters.values())


def write_peft_files(
    out: str, adapters: Mapping[str, torch.Tensor], cfg: DSv3Config, lora: LoRAConfig, base_model_name_or_path: str
) -> dict:
    """`adapter_config.json` and `adapter_model.safetensors` written into the existing directory `out` (the
    non-atomic part of `write_peft_adapter`; same Args and Raises). Returns {"tensors", "files", "output_bytes",
    "notes"}. NOTE: peft 0.21.2 refuses `lora_dropout` != 0 with `target_parameters` (DeepseekV3's MLP and expert
    adapters), so there the config says 0 (a note says so; the metadata keeps the run's value): dropout acts in
    training only, the adapter computes the same."""
    if lora.bias_update:
        raise CheckpointError(
            "lora.bias_update = true: the run changed the router bias, which a PEFT adapter cannot carry; "
            "export merged instead"
        )
    sites = adapter_sites(adapters, cfg, lora)
    tensors, modules, params, ranks, alphas = _plan(sites, adapters, cfg, lora)
    written = lora.model_copy(update={"dropout": _written_dropout(lora.dropout, params)})
    conf = peft_config_dict(written, modules, params, ranks, alphas, base_model_name_or_path)
    notes = []
    if written.dropout != lora.dropout:
        notes.append(
            f"adapter_config.json: lora_dropout 0 (the run trained with {lora.dropout}): peft 0.21.2 refuses dropout "
            "on target_parameters, which the MLP / expert adapters are; dropout acts in training only"
        )
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        f.write(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    specs = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    meta = {"format": "pt", _META: lora.model_dump_json()}
    with StreamingSafetensorsWriter(os.path.join(out, ADAPTER_WEIGHTS), specs, meta) as w:
        for k, t in tensors.items():
            w.write(k, t)
    return {"tensors": len(tensors), "files": 1, "output_bytes": w.total_bytes, "notes": notes}


def _written_dropout(dropout: float, target_parameters) -> float:
    """The `lora_dropout` peft 0.21.2 accepts: 0 with `target_parameters` (it refuses anything else there)."""
    return 0.0 if target_parameters else dropout


# ----------------------------------------------------------------------------------------------------------------
# reading


def _get(conf: dict, key: str, ok, what: str, where: str, default=None):
    v = conf.get(key, default)
    if not ok(v):
        raise CheckpointError(f"{where}: {key} = {json.dumps(v)}, expected {what}")
    return v


def _read_config(path: str) -> tuple[dict, int, float, float, bool, list[str], list[str], dict, dict]:
    conf = load_json(path, what="PEFT adapter config")
    _get(conf, "peft_type", lambda v: v == "LORA", '"LORA"', path)
    _get(conf, "task_type", lambda v: v in ("CAUSAL_LM", None), '"CAUSAL_LM"', path)
    _get(conf, "bias", lambda v: v == "none", '"none"', path, "none")
    for k, d in _PLAIN.items():
        _get(conf, k, lambda v, d=d: v == d or (d is None and v in ([], {})), f"{json.dumps(d)} (plain LoRA)", path, d)
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    r = _get(conf, "r", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "a positive int", path)
    alpha = _get(conf, "lora_alpha", lambda v: num(v) and v > 0, "a positive number", path)
    dropout = _get(conf, "lora_dropout", lambda v: num(v) and 0 <= v < 1, "a number in [0, 1)", path, 0.0)
    rs = _get(conf, "use_rslora", lambda v: isinstance(v, bool), "true or false", path, False)
    strs = lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)  # noqa: E731
    mods = _get(conf, "target_modules", lambda v: v is None or strs(v), "a list of module names", path) or []
    params = _get(conf, "target_parameters", lambda v: v is None or strs(v), "a list of parameter names", path) or []
    for m in mods:
        if m not in _ATTN:
            why = " (peft 0.21.2 maps it to the fused experts: a target_parameter)" if m in MLP_TARGETS else ""
            raise CheckpointError(f"{path}: target_modules names {m!r}, not one of {', '.join(_ATTN)}{why}")
    canon = []
    for (
        p
    ) in params:  # peft matches a parameter name as a suffix of `model.layers.N.<name>` (peft's own: "gate_up_proj")
        hit = [c for c in (*_MLP_PARAMS, _GATE_UP, _DOWN) if f"model.layers.0.{c}".endswith("." + p)]
        if not hit:
            raise CheckpointError(f"{path}: target_parameters names {p!r}, not a DeepseekV3 MLP or expert weight")
        canon += [c for c in hit if c not in canon]
    params = canon
    pats = lambda v: isinstance(v, dict) and all(num(x) for x in v.values())  # noqa: E731
    ranks = _get(conf, "rank_pattern", pats, "an object of numbers", path, {}) or {}
    alphas = _get(conf, "alpha_pattern", pats, "an object of numbers", path, {}) or {}
    return conf, r, float(alpha), float(dropout), rs, mods, params, ranks, alphas


def _pattern(pats: dict, key: str, default, path: str, name: str, others: list[str]):
    """peft's `get_pattern_key`: the first pattern p with re.match(r"(.*\\.)?(p)$", key); it must match no other."""
    for p, v in pats.items():
        try:
            if not re.match(rf"(.*\.)?({p})$", key):
                continue
        except re.error:
            raise CheckpointError(f"{path}: {name} key {p!r} is not a regular expression") from None
        for o in others:
            if re.match(rf"(.*\.)?({p})$", o):
                raise CheckpointError(f"{path}: {name} key {p!r} also matches {o} (only the fused experts may differ)")
        return v
    return default


def _tensors(path: str, root: str) -> tuple[dict[str, torch.Tensor], dict]:
    infos, meta = read_safetensors_header(path, root)
    from safetensors import safe_open

    with opened_path(path, CheckpointError, root, "safetensors file") as fd_path:
        try:
            with safe_open(fd_path, framework="pt", device="cpu") as f:
                out = {n: f.get_tensor(n) for n in infos}
        except Exception as e:  # SafetensorError is not exported under a stable name
            raise CheckpointError(f"{path}: cannot read ({e})") from None
    for n, t in out.items():
        if not t.dtype.is_floating_point or t.element_size() < 2:
            raise CheckpointError(f"{n} in {path}: dtype {t.dtype}, LoRA weights are float32/bfloat16/float16")
        if not is_finite(t):
            raise CheckpointError(f"{n} in {path}: non-finite values (NaN/Inf)")
    return out, meta


def read_peft_adapter(src: str | os.PathLike, cfg: DSv3Config) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Read a PEFT LoRA adapter directory (as `write_peft_adapter` or peft 0.21.2 writes it for DeepseekV3) back to
    native adapters, checked against the base model.

    Args:
        src: the adapter directory (`adapter_config.json`, `adapter_model.safetensors`; never a pickle).
        cfg: the base model's config.

    Returns:
        ({native name: tensor}, the LoRAConfig: the one stored in the metadata, else rank/alpha/targets read back).

    Raises:
        CheckpointError: a missing or malformed file, a target or key naming no module of the base, a missing key,
            a shape not matching the base, non-finite values, or what `dsv3.lora` cannot express (one line).
    """
    src = os.fspath(src)
    cpath, wpath = os.path.join(src, ADAPTER_CONFIG), os.path.join(src, ADAPTER_WEIGHTS)
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: not a PEFT adapter directory")
    if not os.path.lexists(wpath):
        other = (
            " (adapter_model.bin is a pickle: not read; save with safetensors)"
            if os.path.lexists(os.path.join(src, "adapter_model.bin"))
            else ""
        )
        raise CheckpointError(f"{wpath}: missing{other}")
    conf, r, alpha, dropout, rs, mods, params, ranks, alphas = _read_config(cpath)
    m, E = cfg.model, cfg.moe.n_routed_experts
    for t in mods:
        if (t == "q_proj") != (m.q_lora_rank is None):
            raise CheckpointError(f"{cpath}: target_modules names {t!r}, which the base model does not have")
    k = m.first_k_dense_replace
    hf = cfg.to_hf()
    H, I = m.hidden_size, hf["moe_intermediate_size"]
    s = alpha / (math.sqrt(r) if rs else r)
    expert_keys = [f"model.layers.{k}.{p}" for p in (_GATE_UP, _DOWN)]
    other_keys = [f"model.layers.{k}.self_attn.{t}" for t in mods] + [f"model.layers.0.{p}" for p in _MLP_PARAMS]
    R = {}
    for p in (_GATE_UP, _DOWN):
        key = f"model.layers.{k}.{p}"
        others = [o for o in expert_keys if o != key] + other_keys
        R[p] = _pattern(ranks, key, r, cpath, "rank_pattern", others)
        a = _pattern(alphas, key, alpha, cpath, "alpha_pattern", others)
        if not (isinstance(R[p], int) and R[p] in (r, 2 * r) and (p == _GATE_UP or R[p] == r)):
            raise CheckpointError(f"{cpath}: rank_pattern gives {p} rank {R[p]}; dsv3.lora needs r (or 2r, gate+up)")
        if not math.isclose(a / (math.sqrt(R[p]) if rs else R[p]), s, rel_tol=1e-12):
            raise CheckpointError(f"{cpath}: alpha_pattern gives {p} another scale than alpha / r (not dsv3.lora)")
    stored, meta = _tensors(wpath, src)
    meta_lora = None
    if _META in meta:
        try:
            meta_lora = LoRAConfig.model_validate_json(meta[_META])
        except ValueError as e:
            raise CheckpointError(f"{wpath}: metadata {_META} is not a dsv3.lora config ({e})") from None
    # which routed projections the gate_up adapter holds
    groups = {("attn", t) for t in mods} | {_MLP_PARAMS[p] for p in params if p in _MLP_PARAMS}
    gu: list[str] = []
    if _GATE_UP in params:
        if R[_GATE_UP] == 2 * r:
            gu = ["gate_proj", "up_proj"]
        else:
            named = {t for _, t in groups} | set(config_targets(cfg, meta_lora) if meta_lora else ())
            one = [t for t in ("gate_proj", "up_proj") if t in named]
            if len(one) != 1:
                raise CheckpointError(f"{cpath}: a rank-r gate_up_proj adapter, and nothing says gate or up")
            gu = one
    groups |= {("experts", t) for t in gu} | ({("experts", "down_proj")} if _DOWN in params else set())
    # expected peft keys -> (native A, B names or the experts' builder)
    native: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str, shape: tuple) -> torch.Tensor:
        t = stored.get(key)
        if t is None:
            raise CheckpointError(f"{key}: missing from {wpath}")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{key} in {wpath}: shape {list(t.shape)}, the base model needs {list(shape)}")
        used.add(key)
        return t

    for kind, t in sorted(groups):
        if kind == "experts":
            continue
        for mod in group_modules(cfg, kind, t):
            d_out, d_in = _site_shape(cfg, mod)
            w = f"{_PREFIX}model.{mod}"
            native[f"{mod}.lora_A"] = take(f"{w}.lora_A.weight", (r, d_in))
            native[f"{mod}.lora_B"] = take(f"{w}.lora_B.weight", (d_out, r))
    for mod in group_modules(cfg, "experts", "") if ("experts", "down_proj") in groups or gu else []:
        pre = f"{_PREFIX}model.{mod}"
        if gu:
            Rg = R[_GATE_UP]
            key = pre + (".base_layer" if _DOWN in params else "")
            A, B = _expert_from_peft(
                take(f"{key}.lora_A.weight", (E * Rg, H)), take(f"{key}.lora_B.weight", (2 * I, Rg * E)), E
            )
            mask = torch.ones_like(B, dtype=torch.bool)
            for j, t in enumerate(("gate_proj", "up_proj")):
                if t in gu:
                    q = gu.index(t)
                    w = {"gate_proj": "w1", "up_proj": "w3"}[t]
                    native[f"{mod}.{w}_lora_A"] = A[:, q * r : (q + 1) * r].contiguous()
                    native[f"{mod}.{w}_lora_B"] = B[:, j * I : (j + 1) * I, q * r : (q + 1) * r].contiguous()
                    mask[:, j * I : (j + 1) * I, q * r : (q + 1) * r] = False
            if bool((B[mask] != 0).any()):
                raise CheckpointError(
                    f"{key}.lora_B.weight in {wpath}: gate and up rows share rank columns (not block-diagonal), "
                    "which dsv3.lora's separate gate and up adapters cannot express"
                )
        if _DOWN in params:
            A, B = _expert_from_peft(
                take(f"{pre}.lora_A.weight", (E * r, I)), take(f"{pre}.lora_B.weight", (H, r * E)), E
            )
            native[f"{mod}.w2_lora_A"], native[f"{mod}.w2_lora_B"] = A, B
    extra = sorted(set(stored) - used)
    if extra:
        raise CheckpointError(f"{extra[0]} in {wpath}: names no adapted module of the base model ({cpath})")
    targets = [t for t in LORA_TARGETS if any(g[1] == t for g in groups)]
    experts = any(g[0] == "experts" for g in groups)
    lora = meta_lora or _lora_config(r, alpha, dropout, rs, targets, experts, cpath)
    if (lora.rank, lora.alpha, _written_dropout(lora.dropout, params), lora.use_rslora) != (r, alpha, dropout, rs):
        raise CheckpointError(f"{wpath}: metadata {_META} disagrees with {cpath} (rank, alpha, dropout, rsLoRA)")
    want = config_groups(cfg, lora)
    if want != groups:
        diff = sorted(want ^ groups)[0]
        raise CheckpointError(
            f"{cpath}: adapts {sorted(groups)}, but dsv3.lora with targets {list(config_targets(cfg, lora))} and "
            f"experts {lora.experts} adapts {sorted(want)} (first difference: {diff[1]} on {diff[0]})"
        )
    adapter_sites(native, cfg, lora)  # the final check of names and shapes against the base
    return native, lora


def _site_shape(cfg: DSv3Config, module: str) -> tuple[int, int]:
    try:
        return tuple(parse_native(module + ".weight").row.shape(cfg.to_hf()))
    except KeyError:
        raise CheckpointError(f"{module}: not a module of this model") from None


def _lora_config(r, alpha, dropout, rs, targets, experts, path) -> LoRAConfig:
    try:
        return LoRAConfig(rank=r, alpha=alpha, dropout=dropout, use_rslora=rs, targets=targets, experts=experts)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a dsv3.lora config ({str(e).splitlines()[0]})") from None
