"""Megatron-Core's `GPTModel` as two model chunks per pipeline rank, for DualPipeV and DualPipe: the V (rank r holding
model stages r and 2P-1-r of 2P stages: the "cut-in-half" layout of DualPipeV; DeepSeek-V3 tech. report §3.2.1) and
DualPipe's two mirrored model copies (rank r: stage r of copy A, stage P-1-r of copy B; §3.2.1, Fig. 5).

Megatron's own virtual pipeline (VPP = 2) puts chunk v of rank r at stage v·P + r (interleaved), so both its layer
offsets and its first/last-stage tests are wrong for the V. This module supplies the layer placement
(`DualPipeVLayout`, a Megatron `PipelineParallelLayerLayout`), the stage ends (`stage_ends`), and the embedding
copy on the last stage kept equal to the original (`embedding_ranks`, `tie_embedding_copy`,
`sum_embedding_copy_grads`).

Design notes: docs/design_notes.md#megatron-dualpipev
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
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
    "DualPipeLayout",
    "mirror_stage",
    "chunk_stage_ends",
    "remember_chunk",
    "init_mirror_copy",
    "mark_mirror_copy",
    "sum_mirror_grads",
    "copy_checksums",
]


def v_stage(pp_rank: int, vp_stage: int | None, pp_size: int) -> int:
    """Model stage held by chunk `vp_stage` (0 or 1) of pipeline rank `pp_rank`: r, or 2P-1-r."""
    if vp_stage not in (0, 1):
        raise ValueError(f"DualPipeV: a pipeline rank holds model chunks 0 and 1 (got vp_stage {vp_stage!r})")
    return pp_rank if vp_stage == 0 else 2 * pp_size - 1 - pp_rank


def stage_ends(pp_rank: int, vp_stage: int | None, pp_size: int, schedule: str = "dualpipev") -> tuple[bool, bool]:
    """(pre_process, post_process) of a chunk: embedding on stage 0, head/MTP/loss on stage 2P-1 (both rank 0);
    for `schedule` "dualpipe", `chunk_stage_ends` (each copy's stage 0 and P-1)."""
    if schedule == "dualpipe":
        return chunk_stage_ends(pp_rank, vp_stage, pp_size)
    s = v_stage(pp_rank, vp_stage, pp_size)
    return s == 0, s == 2 * pp_size - 1


def stage_layer_counts(
    num_layers: int,
    pp_size: int,
    first: int | None = None,
    last: int | None = None,
    n_stages: int | None = None,
    schedule: str = "DualPipeV",
) -> list[int]:
    """Decoder layers per model stage (`n_stages` of them, default 2P: the V; model order). `first` / `last` fix
    the first and last stage (Megatron-LM's `--decoder-first/last-pipeline-num-layers`); the rest are split as
    evenly as possible, the earlier stages taking the remainder (like `dsv3_plugin.parallel.pipeline.stages.
    split_layers`). `schedule` names the layout in errors."""
    n = 2 * pp_size if n_stages is None else n_stages
    fixed = {0: first, n - 1: last}
    fixed = {s: c for s, c in fixed.items() if c is not None}
    for s, c in fixed.items():
        if c < 1:
            which = "first" if s == 0 else "last"
            raise ConfigError(f"--decoder-{which}-pipeline-num-layers {c}: every {schedule} stage needs >= 1 layer")
    rest = num_layers - sum(fixed.values())
    free = [s for s in range(n) if s not in fixed]
    if rest < len(free) or (not free and rest):
        held = f" ({sum(fixed.values())} of them in the fixed first/last stages)" if fixed else ""
        raise ConfigError(
            f"{schedule} with --pipeline-model-parallel-size {pp_size} cuts the model into {n} stages: "
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
        P = self.ranks_for(n)
        stages = [[LayerType.decoder] * int(c) for c in stage_layers]
        stages[0].insert(0, LayerType.embedding)
        stages[-1] += [LayerType.mtp] * int(mtp_num_layers or 0) + [LayerType.loss]
        # Megatron's flat form lists (virtual stage, pipeline rank) pairs in interleaved order, vp·P + r
        super().__init__([stages[self.chunk_stage(r, vp, P)] for vp in range(2) for r in range(P)], P)
        self.stages = stages
        self.stage_layers = [int(c) for c in stage_layers]
        self.flatten_layout = [t for s in stages for t in s]  # model order (Megatron's: interleaved)

    @staticmethod
    def ranks_for(n_stages: int) -> int:
        """Pipeline ranks for `n_stages` model stages: half of them (the V folds 2P stages onto P ranks)."""
        if n_stages < 2 or n_stages % 2:
            raise ValueError(f"DualPipeVLayout: needs an even number (2P) of stages, got {n_stages}")
        return n_stages // 2

    @staticmethod
    def chunk_stage(pp_rank: int, vp_stage: int | None, pp_size: int) -> int:
        """Model stage of chunk `vp_stage` of pipeline rank `pp_rank` (`v_stage`)."""
        return v_stage(pp_rank, vp_stage, pp_size)

    @staticmethod
    def for_schedule(schedule: str, stage_layers: Sequence[int], mtp_num_layers: int | None = None):
        """The layout of `schedule`: `DualPipeVLayout` (2P stages) or, for "dualpipe", `DualPipeLayout` (P)."""
        cls = DualPipeLayout if schedule == "dualpipe" else DualPipeVLayout
        return cls(stage_layers, mtp_num_layers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage_layers={self.stage_layers}, mtp={self.stages[-1].count(LayerType.mtp)})"

    def get_layer_offset(
        self, layer_type: LayerType = LayerType.decoder, vp_stage: int | None = None, pp_rank: int | None = None
    ) -> int:
        """Layers of `layer_type` before this chunk's stage, in model (V) order."""
        if pp_rank is None:
            from megatron.core import parallel_state

            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        s = self.chunk_stage(pp_rank, 0 if vp_stage is None else vp_stage, self.pipeline_model_parallel_size)
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
            raise ValueError(f"{type(self).__name__} {self.stage_layers}: " + "; ".join(problems))
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


def tie_embedding_copy(
    chunk, pre_process: bool, post_process: bool, vp_stage: int | None = None, schedule: str = "dualpipev"
) -> None:
    """Called for each chunk as it is built (chunk 0 first, as Megatron's `get_model` builds them): remembers the
    stage-0 chunk; makes the stage-(2P-1) chunk's embedding copy equal to it (Megatron zero-fills the copy and
    all-reduces it over the embedding group, which in the V is this rank alone). For `schedule` "dualpipe"
    (`vp_stage` given): remembers chunk 0 and, when chunk 1 is built, makes copy B equal to copy A
    (`init_mirror_copy`, a collective with the mirror rank) and marks it as A's replica (`mark_mirror_copy`)."""
    if schedule == "dualpipe":
        remember_chunk(chunk, vp_stage)
        if vp_stage == 1:
            init_mirror_copy(chunk)
            mark_mirror_copy(chunk)
        return
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


# --- DualPipe: two mirrored copies -------------------------------------------------------------------------------


def mirror_stage(pp_rank: int, vp_stage: int | None, pp_size: int) -> int:
    """Model stage of chunk `vp_stage` of pipeline rank `pp_rank`: r (copy A), or P-1-r (copy B)."""
    if vp_stage not in (0, 1):
        raise ValueError(f"DualPipe: a pipeline rank holds model chunks 0 and 1 (got vp_stage {vp_stage!r})")
    return pp_rank if vp_stage == 0 else pp_size - 1 - pp_rank


def chunk_stage_ends(pp_rank: int, vp_stage: int | None, pp_size: int) -> tuple[bool, bool]:
    """(pre_process, post_process) of a chunk: embedding on stage 0, head/MTP/loss on stage P-1 of each copy."""
    s = mirror_stage(pp_rank, vp_stage, pp_size)
    return s == 0, s == pp_size - 1


class DualPipeLayout(DualPipeVLayout):
    """Megatron's pipeline layer layout for DualPipe: `stages[s]` lists the layers of stage s of one copy (P
    stages); rank r's chunks 0 and 1 are stage r (copy A) and stage P-1-r (copy B)."""

    @staticmethod
    def ranks_for(n_stages: int) -> int:
        if n_stages < 2 or n_stages % 2:
            raise ValueError(f"DualPipeLayout: needs an even number of stages (P, one per rank), got {n_stages}")
        return n_stages

    @staticmethod
    def chunk_stage(pp_rank: int, vp_stage: int | None, pp_size: int) -> int:
        return mirror_stage(pp_rank, vp_stage, pp_size)


def _params(chunk) -> list[torch.nn.Parameter]:
    return [p for p in chunk.parameters()]


_chunk0: weakref.ref | None = None


def remember_chunk(chunk, vp_stage: int) -> None:
    """Called for chunk 0 as it is built (Megatron's `get_model` builds chunk 0 first): `init_mirror_copy` reads
    it when chunk 1 is built."""
    global _chunk0
    if vp_stage == 0:
        _chunk0 = weakref.ref(chunk)


def _pp():
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    return group, ps.get_pipeline_model_parallel_rank(), dist.get_world_size(group)


def _exchange(flat: torch.Tensor, numel: int, peer: int, group) -> torch.Tensor:
    """Send `flat` to global rank `peer` and receive its `numel` values (one batched pair, so that neither side
    blocks the other under NCCL)."""
    other = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, flat, peer, group=group), dist.P2POp(dist.irecv, other, peer, group=group)]
    )
    for w in works:
        w.wait()
    return other


def init_mirror_copy(chunk1) -> None:
    """When chunk 1 (copy B's stage P-1-r) is built: exchange with the mirror rank so that every copy-B stage equals
    the copy-A stage the mirror built, then set each embedding copy for MTP / tied heads to the embedding held on
    the same rank. A collective of the two mirror ranks (every rank builds its chunk 1)."""
    first = _chunk0() if _chunk0 is not None else None
    if first is None:
        raise RuntimeError(
            "DualPipe: chunk 1 was built before chunk 0 on this rank (Megatron's get_model builds 0 first)"
        )
    group, r, P = _pp()
    peer = dist.get_process_group_ranks(group)[P - 1 - r]
    mine, into = _params(first), _params(chunk1)
    dtypes = {p.dtype for p in mine + into}
    if len(dtypes) != 1:
        raise RuntimeError(f"DualPipe: model chunks with several parameter dtypes {sorted(map(str, dtypes))}")
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in mine])
        got = _exchange(flat, sum(p.numel() for p in into), peer, group)
        off = 0
        for p in into:
            p.copy_(got[off : off + p.numel()].view_as(p))
            off += p.numel()
        # the end ranks: one chunk holds an embedding (pre_process), the other a copy of it (MTP / tied head)
        ws = shared_weights([first, chunk1])
        if len(ws) == 2:
            src = ws[0] if getattr(_unwrap_model(first), "pre_process", False) else ws[1]
            for w in ws:
                if w is not src:
                    w.copy_(src)


def _unwrap_model(chunk):
    while not hasattr(chunk, "pre_process") and hasattr(chunk, "module"):
        chunk = chunk.module  # Megatron DDP / Float16Module wrappers
    return chunk


def mark_mirror_copy(chunk1) -> None:
    """Copy B's chunk: its parameters are `shared` (left out of Megatron's gradient norm and zero counts: copy A
    counts each tensor once), and its dist-checkpoint entries get non-main replica ids (saved by copy A only,
    loaded into both)."""
    for p in chunk1.parameters():
        p.shared = True
    inner = chunk1.sharded_state_dict

    def sharded_state_dict(*args, **kwargs):
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

        sd = inner(*args, **kwargs)

        def bump(x):
            rid = getattr(x, "replica_id", None)
            if rid is None:
                return x
            x.replica_id = (rid[0] + 2, *rid[1:]) if isinstance(rid, tuple) else (rid + 2,)
            return x

        return dict_list_map_inplace(bump, sd)

    chunk1.sharded_state_dict = sharded_state_dict


def _grads(params) -> list[torch.Tensor]:
    out = []
    for p in params:
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        out.append(g)
    return out


def _routers(chunk) -> list:
    return [m for m in chunk.modules() if hasattr(m, "local_tokens_per_expert")]


def sum_mirror_grads(chunks, rank: int, P: int, group, stage_of) -> float:
    """After the backward, before `finalize_model_grads`: every gradient (Megatron's `main_grad` when DDP keeps one)
    and every router's token counts <- own + the mirror rank's, for the stages both hold. `stage_of(c)` is the
    model stage of local chunk c; `group` the pipeline group. Returns the seconds it took."""
    t0 = time.perf_counter()
    order = sorted(range(len(chunks)), key=stage_of)  # the mirror lists the same stages in the same order
    params = [p for c in order for p in chunks[c].parameters() if p.requires_grad]
    grads = _grads(params)
    counts = [m.local_tokens_per_expert for c in order for m in _routers(chunks[c])]
    peer = dist.get_process_group_ranks(group)[P - 1 - rank]
    with torch.no_grad():
        parts = [g if g is not None else torch.zeros_like(p) for p, g in zip(params, grads)]
        flat = torch.cat([t.reshape(-1).to(parts[0].dtype) for t in parts]) if parts else None
        if flat is not None:
            total = flat + _exchange(flat, flat.numel(), peer, group)
            off = 0
            for p, g in zip(params, grads):
                n = p.numel()
                if g is not None:
                    g.copy_(total[off : off + n].view_as(g))
                else:
                    p.grad = total[off : off + n].view_as(p).clone()
                off += n
        if counts:
            tc = torch.cat([c.reshape(-1).double() for c in counts])
            tc = tc + _exchange(tc, tc.numel(), peer, group)
            off = 0
            for c in counts:
                c.copy_(tc[off : off + c.numel()].view_as(c).to(c.dtype))
                off += c.numel()
    return time.perf_counter() - t0


def copy_checksums(model, pp_rank: int, pp_size: int) -> list[tuple[str, int, float]]:
    """(copy "A" or "B", model stage, float64 sum of the chunk's parameters and floating buffers) per local chunk:
    the copies of a stage are identical iff (to that checksum) their sums are equal."""
    out = []
    for vp, chunk in enumerate(model):
        s = mirror_stage(pp_rank, vp, pp_size)
        # nn.Module's own methods: Megatron's DDP wrapper keeps a list under the name `buffers`
        total = sum(float(p.detach().double().sum()) for p in torch.nn.Module.parameters(chunk))
        bufs = torch.nn.Module.buffers(chunk)
        total += sum(float(b.detach().double().sum()) for b in bufs if b.is_floating_point())
        out.append(("A" if vp == 0 else "B", s, total))
    return out
