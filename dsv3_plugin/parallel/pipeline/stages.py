"""Cut a `DSv3Model` into pipeline stages whose composition computes exactly the model's forward and loss.

Stage 0: embed_tokens + the first layers; middle stages: layers; last stage: the last layers + final norm +
lm_head + the MTP modules (which reuse embed_tokens and lm_head, paper §2.2 / §3.2.3). Stages are views of
one model instance (no copies): with DualPipe(V) rank 0 holds both the first and the last stage, so the
embedding that MTP reuses is one physical parameter there.

Design notes: docs/design_notes.md#parallel-pipeline-stages
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dsv3_plugin.model.mtp import mtp_depth_loss
from dsv3_plugin.model.packing import IGNORE_INDEX, lm_ce_sum, lm_mean, mtp_labels, mtp_rows, rope_tables
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE
from dsv3_plugin.parallel.overlap import run_overlapped
from dsv3_plugin.schedule_traits import schedule_traits

__all__ = [
    "split_layers",
    "model_stage_layers",
    "DSv3Stage",
    "overlapped_pair",
    "ep_layers",
    "build_stages",
    "stage_ids_for_rank",
    "n_stages_of",
    "min_layers",
    "DSv3PipelineLoss",
    "PipelineCESum",
    "stage_inputs",
    "sync_tied_embedding",
]


def stage_inputs(
    input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, token_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """The first stage's inputs for a micro-batch (or the gas micro-batches stacked): input_ids [N, T] int64, then
    position_ids [N, T] int64 and token_mask [N, T] bool where given (module docstring)."""
    out = [input_ids]
    if position_ids is not None:
        out.append(position_ids.to(torch.int64))
    if token_mask is not None:
        out.append(token_mask.to(torch.bool))
    return tuple(out)


def _split_extras(extras) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(position_ids, token_mask) from the tensors after input_ids, told apart by dtype."""
    pos = mask = None
    for t in extras:
        if t.dtype == torch.bool and mask is None:
            mask = t
        elif t.dtype == torch.int64 and pos is None:
            pos = t
        else:
            raise ValueError(f"pipeline stage: unexpected extra input {tuple(t.shape)}:{t.dtype} after input_ids")
    return pos, mask


def split_layers(n_layers: int, n_stages: int, tail: int = 0) -> list[range]:
    """Contiguous, as even as possible; the earlier stages take the remainder. `tail`: layer-sized slots the
    last stage spends on something else (its output head and MTP modules, see `model_stage_layers`); when they
    exceed its share, the stages before it give up the difference."""
    if n_stages < 1:
        raise ValueError(f"parallel: need >= 1 pipeline stage (got {n_stages})")
    q, r = divmod(n_layers + tail, n_stages)
    counts = [q + (1 if s < r else 0) for s in range(n_stages)]
    counts[-1] -= tail
    for s in range(n_stages - 1, 0, -1):  # a negative count: its deficit moves to the stage before
        if counts[s] < 0:
            counts[s - 1] += counts[s]
            counts[s] = 0
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def model_stage_layers(n_layers: int, mtp_depth: int, n_stages: int) -> list[range]:
    """The one split of a DSv3Model's decoder layers into pipeline stages (pipeline builders, rank-local
    building and loading, the memory plan): the last stage's output head and its D MTP modules (each a decoder
    block, paper §2.2) count as D + 1 layers.

    NOTE: DeepSeek-V3's report does not publish its stage boundaries; this rule reproduces the published
    Megatron DeepSeek-V3 recipes' uneven layouts: 61 layers + 1 MTP over 16 stages -> embedding + 4 | 4 x 14 |
    1 + MTP + head (over 8: 8 | 8 x 6 | 5 + MTP + head; over 4: 16 | 16 | 16 | 13 + MTP + head)."""
    return split_layers(n_layers, n_stages, tail=1 + mtp_depth)


def stage_ids_for_rank(schedule: str, pp: int, rank: int) -> list[int]:
    """Which model stages pipeline rank `rank` holds, in chunk order."""
    return schedule_traits(schedule, "parallel.schedule").stage_ids(pp, rank)


def n_stages_of(schedule: str, pp: int) -> int:
    return schedule_traits(schedule, "parallel.schedule").n_stages(pp)


def min_layers(schedule: str, pp: int, mtp_depth: int = 0) -> int:
    """The fewest decoder layers with which no pipeline rank is left without parameters under
    `model_stage_layers`: a rank holding neither the first stage (embedding) nor the last (head, MTP) needs
    one of its stages to have a layer."""
    t = schedule_traits(schedule, "parallel.schedule")
    n, last = t.n_stages(pp), t.n_stages(pp) - 1
    bare = [ids for ids in (t.stage_ids(pp, r) for r in range(pp)) if 0 not in ids and last not in ids]
    L = 0
    while True:  # terminates: with n * (mtp_depth + 2) layers every stage has one
        ranges = model_stage_layers(L, mtp_depth, n)
        if all(any(len(ranges[s]) for s in ids) for ids in bare):
            return L
        L += 1


def ep_layers(module: nn.Module) -> list[ExpertParallelMoE]:
    """The expert-parallel MoE layers of `module` that communicate (EP over more than one rank)."""
    return [m for m in module.modules() if isinstance(m, ExpertParallelMoE) and m.groups.ep_size > 1]


def _needs_lockstep(layers: list[ExpertParallelMoE], module: nn.Module) -> bool:
    """The pair's lanes pass the turn in program order (`overlap`, "lockstep") on CUDA (NCCL: communicators
    used concurrently must see their collectives in the same order on every rank, so the issue order must not
    depend on timing; a wait does not block the host there anyway) and where a layer's groups have no second
    group for the backward lane; else they take turns as their all-to-alls arrive."""
    p = next(module.parameters(), None)
    if p is not None and p.device.type == "cuda":
        return True
    return any(
        m.groups.ep_group_b is None or (m.groups.ranks_per_node > 1 and m.groups.node_group_b is None) for m in layers
    )


class DSv3Stage(nn.Module):
    """Decoder layers [+ embedding] [+ final norm, head, MTP] of one pipeline stage (module docstring).

    Chunk anatomy (paper §3.2.1): each MoE layer's forward is attention (norm, MLA, residual, norm, router) ->
    dispatch (all-to-all) -> MLP (shared experts while the tokens travel, then the routed experts) -> combine
    (all-to-all); its backward is the same in reverse. The all-to-alls are started and waited for separately
    (`dispatch.exchange_start`), which is where `overlapped_forward_backward` interleaves two chunks."""

    def __init__(self, model: DSv3Model, layer_ids: range, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.layer_ids = list(layer_ids)
        self.layers = nn.ModuleList(model.layers[i] for i in layer_ids)
        moe = model.moe_layers()
        self.n_moe = len(moe)
        where = {id(m): j for j, m in enumerate(moe)}
        self.moe_slot = [where.get(id(layer.mlp), -1) for layer in self.layers]
        self.rotary = model.rotary
        self.mtp_reuses_embedding = len(model.mtp) > 0
        if first or (last and len(model.mtp)):
            self.embed_tokens = model.embed_tokens
        if last:
            self.norm, self.lm_head, self.mtp = model.norm, model.lm_head, model.mtp
            self.mtp_slot = [where.get(id(m.layer.mlp), -1) for m in model.mtp]

    @staticmethod
    def _record(aux_M, produced_M, slot, mlp):
        if slot < 0 or getattr(mlp, "aux_loss", None) is None:
            return aux_M, produced_M
        aux_M = aux_M.clone()
        aux_M[slot] = mlp.aux_loss
        produced_M = produced_M.clone()
        produced_M[slot] = True
        return aux_M, produced_M

    def forward(self, *msg: torch.Tensor):
        if self.first:
            input_ids, *extras = msg
            x = self.embed_tokens(input_ids)
            aux_M = torch.zeros(self.n_moe, dtype=torch.float32, device=x.device)
            produced_M = torch.zeros(self.n_moe, dtype=torch.bool, device=x.device)
        else:
            x, aux_M, produced_M, input_ids, *extras = msg
        position_ids, token_mask = _split_extras(extras)
        T = input_ids.shape[1]
        if position_ids is None:
            cos, sin = self.rotary(torch.arange(T, device=x.device), x.dtype)
            attn_mask = None
        else:
            cos, sin, attn_mask = rope_tables(self.rotary, T, position_ids, x.device, x.dtype)
        for layer, slot in zip(self.layers, self.moe_slot):
            if attn_mask is None and token_mask is None:
                x = layer(x, cos, sin)
            else:
                x = layer(x, cos, sin, attn_mask, token_mask)
            aux_M, produced_M = self._record(aux_M, produced_M, slot, layer.mlp)
        if not self.last:
            return (x, aux_M, produced_M, input_ids, *extras)
        hidden = self.norm(x)
        logits = self.lm_head(hidden)
        mtp_logits, h_prev = [], hidden
        for k, (mtp, slot) in enumerate(zip(self.mtp, self.mtp_slot), start=1):
            S = T - k
            if S <= 0:
                break
            emb = self.embed_tokens(input_ids[:, k:])  # Emb(t_{i+k}), [B, S, H]
            h_prev = mtp(h_prev[:, :S], emb, *mtp_rows(cos, sin, attn_mask, token_mask, k))  # h^k, [B, S, H]
            aux_M, produced_M = self._record(aux_M, produced_M, slot, mtp.layer.mlp)
            mtp_logits.append(self.lm_head(mtp.norm(h_prev)))  # [B, S, V]
        return (logits, *mtp_logits, aux_M, produced_M)

    @classmethod
    def overlapped_forward_backward(cls, f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads):
        """The runtime's overlap hook for FB ops: `overlapped_pair`."""
        return overlapped_pair(f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads)


def overlapped_pair(f_module, f_inputs, f_loss_fn, b_module, b_loss, b_outputs, b_grads):
    """DualPipe's overlapped pair (paper §3.2.1, Fig. 4): the forward of `f_module` and the backward of `b_module`
    run as the two lanes of `parallel.overlap.run_overlapped`, so each chunk's dispatch / combine all-to-alls travel
    while the other chunk computes. Same ops as F then B on each chunk (bit-identical losses and gradients). Any
    stage module whose MoE layers are `ExpertParallelMoE` qualifies (ours, and a Megatron chunk built with the
    plugin's layers); without EP communication in either chunk: F then B.

    Args:
        f_module: the stage module run forward, on `f_inputs` (a tuple of tensors).
        f_loss_fn: None, or a function of the forward's outputs giving the micro-batch loss (last stages).
        b_module: the stage module whose backward runs: from `b_loss` (a scalar) when not None, else from its
            `b_outputs` with the received gradients `b_grads`.

    Returns:
        (the forward's outputs, its loss or None)."""

    def forward():
        outs = f_module(*f_inputs)
        return outs, (f_loss_fn(outs) if f_loss_fn is not None else None)

    def backward():
        if b_loss is not None:
            b_loss.backward()
        elif b_outputs:
            torch.autograd.backward(b_outputs, b_grads)

    layers = ep_layers(f_module) + ep_layers(b_module)
    if not layers:
        res = forward()
        backward()
        return res
    return run_overlapped(forward, backward, lockstep=_needs_lockstep(layers, f_module))


def build_stages(model: DSv3Model, n_stages: int, stage_ids: Sequence[int] | None = None) -> list[DSv3Stage]:
    """Stages `stage_ids` (default: all) of `model` cut into `n_stages`. Modules of other stages are not
    referenced by the result (drop the model to free them)."""
    ranges = model_stage_layers(len(model.layers), len(model.mtp), n_stages)
    ids = list(range(n_stages)) if stage_ids is None else list(stage_ids)
    return [DSv3Stage(model, ranges[s], s == 0, s == n_stages - 1) for s in ids]


class DSv3PipelineLoss:
    """criterion(logits, *mtp_logits, aux_M, produced_M, labels[, position_ids]) -> loss, the same sum as DSv3Model:
    lm_loss + λ·mtp_loss + balance_loss. `with_positions`: the runtime passes the micro-batch's position_ids after
    its labels (packed rows: the MTP targets outside a position's document are ignored). Per-micro-batch parts are
    appended to `records` (detached)."""

    def __init__(self, model_or_cfg, tokens_seen: float = 0.0, scale: float = 1.0, with_positions: bool = False):
        self.cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
        self.tokens_seen = tokens_seen
        self.scale = scale  # e.g. 1/num_chunks to average micro-batches in the backward
        self.with_positions = with_positions
        self.records: list[dict] = []

    def __call__(self, logits, *rest):
        position_ids = None
        if self.with_positions:
            *rest, position_ids = rest
        *mtp_logits, aux_M, produced_M, labels = rest
        T = labels.shape[1]
        n_loss = (labels != IGNORE_INDEX).sum()  # as DSv3Model._losses: B·T when nothing is masked
        lm_loss = lm_mean(logits, labels, n_loss)
        loss = lm_loss
        mtp_loss = balance = None
        if mtp_logits:
            depth = [
                mtp_depth_loss(lg, mtp_labels(labels, k, position_ids), T, n_loss) for k, lg in enumerate(mtp_logits, 1)
            ]
            mtp_loss = torch.stack(depth).mean()
            loss = loss + self.cfg.mtp.lam(self.tokens_seen) * mtp_loss
        if bool(produced_M.any()):
            balance = aux_M[produced_M].sum()
            loss = loss + balance
        self.records.append(
            {
                "loss": loss.detach(),
                "lm_loss": lm_loss.detach(),
                "mtp_loss": None if mtp_loss is None else mtp_loss.detach(),
                "balance_loss": None if balance is None else balance.detach(),
            }
        )
        return loss * self.scale if self.scale != 1.0 else loss


class PipelineCESum:
    """Forward-only criterion: criterion(logits, *mtp_logits, aux_M, produced_M, labels) -> the LM cross-entropy
    summed over the micro-batch's loss tokens (fp32, 0-dim); the MTP logits and balance terms are not read."""

    def __call__(self, logits, *rest):
        return lm_ce_sum(logits, rest[-1])


def sync_tied_embedding(runtime, stages: Sequence[DSv3Stage]) -> bool:
    """1F1B / ZB1P with MTP: the embedding lives on the first *and* the last pipeline rank (MTP reuses it,
    §2.2), as two copies; sum their gradients (own + peer's: the same IEEE sum on both ranks, so the copies
    stay identical). DualPipe(V) need nothing here: both uses sit on rank 0, one parameter. Call after
    `runtime.step(...)` in training. Returns True if this rank took part."""
    import torch.distributed as dist

    if not runtime.traits.first_and_last_apart(runtime.P) or not stages[0].mtp_reuses_embedding:
        return False
    last = runtime.P - 1
    if runtime.rank not in (0, last):
        return False
    weight = stages[0].embed_tokens.weight
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    other = torch.empty_like(grad)
    peer = runtime.pipe_to_global[last if runtime.rank == 0 else 0]
    works = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, grad.contiguous(), peer, group=runtime.group),
            dist.P2POp(dist.irecv, other, peer, group=runtime.group),
        ]
    )
    for w in works:
        runtime.p2p._wait(w, "tied-embedding gradient sync between the first and last pipeline ranks")
    weight.grad = grad + other
    return True
