"""Native LoRA adapter tensors <-> the base tensors they adapt (the `names.py` table extended to adapters).

An adapted Linear whose native weight is `P.weight` holds `P.lora_A` [r, d_in] and `P.lora_B` [d_out, r]; routed
experts (`P` = `....mlp.experts`) hold `P.w1_lora_A` [E, r, H], `P.w1_lora_B` [E, I, r] (gate), `P.w3_lora_*`
(up, same shapes) and `P.w2_lora_A` [E, r, I], `P.w2_lora_B` [E, H, r] (down). The adapted weight is

    W' = W + s · B A,    s = alpha / r   (alpha / sqrt(r) with use_rslora; Hu et al. 2021, Kalajdzievski 2023)

`adapter_sites` checks a set of adapter tensors against the base's `DSv3Config` and its `LoRAConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from dsv3_plugin.checkpoint.integrity import is_finite, nonfinite_counts
from dsv3_plugin.checkpoint.names import Key, parse_native
from dsv3_plugin.config import DSv3Config, LoRAConfig, lora_targets
from dsv3_plugin.errors import CheckpointError

__all__ = [
    "AdapterSite",
    "EXPERT_PROJ",
    "MLP_TARGETS",
    "lora_scale",
    "adapter_sites",
    "config_targets",
    "config_groups",
    "group_modules",
]

# routed-expert adapter prefix -> the native stacked weight (names.py row) and its LORA_TARGETS name
EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSite:
    """One adapted weight: `module` the native prefix (`layers.0.self_attn.q_a_proj`, `layers.1.mlp.experts`),
    `key` its weight's `names.Key` (routed experts: expert None), `target` the LORA_TARGETS name, `a` / `b` the
    native tensor names, `kind` "attn" | "dense" | "shared" | "experts", `shape` the weight's (d_out, d_in)."""

    module: str
    key: Key
    target: str
    a: str
    b: str
    kind: str
    shape: tuple[int, int]

    def released(self, num_hidden_layers: int, expert: int | None = None) -> str:
        return self.key.with_index(expert=expert).released(num_hidden_layers)


def lora_scale(lora: LoRAConfig) -> float:
    """s = alpha / r, or alpha / sqrt(r) with `use_rslora` (peft's `scaling`)."""
    return lora.alpha / (math.sqrt(lora.rank) if lora.use_rslora else lora.rank)


def config_targets(cfg: DSv3Config, lora: LoRAConfig) -> tuple[str, ...]:
    """The LORA_TARGETS names `lora` adapts on `cfg`'s model (`config.lora_targets` with `lora` in place)."""
    return lora_targets(cfg.model_copy(update={"lora": lora}))


def config_groups(cfg: DSv3Config, lora: LoRAConfig) -> set[tuple[str, str]]:
    """The (kind, target) pairs `lora` adapts on `cfg`'s main decoder layers: attention targets on every layer, MLP
    targets on the dense MLPs, the shared experts and (`lora.experts`) the routed experts, where the model has them."""
    m = cfg.model
    has_dense, has_moe = m.first_k_dense_replace > 0, m.num_hidden_layers > m.first_k_dense_replace
    out = set()
    for t in config_targets(cfg, lora):
        if t not in MLP_TARGETS:
            out.add(("attn", t))
            continue
        out |= {("dense", t)} if has_dense else set()
        out |= {("shared", t)} if has_moe and cfg.moe.n_shared_experts > 0 else set()
        out |= {("experts", t)} if has_moe and lora.experts else set()
    return out


def group_modules(cfg: DSv3Config, kind: str, target: str) -> list[str]:
    """Native module prefixes of (kind, target) over the main decoder layers (experts: `layers.i.mlp.experts`)."""
    m = cfg.model
    k, L = m.first_k_dense_replace, m.num_hidden_layers
    if kind == "attn":
        return [f"layers.{i}.self_attn.{target}" for i in range(L)]
    if kind == "dense":
        return [f"layers.{i}.mlp.{target}" for i in range(min(k, L))]
    if kind == "shared":
        return [f"layers.{i}.mlp.shared_experts.{target}" for i in range(k, L)] if cfg.moe.n_shared_experts else []
    return [f"layers.{i}.mlp.experts" for i in range(k, L)]


def _site(name: str, hf: dict) -> tuple[AdapterSite, str]:
    """(site, "A" | "B") of one native adapter tensor name (`hf`: the base's released config); CheckpointError if it
    names no adaptable weight."""
    module, _, leaf = name.rpartition(".")
    bad = CheckpointError(f"{name}: not a LoRA adapter tensor of this model (no such adapted weight)")
    if leaf in ("lora_A", "lora_B"):
        try:
            key = parse_native(module + ".weight")
        except KeyError:
            raise bad from None
        sub = key.row.released  # e.g. "self_attn.q_a_proj.weight", "mlp.shared_experts.up_proj.weight"
        parts = sub.split(".")
        if not key.row.fp8 or key.row.is_expert:  # norms, router, embeddings, eh_proj: not adaptable
            raise bad
        kind = "attn" if parts[0] == "self_attn" else ("shared" if parts[1] == "shared_experts" else "dense")
        site = AdapterSite(module, key, parts[-2], f"{module}.lora_A", f"{module}.lora_B", kind, key.row.shape(hf))
        return site, leaf[-1]
    proj, _, ab = leaf.partition("_lora_")
    if module.endswith(".mlp.experts") and proj in EXPERT_PROJ and ab in ("A", "B"):
        try:
            key = parse_native(f"{module}.{EXPERT_PROJ[proj]}", expert=0)._replace(expert=None)
        except KeyError:
            raise bad from None
        a, b = f"{module}.{proj}_lora_A", f"{module}.{proj}_lora_B"
        return AdapterSite(module, key, EXPERT_PROJ[proj], a, b, "experts", key.row.shape(hf)), ab
    raise bad


def _layer_exists(site: AdapterSite, cfg: DSv3Config) -> bool:
    m = cfg.model
    n = m.num_hidden_layers if site.key.scope == "layer" else cfg.mtp.depth
    if site.key.index is None or site.key.index >= n:
        return False
    glob = site.key.index + (0 if site.key.scope == "layer" else m.num_hidden_layers)
    moe = glob >= m.first_k_dense_replace
    if site.kind == "attn":
        return (m.q_lora_rank is None) == (site.target == "q_proj")
    if site.kind == "dense":
        return not moe
    if site.kind == "shared":
        return moe and cfg.moe.n_shared_experts > 0
    return moe


def adapter_sites(adapters: Mapping[str, torch.Tensor], cfg: DSv3Config, lora: LoRAConfig) -> list[AdapterSite]:
    """Check native adapter tensors against the base model and the LoRA config; return their sites.

    Args:
        adapters: {native name: tensor}, lora_A [r, d_in] / lora_B [d_out, r] (experts: [E, ...] as above).
        cfg: the base model's config; lora: the adapters' config (rank, targets, experts).

    Returns:
        The adapted weights, in the order of `adapters` (first appearance of each site).

    Raises:
        CheckpointError: a name adapts no weight of this model or a module `lora` does not target, an A without
            its B, a shape not matching the base, a non-float dtype or non-finite values (one line naming it).
    """
    targets = set(config_targets(cfg, lora))
    r, E = lora.rank, cfg.moe.n_routed_experts
    sites: dict[str, AdapterSite] = {}
    hf = cfg.to_hf()
    for name, t in adapters.items():
        site, ab = _site(name, hf)
        if not _layer_exists(site, cfg):
            raise CheckpointError(f"{name}: adapts {site.module}, which this model does not have")
        if site.target not in targets or (site.kind == "experts" and not lora.experts):
            what = "routed experts" if site.kind == "experts" else repr(site.target)
            raise CheckpointError(f"{name}: the LoRA config does not adapt {what} (targets {sorted(targets)})")
        d_out, d_in = site.shape
        want = (r, d_in) if ab == "A" else (d_out, r)
        want = (E, *want) if site.kind == "experts" else want
        if tuple(t.shape) != want:
            raise CheckpointError(f"{name}: shape {list(t.shape)}, the base model and rank {r} need {list(want)}")
        if not t.dtype.is_floating_point or t.element_size() < 2:
            raise CheckpointError(f"{name}: dtype {t.dtype}, adapters are float32/bfloat16/float16")
        if not is_finite(t):
            nan, pinf, ninf = nonfinite_counts(t)
            raise CheckpointError(f"{name}: {nan} NaN, {pinf} +Inf, {ninf} -Inf among {t.numel()} values")
        sites.setdefault(site.module + ("." + site.target if site.kind == "experts" else ""), site)
    for site in sites.values():
        for n in (site.a, site.b):
            if n not in adapters:
                raise CheckpointError(f"{n}: missing (its pair {site.a if n == site.b else site.b} is present)")
    return list(sites.values())
