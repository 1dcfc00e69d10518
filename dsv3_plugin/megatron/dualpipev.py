"""Megatron-Core's `GPTModel` cut into DualPipeV's V: two model chunks per pipeline rank, rank r holding model
stages r and 2P-1-r of the 2P stages (the "cut-in-half" layout of DualPipeV; DeepSeek-V3 tech. report §3.2.1).

Megatron's own virtual pipeline (VPP = 2) puts chunk v of rank r at stage v·P + r (interleaved), so both its layer
offsets and its first/last-stage tests are wrong for the V. What this module changes, and how:

- Layer placement: `DualPipeVLayout` is a Megatron `PipelineParallelLayerLayout` (the config field
  `pipeline_model_parallel_layout` takes one; TransformerBlock, TransformerLayer and the MTP block read layer counts
  and offsets from it) whose grid holds the V: `layout[r][0]` = stage r, `layout[r][1]` = stage 2P-1-r, and whose
  offsets count layers in model order. So every decoder layer gets its global layer number (dense vs MoE, the
  final norm on the stage with layer L, dist-checkpoint keys `decoder.layers.{global}`) from Megatron's own code.
- Stage ends: the embedding lives on stage 0 (rank 0, chunk 0); final norm, output head, MTP and the loss on
  stage 2P-1 (rank 0, chunk 1), as DualPipeV puts them (inputs, labels and losses all on rank 0).
  `stage_ends(pp_rank, vp_stage, P)` gives the `pre_process` / `post_process` of a chunk.
- The embedding copy: with MTP (or tied embeddings) the last stage holds a copy of the word embedding (Megatron
  keeps the copies equal across ranks with its embedding group: zero + all-reduce at init, grad all-reduce in
  `finalize_model_grads`). In the V both copies are on rank 0, so the embedding group is rank 0 alone
  (`embedding_ranks`) and the copy is made equal at build time (`tie_embedding_copy`) and its gradient summed with
  the original's after each step (`sum_embedding_copy_grads`, the local form of Megatron's all-reduce). Both
  copies then get identical updates; Megatron's checkpoints already store the copy as a replica of the original.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from dsv3_plugin.config import ConfigError
from dsv3_plugin.parallel.pipeline.stages import split_layers

__all__ = [
    "DualPipeVLayout",
    "v_stage",
    "stage_ends",
    "stage_layer_counts",
    "embedding_ranks",
    "tie_embedding_copy",
    "sum_embedding_copy_grads",
    "shared_weights",
]


def v_stage(pp_rank: int, vp_stage: int | None, pp_size: int) -> int:
    """Model stage held by chunk `vp_stage` (0 or 1) of pipeline rank `pp_rank`: r, or 2P-1-r."""
    if vp_stage not in (0, 1):
        raise ValueError(f"DualPipeV: a pipeline rank holds model chunks 0 and 1 (got vp_stage {vp_stage!r})")
    return pp_rank if vp_stage == 0 else 2 * pp_size - 1 - pp_rank


def stage_ends(pp_rank: int, vp_stage: int | None, pp_size: int) -> tuple[bool, bool]:
    """(pre_process, post_process) of a chunk: embedding on stage 0, head/MTP/loss on stage 2P-1 (both rank 0)."""
    s = v_stage(pp_rank, vp_stage, pp_size)
    return s == 0, s == 2 * pp_size - 1


def stage_layer_counts(num_layers: int, pp_size: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Decoder layers per model stage (2P of them, model order). `first` / `last` fix stages 0 and 2P-1
    (Megatron-LM's `--decoder-first/last-pipeline-num-layers`); the rest are split as evenly as possible, the
    earlier stages taking the remainder (like `dsv3_plugin.parallel.pipeline.stages.split_layers`)."""
    n = 2 * pp_size
    fixed = {0: first, n - 1: last}
    fixed = {s: c for s, c in fixed.items() if c is not None}
    for s, c in fixed.items():
        if c < 1:
            which = "first" if s == 0 else "last"
            raise ConfigError(f"--decoder-{which}-pipeline-num-layers {c}: every DualPipeV stage needs >= 1 layer")
    rest = num_layers - sum(fixed.values())
    free = [s for s in range(n) if s not in fixed]
    if rest < len(free) or (not free and rest):
        held = f" ({sum(fixed.values())} of them in the fixed first/last stages)" if fixed else ""
        raise ConfigError(
            f"DualPipeV with --pipeline-model-parallel-size {pp_size} cuts the model into {n} stages: "
            f"{num_layers} decoder layers{held} leave a stage without a layer; use fewer pipeline "
            "ranks or more layers"
        )
    counts = [0] * n
    for s, c in fixed.items():
        counts[s] = c
    for s, r in zip(free, split_layers(rest, len(free)) if free else []):
        counts[s] = len(r)
    return counts


class DualPipeVLayout(PipelineParallelLayerLayout):
    """Megatron's pipeline layer layout for the V: `stages[s]` lists the layers of model stage s (embedding in
    stage 0; MTP layers and the loss in stage 2P-1); rank r's chunks 0 and 1 are stages r and 2P-1-r."""

    def __init__(self, stage_layers: Sequence[int], mtp_num_layers: int | None = None):
        n = len(stage_layers)
        if n < 2 or n % 2:
            raise ValueError(f"DualPipeVLayout: needs an even number (2P) of stages, got {n}")
        P = n // 2
        stages = [[LayerType.decoder] * int(c) for c in stage_layers]
        stages[0].insert(0, LayerType.embedding)
        stages[-1] += [LayerType.mtp] * int(mtp_num_layers or 0) + [LayerType.loss]
        # Megatron's flat form lists (virtual stage, pipeline rank) pairs in interleaved order, vp·P + r
        super().__init__([stages[v_stage(r, vp, P)] for vp in range(2) for r in range(P)], P)
        self.stages = stages
        self.stage_layers = [int(c) for c in stage_layers]
        self.flatten_layout = [t for s in stages for t in s]  # model order (Megatron's: interleaved)

    def __repr__(self) -> str:
        return f"DualPipeVLayout(stage_layers={self.stage_layers}, mtp={self.stages[-1].count(LayerType.mtp)})"

    def get_layer_offset(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None, pp_rank: int | None = None
    ) -> int:
        """Layers of `layer_type` before this chunk's stage, in model (V) order."""
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        s = v_stage(pp_rank, 0 if vp_stage is None else vp_stage, self.pipeline_model_parallel_size)
        return sum(stage.count(layer_type) for stage in self.stages[:s])

    def validate_layer_layout(self, num_layers: int, mtp_num_layers: int | None) -> bool:
        """Megatron's checks, in model order: one embedding first, one loss last, `num_layers` decoder layers,
        the MTP layers in the last stage after the decoder layers. Returns False (MTP is not standalone: it
        sits with the output head and the loss)."""
        flat = self.flatten_layout
        problems = []
        if flat[0] != LayerType.embedding or flat.count(LayerType.embedding) != 1:
            problems.append("the embedding must be the first layer, once")
        if flat[-1] != LayerType.loss or flat.count(LayerType.loss) != 1:
            problems.append("the loss must be the last layer, once")
        if flat.count(LayerType.decoder) != num_layers:
            problems.append(f"{flat.count(LayerType.decoder)} decoder layers for num_layers = {num_layers}")
        n_mtp = flat.count(LayerType.mtp)
        if n_mtp != (mtp_num_layers or 0) or any(LayerType.mtp in s for s in self.stages[:-1]):
            problems.append(f"{n_mtp} MTP layers (mtp_num_layers = {mtp_num_layers}), all in the last stage")
        if problems:
            raise ValueError(f"DualPipeVLayout {self.stage_layers}: " + "; ".join(problems))
        return False


def embedding_ranks(pp_ranks: list[int], *_) -> list[int]:
    """Megatron's `get_embedding_ranks` for the V: the word embedding and all its copies live on pipeline
    rank 0 (first and last stage), so its embedding group is that rank alone."""
    return [pp_ranks[0]]


def _unwrap(chunk):
    while not hasattr(chunk, "shared_embedding_or_output_weight") and hasattr(chunk, "module"):
        chunk = chunk.module  # Megatron DDP / Float16Module wrappers
    return chunk


def shared_weights(chunks) -> list[torch.nn.Parameter]:
    """The word-embedding weight of every chunk that holds one (the original on stage 0, the copy on stage
    2P-1 when MTP or tied embeddings need it), in chunk order."""
    out = []
    for chunk in chunks:
        m = _unwrap(chunk)
        config = m.config
        if not (getattr(m, "share_embeddings_and_output_weights", False) or getattr(config, "mtp_num_layers", 0)):
            continue
        w = m.shared_embedding_or_output_weight() if hasattr(m, "shared_embedding_or_output_weight") else None
        if w is not None:
            out.append(w)
    return out


_first_chunk: weakref.ref | None = None


def tie_embedding_copy(chunk, pre_process: bool, post_process: bool) -> None:
    """Called for each chunk as it is built (chunk 0 first, as Megatron's `get_model` builds them): remembers the
    stage-0 chunk; makes the stage-(2P-1) chunk's embedding copy equal to it (Megatron zero-fills the copy and
    all-reduces it over the embedding group, which in the V is this rank alone)."""
    global _first_chunk
    if pre_process:
        _first_chunk = weakref.ref(chunk)
    if not post_process or pre_process:
        return
    mine = shared_weights([chunk])
    if not mine:
        return
    first = _first_chunk() if _first_chunk is not None else None
    if first is None:
        raise RuntimeError(
            "DualPipeV: the chunk of stage 2P-1 was built before the one of stage 0 on pipeline "
            "rank 0; build chunk 0 first (Megatron's get_model does)"
        )
    src = shared_weights([first])
    if len(src) != 1 or src[0].shape != mine[0].shape:
        raise RuntimeError("DualPipeV: the stage-0 chunk has no word embedding matching the last stage's copy")
    with torch.no_grad():
        mine[0].copy_(src[0])


def sum_embedding_copy_grads(chunks) -> bool:
    """After the backward (and `finalize_model_grads`): g <- g_original + g_copy on both copies of the word
    embedding held by this rank's chunks (Megatron's embedding-group all-reduce, done locally). Returns True if
    there was a copy."""
    ws = shared_weights(chunks)
    if len(ws) < 2:
        return False
    grads = [getattr(w, "main_grad", None) if getattr(w, "main_grad", None) is not None else w.grad for w in ws]
    if any(g is None for g in grads):
        return False
    total = grads[0] + grads[1]
    for g in grads:
        g.copy_(total)
    return True
