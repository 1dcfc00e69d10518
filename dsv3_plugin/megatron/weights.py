"""Weights into a `GPTModel` built from our spec: released checkpoints (FP8, BF16 or FP32) and `dsv3 convert --to
megatron` output.

Names: the `megatron` and `file` schemes of the one name table, `checkpoint/names.py` (Megatron-Core's names for
embedding, MLA, norms, output layer and MTP block; ours below `mlp.`: `mlp.dense.*`, `mlp.moe.gate.*`, stacked
experts `mlp.moe.experts.{gate,up,down}_proj` [E_local, ...], `mlp.moe.shared_experts.*`).

Every parameter and router bias is filled exactly once. The tensors are matched against the model from the
headers first, before any data is read: a missing, duplicated, unexpected or mis-shaped tensor is a
`CheckpointError` naming it (and its file).

Design notes: docs/design_notes.md#megatron-weights
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from dsv3_plugin.checkpoint.convert import LAYOUT_NAME, load_megatron_rank, read_layout
from dsv3_plugin.checkpoint.names import Key, parse_file, parse_released
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.megatron.spec import mtp_inner_layer_name
from dsv3_plugin.precision.fp8.frozen import SCALE_SUFFIX
from dsv3_plugin.precision.fp8.quant import FP8_DTYPE, TILE, quantize_blockwise

__all__ = ["hf_to_megatron_name", "load_hf_checkpoint", "load_megatron_checkpoint", "megatron_layout_to_ours"]


class _Target:
    """Where one source tensor goes: parameter/buffer `name` (`te_name`: its name in Transformer Engine's MLA spec),
    optionally row `index` (stacked expert) and a dim-0 slice `part` of `nparts` (fused gate|up in Megatron's
    layout)."""

    __slots__ = ("name", "te_name", "index", "part", "nparts", "shared", "stage_local")

    def __init__(self, name, te_name=None, index=None, part=0, nparts=1, shared=False, stage_local=False):
        self.name, self.te_name, self.index, self.part, self.nparts = name, te_name, index, part, nparts
        self.shared = shared  # an MTP copy of the embedding/head: Megatron shares the main one
        self.stage_local = stage_local  # exists only on some pipeline stages: skipped where the model lacks it


def _target(
    key: Key, inner: str, index: int | None = None, part: int = 0, nparts: int = 1, stage_local: bool = False
) -> _Target:
    name, te = key.megatron(inner), key.megatron(inner, te=True)
    return _Target(
        name,
        te if te != name else None,
        index,
        part,
        nparts,
        shared=key.row.copy_of is not None,
        stage_local=stage_local,
    )


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


def hf_to_megatron_name(
    hf: str, L: int, offset: int, n_local: int, n_experts: int, ep: int, ep_rank: int, inner: str | None = None
) -> _Target | None:
    """Target of released tensor `hf` in this rank's model, None if it belongs to another stage / EP rank.
    CheckpointError for a name outside the released format."""
    inner = inner or mtp_inner_layer_name()
    key = parse_released(hf, L)
    if key.scope == "top":
        return _target(key, inner, stage_local=True)
    # MTP's tensors live on the stage that holds the MTP block (the last one; in DualPipeV's V, chunk 1 of rank 0)
    mtp = key.scope in ("mtp", "mtp_layer")
    if key.scope == "layer":
        if not offset <= key.index < offset + n_local:
            return None
        key = key.with_index(index=key.index - offset)
    if key.expert is None:
        return _target(key, inner, stage_local=mtp)
    if key.expert >= n_experts:
        raise CheckpointError(
            f"{hf}: unexpected tensor (expert {key.expert} but the model has {n_experts} routed experts)"
        )
    per_rank = n_experts // ep
    if key.expert // per_rank != ep_rank:
        return None
    return _target(key, inner, index=key.expert % per_rank, stage_local=mtp)


def megatron_layout_to_ours(name: str, inner: str | None = None) -> list[_Target]:
    """Targets of one tensor of the converter's Megatron-Core layout (a fused fc1 has two: gate, up rows)."""
    inner = inner or mtp_inner_layer_name()
    return [_target(k, inner, index=k.expert, part=k.row.part, nparts=k.row.nparts) for k in parse_file(name)]


def _assign(model, items: Iterable[tuple[str, _Target, tuple, Callable[[], torch.Tensor]]], where: str) -> None:
    """Fill `model` from `items` = (source, target, stored shape, read): every target is checked against the model
    (name, shape, duplicates, completeness) before the first `read()`."""
    state = model.state_dict(keep_vars=True)
    # a frozen FP8 base (LoRA, `megatron/lora.py`): its E4M3 weights are non-persistent buffers, filled here with
    # their `weight_scale_inv` from the release's bytes as stored
    fp8 = {n: b for n, b in model.named_buffers() if b.dtype == FP8_DTYPE}
    state.update(fp8)
    wanted = {k for k in state if not k.endswith("_extra_state")}
    plan = []
    filled_rows: dict[str, set] = {}
    done: set[str] = set()
    for src, tgt, shape, read in items:
        shape = tuple(shape)
        if tgt.nparts > 1:
            if not shape or shape[0] % tgt.nparts:
                raise CheckpointError(f"{src}: dim 0 of {list(shape)} is not {tgt.nparts} fused parts")
            shape = (shape[0] // tgt.nparts,) + shape[1:]
        if tgt.shared:
            if tgt.name in state and tuple(state[tgt.name].shape) != shape:
                raise CheckpointError(f"{src}: shape {shape} != {tgt.name} {tuple(state[tgt.name].shape)}")
            plan.append((src, tgt, read))
            continue
        if tgt.name not in state and tgt.te_name in state:
            tgt.name = tgt.te_name
        if tgt.name not in state and tgt.stage_local:
            continue  # held by another pipeline stage
        if tgt.name not in state:
            raise CheckpointError(
                f"{src}: maps to {tgt.name}, which this model does not have (model built for a different config?)"
            )
        dst = state[tgt.name]
        if tgt.index is not None:
            if tuple(dst.shape[1:]) != shape or tgt.index >= dst.shape[0]:
                raise CheckpointError(
                    f"{src}: shape {shape} does not fit {tgt.name}[{tgt.index}] of {tuple(dst.shape)}"
                )
            rows = filled_rows.setdefault(tgt.name, set())
            if tgt.index in rows:
                raise CheckpointError(f"{src}: {tgt.name}[{tgt.index}] given twice")
            rows.add(tgt.index)
            if len(rows) == dst.shape[0]:
                done.add(tgt.name)
        else:
            if tuple(dst.shape) != shape:
                raise CheckpointError(f"{src}: shape {shape} != {tgt.name} {tuple(dst.shape)}")
            if tgt.name in done:
                raise CheckpointError(f"{src}: {tgt.name} given twice")
            done.add(tgt.name)
        plan.append((src, tgt, read))
    missing = sorted(wanted - done)
    if missing:
        raise CheckpointError(
            f"{where}: {len(missing)} of this model's tensors are not in the checkpoint, e.g. {missing[:4]}"
        )
    shared_checks = []
    for src, tgt, read in plan:
        if tgt.name in fp8:
            _assign_fp8(src, tgt, read, state[tgt.name], dict(model.named_buffers())[tgt.name + SCALE_SUFFIX])
            continue
        t = read()
        if tgt.nparts > 1:
            t = t.chunk(tgt.nparts, dim=0)[tgt.part]
        if tgt.shared:
            shared_checks.append((src, tgt.name, t))
            continue
        dst = state[tgt.name]
        with torch.no_grad():
            (dst.data if tgt.index is None else dst.data[tgt.index]).copy_(t.to(dst.dtype))
    for src, name, t in shared_checks:
        if name in state and not torch.equal(state[name].detach().to(t.dtype), t):
            raise CheckpointError(
                f"{src}: differs from {name}; Megatron's MTP shares the main "
                "embedding/output layer and cannot hold a separate copy"
            )


@torch.no_grad()
def _assign_fp8(src: str, tgt: _Target, read, q_dst: torch.Tensor, s_dst: torch.Tensor) -> None:
    """Fill a frozen FP8 weight (q [(E,) O, K] E4M3, s its 128x128 block scales): an FP8 release's bytes as stored
    (`read(raw=True)` -> (q, s)), a high-precision one quantized once in 128x128 blocks."""
    if tgt.nparts > 1:
        raise CheckpointError(
            f"{src}: a fused tensor cannot fill the frozen FP8 {tgt.name} (load a released directory)"
        )
    t = read(raw=True)
    q, s = t if isinstance(t, tuple) else quantize_blockwise(t.float(), TILE)
    if tgt.index is not None:
        q_dst, s_dst = q_dst[tgt.index], s_dst[tgt.index]
    if q.shape != q_dst.shape or s.shape != s_dst.shape:
        raise CheckpointError(
            f"{src}: FP8 weight {list(q.shape)} with scales {list(s.shape)} does not fit the frozen {tgt.name} "
            f"{list(q_dst.shape)} / {list(s_dst.shape)}"
        )
    q_dst.copy_(q)
    s_dst.copy_(s)


def _read_released(reader: CheckpointReader, name: str, raw: bool):
    """A released tensor: FP8 dequantized to fp32 (the exact product of the formula; the parameter's dtype comes
    after), or with `raw` an FP8 weight's stored (E4M3, weight_scale_inv) pair."""
    if not reader.is_fp8(name):
        return reader.get(name)
    return reader.get_fp8(name) if raw else reader.get(name, torch.float32)


def load_hf_checkpoint(model, path: str | os.PathLike, allow_non_finite: bool = False) -> None:
    """Load a released-format checkpoint directory (config.json + safetensors; FP8 with `weight_scale_inv`,
    BF16 or FP32) into this rank's part of `model`. FP8 weights are dequantized in fp32 (DeepSeek's block
    formula) and cast to the parameter's dtype. NaN/Inf weights or scales raise unless `allow_non_finite`."""
    L, offset, n_local, ep, ep_rank = _model_geometry(model)
    E = model.config.num_moe_experts or 0
    inner = mtp_inner_layer_name()
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as reader:
        if reader.config.get("num_hidden_layers") != L:
            raise CheckpointError(
                f"{reader.config_path}: num_hidden_layers {reader.config.get('num_hidden_layers')}"
                f" but the model has {L} decoder layers"
            )

        def items():
            for name in reader.names():
                tgt = hf_to_megatron_name(name, L, offset, n_local, E, ep, ep_rank, inner)
                if tgt is not None:
                    yield (
                        f"{name} in {os.path.basename(reader.info(name).file)}",
                        tgt,
                        reader.shape(name),
                        lambda raw=False, n=name: _read_released(reader, n, raw),
                    )

        _assign(model, items(), os.fspath(path))


def load_megatron_checkpoint(
    model,
    path: str | os.PathLike,
    pp_rank: int | None = None,
    ep_rank: int | None = None,
    allow_non_finite: bool = False,
) -> None:
    """Load this rank's file(s) of `dsv3 convert --to megatron` output (Megatron-Core names, `layout.json`)."""
    from megatron.core import parallel_state as ps

    init = ps.model_parallel_is_initialized()
    pp_rank = (ps.get_pipeline_model_parallel_rank() if init else 0) if pp_rank is None else pp_rank
    ep_rank = (ps.get_expert_model_parallel_rank() if init else 0) if ep_rank is None else ep_rank
    path = os.fspath(path)
    layout_path = os.path.join(path, LAYOUT_NAME)
    if not os.path.exists(layout_path):
        raise CheckpointError(f"{layout_path}: missing (not a `dsv3 convert --to megatron` directory)")
    layout = read_layout(path)
    ep = ps.get_expert_model_parallel_world_size() if init else 1
    pp = ps.get_pipeline_model_parallel_world_size() if init else 1
    if layout.get("ep", 1) != ep or layout.get("pp", 1) != pp:
        raise CheckpointError(
            f"{layout_path}: written for pp={layout.get('pp')} ep={layout.get('ep')}, this run has pp={pp} ep={ep}"
        )
    _, offset, n_local, _, _ = _model_geometry(model)
    stages = layout.get("stages")
    if isinstance(stages, list) and pp_rank < len(stages) and stages[pp_rank] != list(range(offset, offset + n_local)):
        raise CheckpointError(
            f"{layout_path}: stage {pp_rank} holds layers {stages[pp_rank]}, this model's stage "
            f"has {list(range(offset, offset + n_local))} (different pipeline split)"
        )
    sd = load_megatron_rank(path, pp_rank, ep_rank, allow_non_finite=allow_non_finite)
    inner = mtp_inner_layer_name()

    def items():
        for name, t in sd.items():
            for tgt in megatron_layout_to_ours(name, inner):
                yield f"{name} in {path}", tgt, tuple(t.shape), lambda raw=False, t=t: t

    _assign(model, items(), path)
