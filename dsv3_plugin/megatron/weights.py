"""Weights into a `GPTModel` built from our spec: released (HF-format) checkpoints and `dsv3 convert --to megatron`
output.

Our GPTModel's names are Megatron-Core's for embedding, MLA, norms, output layer and MTP block (MCore <-> HF map,
docs/facts.md §1), and ours below `mlp.` (`DSv3FFN`: `mlp.dense.{gate,up,down}_proj`,
`mlp.moe.gate.{weight,e_score_correction_bias}`, stacked experts `mlp.moe.experts.{gate,up,down}_proj` [E_local, ...],
`mlp.moe.shared_experts.*`). Both loaders go through one name map and fill every parameter and the router bias
exactly once; a missing, duplicated, unexpected or mis-shaped tensor is a `CheckpointError` naming it.

Pipeline stages load only their own layers (Megatron numbers layers per stage); with expert parallelism a rank
loads its contiguous block of experts (expert e on EP rank e // (E/ep)). Tensor parallelism > 1 is not supported
by these loaders.
"""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Iterator, Optional

import torch

from dsv3_plugin.checkpoint.megatron_layout import MLA_NAME_MAP
from dsv3_plugin.errors import CheckpointError
from .spec import mtp_inner_layer_name
from dsv3_plugin.checkpoint.hf import iter_checkpoint_tensors

__all__ = ["hf_to_megatron_name", "load_hf_checkpoint", "load_megatron_checkpoint", "megatron_layout_to_ours"]

# Released decoder-layer sub-names -> ours (Megatron MLA names; our FFN below `mlp.`).
_LAYER = {
    **MLA_NAME_MAP,
    "mlp.gate_proj.weight": "mlp.dense.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.dense.up_proj.weight",
    "mlp.down_proj.weight": "mlp.dense.down_proj.weight",
    "mlp.gate.weight": "mlp.moe.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.moe.gate.e_score_correction_bias",
    "mlp.shared_experts.gate_proj.weight": "mlp.moe.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight": "mlp.moe.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight": "mlp.moe.shared_experts.down_proj.weight",
}
_MTP_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "shared_head.norm.weight": "final_layernorm.weight"}
_MTP_SHARED = {"embed_tokens.weight": "embedding.word_embeddings.weight",
               "shared_head.head.weight": "output_layer.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class _Target:
    """Where one source tensor goes: parameter/buffer `name`, optionally row `index` (stacked expert) and a
    dim-0 slice `part` of `nparts` (fused gate|up in Megatron's layout)."""

    __slots__ = ("name", "index", "part", "nparts", "shared", "stage_local")

    def __init__(self, name, index=None, part=0, nparts=1, shared=False, stage_local=False):
        self.name, self.index, self.part, self.nparts, self.shared = name, index, part, nparts, shared
        self.stage_local = stage_local  # exists only on some pipeline stages: skipped where the model lacks it


# Transformer Engine's MLA spec fuses the latent norms into the up-projections.
_TE_ALIASES = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
               "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}


def _resolve_name(name: str, state: dict) -> str:
    if name in state:
        return name
    for ours, te in _TE_ALIASES.items():
        if name.endswith(ours) and name[: -len(ours)] + te in state:
            return name[: -len(ours)] + te
    return name


def _model_geometry(model):
    """(L total decoder layers, first global layer on this stage, layers on this stage, ep size, ep rank)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    config = model.config
    offset = get_transformer_layer_offset(config, getattr(model, "vp_stage", None))
    n_local = len(model.decoder.layers) if hasattr(model, "decoder") else 0
    ep = ps.get_expert_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    ep_rank = ps.get_expert_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        raise CheckpointError("megatron weights: tensor_model_parallel_size > 1 is not supported by this loader")
    return config.num_layers, offset, n_local, ep, ep_rank


def hf_to_megatron_name(hf: str, L: int, offset: int, n_local: int, n_experts: int, ep: int,
                        ep_rank: int) -> Optional[_Target]:
    """Target of released tensor `hf` in this rank's model, None if it belongs to another stage / EP rank.
    CheckpointError for a name outside the released format."""
    if hf == "model.embed_tokens.weight":
        return _Target("embedding.word_embeddings.weight", stage_local=True)
    if hf == "model.norm.weight":
        return _Target("decoder.final_layernorm.weight", stage_local=True)
    if hf == "lm_head.weight":
        return _Target("output_layer.weight", stage_local=True)
    m = _LAYER_RE.match(hf)
    if not m:
        raise CheckpointError(f"{hf}: unexpected tensor (not part of the released DeepSeek-V3 format)")
    g, sub = int(m.group(1)), m.group(2)
    if g < L:
        if not offset <= g < offset + n_local:
            return None
        prefix = f"decoder.layers.{g - offset}"
    else:
        k = g - L
        if sub in _MTP_SHARED:
            return _Target(_MTP_SHARED[sub], shared=True)
        if sub in _MTP_OWN:
            return _Target(f"mtp.layers.{k}.{_MTP_OWN[sub]}")
        prefix = f"mtp.layers.{k}.{_mtp_inner()}"
    e = _EXPERT_RE.match(sub)
    if e:
        idx, proj = int(e.group(1)), e.group(2)
        per_rank = n_experts // ep
        if idx // per_rank != ep_rank:
            return None
        return _Target(f"{prefix}.mlp.moe.experts.{proj}", index=idx % per_rank)
    if sub not in _LAYER:
        raise CheckpointError(f"{hf}: unexpected tensor (not part of the released DeepSeek-V3 format)")
    return _Target(f"{prefix}.{_LAYER[sub]}")


# Megatron-Core standard names written by `dsv3 convert --to megatron` (docs/checkpoints.md) -> ours.
_MCORE_FFN = {
    "mlp.linear_fc1.weight": ("mlp.dense.gate_proj.weight", "mlp.dense.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.dense.down_proj.weight",),
    "mlp.router.weight": ("mlp.moe.gate.weight",),
    "mlp.router.expert_bias": ("mlp.moe.gate.e_score_correction_bias",),
    "mlp.shared_experts.linear_fc1.weight": ("mlp.moe.shared_experts.gate_proj.weight",
                                             "mlp.moe.shared_experts.up_proj.weight"),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.moe.shared_experts.down_proj.weight",),
}
_MCORE_EXPERT_RE = re.compile(r"^(.*)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def _mtp_inner() -> str:
    return mtp_inner_layer_name()


def megatron_layout_to_ours(name: str) -> list[_Target]:
    """Targets of one tensor of the converter's Megatron-Core layout (a fused fc1 has two: gate, up rows)."""
    if name.startswith("mtp.layers.") and ".transformer_layer." in name:
        # The file layout keeps Megatron's checkpoint name; the module is `mtp_model_layer` from core 0.19 on.
        name = name.replace(".transformer_layer.", f".{_mtp_inner()}.", 1)
    if name.startswith("mtp.layers.") and name.endswith((".embed_tokens.weight", ".output_layer.weight")):
        return [_Target("embedding.word_embeddings.weight" if "embed_tokens" in name else "output_layer.weight",
                        shared=True)]
    e = _MCORE_EXPERT_RE.match(name)
    if e:
        prefix, j, which = e.group(1), int(e.group(2)), e.group(3)
        if which == "linear_fc1":
            return [_Target(f"{prefix}.mlp.moe.experts.gate_proj", j, 0, 2),
                    _Target(f"{prefix}.mlp.moe.experts.up_proj", j, 1, 2)]
        return [_Target(f"{prefix}.mlp.moe.experts.down_proj", j)]
    for src, dsts in _MCORE_FFN.items():
        if name.endswith("." + src):
            prefix = name[: -len(src)]
            return [_Target(prefix + d, None, i, len(dsts)) for i, d in enumerate(dsts)]
    return [_Target(name)]


def _assign(model, items: Iterable[tuple[str, _Target, torch.Tensor]]) -> None:
    state = model.state_dict(keep_vars=True)
    wanted = {k for k in state if not k.endswith("_extra_state")}
    filled_rows: dict[str, set] = {}
    done: set[str] = set()
    shared_checks = []
    for src, tgt, t in items:
        if tgt.nparts > 1:
            if t.shape[0] % tgt.nparts:
                raise CheckpointError(f"{src}: dim 0 ({t.shape[0]}) is not {tgt.nparts} fused parts")
            t = t.chunk(tgt.nparts, dim=0)[tgt.part]
        if tgt.shared:
            shared_checks.append((src, tgt.name, t))
            continue
        tgt.name = _resolve_name(tgt.name, state)
        if tgt.name not in state and tgt.stage_local:
            continue                                   # held by another pipeline stage
        if tgt.name not in state:
            raise CheckpointError(f"{src}: maps to {tgt.name}, which this model does not have "
                                  "(model built for a different config?)")
        dst = state[tgt.name]
        if tgt.index is not None:
            if tuple(dst.shape[1:]) != tuple(t.shape) or tgt.index >= dst.shape[0]:
                raise CheckpointError(f"{src}: shape {tuple(t.shape)} does not fit {tgt.name}[{tgt.index}] "
                                      f"of {tuple(dst.shape)}")
            rows = filled_rows.setdefault(tgt.name, set())
            if tgt.index in rows:
                raise CheckpointError(f"{src}: {tgt.name}[{tgt.index}] given twice")
            rows.add(tgt.index)
            with torch.no_grad():
                dst.data[tgt.index].copy_(t.to(dst.dtype))
            if len(rows) == dst.shape[0]:
                done.add(tgt.name)
            continue
        if tuple(dst.shape) != tuple(t.shape):
            raise CheckpointError(f"{src}: shape {tuple(t.shape)} != {tgt.name} {tuple(dst.shape)}")
        if tgt.name in done:
            raise CheckpointError(f"{src}: {tgt.name} given twice")
        with torch.no_grad():
            dst.data.copy_(t.to(dst.dtype))
        done.add(tgt.name)
    missing = sorted(wanted - done)
    if missing:
        raise CheckpointError(f"megatron weights: {len(missing)} tensors not in the checkpoint, e.g. {missing[:4]}")
    for src, name, t in shared_checks:
        if name in state and not torch.equal(state[name].detach().to(t.dtype), t):
            raise CheckpointError(f"{src}: differs from {name}; Megatron's MTP shares the main "
                                  "embedding/output layer and cannot hold a separate copy")


def load_hf_checkpoint(model, path: str | os.PathLike) -> None:
    """Load a released-format checkpoint directory (config.json + safetensors, BF16/FP32; FP8 files must be
    dequantized first, e.g. with `dsv3 convert`) into this rank's part of `model`."""
    L, offset, n_local, ep, ep_rank = _model_geometry(model)
    E = model.config.num_moe_experts or 0

    def items() -> Iterator:
        for name, fname, t in iter_checkpoint_tensors(path):
            if t.element_size() == 1:
                raise CheckpointError(f"{name} in {fname}: FP8 tensor; dequantize the checkpoint first")
            tgt = hf_to_megatron_name(name, L, offset, n_local, E, ep, ep_rank)
            if tgt is not None:
                yield name, tgt, t
    _assign(model, items())


def load_megatron_checkpoint(model, path: str | os.PathLike, pp_rank: Optional[int] = None,
                             ep_rank: Optional[int] = None) -> None:
    """Load this rank's file(s) of `dsv3 convert --to megatron` output (Megatron-Core names, `layout.json`)."""
    from safetensors import safe_open
    from megatron.core import parallel_state as ps
    init = ps.model_parallel_is_initialized()
    pp_rank = (ps.get_pipeline_model_parallel_rank() if init else 0) if pp_rank is None else pp_rank
    ep_rank = (ps.get_expert_model_parallel_rank() if init else 0) if ep_rank is None else ep_rank
    layout_path = os.path.join(os.fspath(path), "layout.json")
    if not os.path.exists(layout_path):
        raise CheckpointError(f"{layout_path}: missing (not a `dsv3 convert --to megatron` directory)")
    with open(layout_path) as f:
        layout = json.load(f)
    ep = ps.get_expert_model_parallel_world_size() if init else 1
    pp = ps.get_pipeline_model_parallel_world_size() if init else 1
    if layout.get("ep", 1) != ep or layout.get("pp", 1) != pp:
        raise CheckpointError(f"{layout_path}: written for pp={layout.get('pp')} ep={layout.get('ep')}, "
                              f"this run has pp={pp} ep={ep}")
    files = [f"mp_rank_pp{pp_rank:03d}_ep{ep_rank:03d}.safetensors"]
    if ep_rank != 0:
        files.insert(0, f"mp_rank_pp{pp_rank:03d}_ep000.safetensors")  # non-expert tensors live in ep 0 only

    def items() -> Iterator:
        for fn in files:
            full = os.path.join(os.fspath(path), fn)
            if not os.path.exists(full):
                raise CheckpointError(f"{full}: missing")
            with safe_open(full, framework="pt") as f:
                for name in f.keys():
                    if fn != files[-1] and ".mlp.experts.local_experts." in name:
                        continue  # ep-0's experts belong to EP rank 0
                    t = f.get_tensor(name)
                    for tgt in megatron_layout_to_ours(name):
                        yield f"{name} in {fn}", tgt, t
    _assign(model, items())
