"""All-to-all token dispatch and combine for expert parallelism (paper §3.2.2), plain and node-deduplicated.

EP rank j of P holds routed experts [j*L, (j+1)*L), L = E/P; dispatch moves token copies to the owners of the
K selected experts, and combine brings the weighted outputs back:

    out_t = sum_k w_{t,k} * FFN_{e_{t,k}}(x_t)                      (paper eq. 12, routed part)

Design notes (the two modes, nodes, the FP8 payload): docs/design_notes.md#parallel-dispatch
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from dsv3_plugin.config import ConfigError
from dsv3_plugin.model.moe.layer import combine_rows
from dsv3_plugin.parallel import overlap
from dsv3_plugin.parallel.groups import EPGroups, single_process_groups
from dsv3_plugin.precision.fp8 import quant as fp8

__all__ = [
    "DispatchCodec",
    "IdentityCodec",
    "BF16Codec",
    "FP8Codec",
    "codec_from_config",
    "AllToAll",
    "all_to_all",
    "exchange_start",
    "PendingExchange",
    "DispatchStats",
    "moe_dispatch_combine",
    "count_cross_node_copies",
]

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_NH, local_expert_N) -> y_NH


class DispatchCodec(Protocol):
    """Encoding of the dispatch payload. `encode(x_NH)` returns row-aligned tensors (leading dim N, any
    dtype gloo/NCCL can move); `decode(parts, H, dtype)` rebuilds x_NH; `bytes_per_row(H, elem)` is the wire
    size of one token (used by the copy/byte counters)."""

    def encode(self, x_NH: torch.Tensor) -> list[torch.Tensor]: ...

    def decode(self, parts: Sequence[torch.Tensor], hidden: int, dtype: torch.dtype) -> torch.Tensor: ...

    def bytes_per_row(self, hidden: int, elem_size: int) -> int: ...


class IdentityCodec:
    """Send activations as they are."""

    def encode(self, x_NH):
        return [x_NH]

    def decode(self, parts, hidden, dtype):
        return parts[0].to(dtype)

    def bytes_per_row(self, hidden, elem_size):
        return hidden * elem_size


class BF16Codec:
    """Send activations in BF16 (half the fp32 bytes); gradients still flow in full precision."""

    def encode(self, x_NH):
        return [x_NH.to(torch.bfloat16)]

    def decode(self, parts, hidden, dtype):
        return parts[0].to(dtype)

    def bytes_per_row(self, hidden, elem_size):
        return hidden * 2


class FP8Codec:
    """`fp8.dispatch`: per-token 1x128 tiles in FP8 E4M3 with power-of-2 scales, packed as one uint8 row per
    token (the FP8 module's `pack_dispatch` / `unpack_dispatch`, paper §3.3.4). Decoded to the activation
    dtype on arrival; gradients and the combine stay in full precision."""

    def __init__(self):
        try:
            self._pack, self._unpack = fp8.pack_dispatch, fp8.unpack_dispatch
        except (ImportError, AttributeError):
            raise ConfigError(
                "dsv3.fp8.dispatch: this build has no FP8 dispatch quantizer "
                "(dsv3_plugin.precision.fp8.quant.pack_dispatch); set fp8.dispatch = false"
            ) from None

    def encode(self, x_NH):
        return [self._pack(x_NH)]

    def decode(self, parts, hidden, dtype):
        return self._unpack(parts[0], hidden, dtype)

    def bytes_per_row(self, hidden, elem_size):
        return hidden + 4 * -(-hidden // 128)


def codec_from_config(cfg) -> DispatchCodec | None:
    """The dispatch payload codec a `DSv3Config` asks for (`fp8.dispatch`), or None (send as is)."""
    return FP8Codec() if cfg.fp8.dispatch else None


# ---------------------------------------------------------------------------------------------------
# autograd all-to-all with variable split sizes


def _a2a_start(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
    """Issue one all-to-all with `async_op=True`: (receive buffer, work). The buffer is valid after
    `work.wait()` (on CUDA/NCCL: for the streams that waited)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    # gloo has no all-to-all for bool or 8-bit floats: move their bytes.
    if x.dtype == torch.bool or x.element_size() == 1 and x.dtype != torch.uint8:
        work = dist.all_to_all_single(
            out.view(torch.uint8), x.contiguous().view(torch.uint8), out_splits, in_splits, group=group, async_op=True
        )
    else:
        work = dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return out, work


def _a2a_raw(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out, work = _a2a_start(x, out_splits, in_splits, group)
    work.wait()
    return out


class AllToAll(torch.autograd.Function):
    """Rows of `x` split by `in_splits` go to the group's ranks; `out_splits` rows arrive from each.
    Backward sends the gradient rows back along the same routes (the transposed all-to-all). Synchronous:
    `exchange_start` is the same exchange started and waited for separately."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, codec=None):
        ctx.splits = (list(out_splits), list(in_splits))
        ctx.group = group
        if codec is None:
            return _a2a_raw(x, list(out_splits), list(in_splits), group)
        parts = [_a2a_raw(p, list(out_splits), list(in_splits), group) for p in codec.encode(x)]
        return codec.decode(parts, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _a2a_raw(grad, in_splits, out_splits, ctx.group), None, None, None, None


def all_to_all(
    x: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group,
    group_size: int,
    codec: DispatchCodec | None = None,
) -> torch.Tensor:
    """Differentiable variable-split all-to-all; a no-op copy-free path for a group of one."""
    if group_size == 1:
        if codec is not None and not isinstance(codec, IdentityCodec):
            return _StraightThrough.apply(x, codec)
        return x
    return AllToAll.apply(x, out_splits, in_splits, group, codec)


class _StraightThrough(torch.autograd.Function):
    """Codec round trip without communication (EP=1 / self-sends): same numerics as a real dispatch."""

    @staticmethod
    def forward(ctx, x, codec):
        return codec.decode(codec.encode(x), x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Exchange:
    """One asynchronous all-to-all step of several row-aligned tensors along the same routes (e.g. the
    dispatched activations, their local expert ids and routing weights): started in forward, waited for
    later; its backward likewise starts the transposed all-to-all of the gradients and waits for it later.
    Floating tensors are differentiable, the others travel as data. In an overlapped pair the waits let the
    other lane compute (`overlap.wait_comm`), and the B lane communicates on `b_lane_group`, a second group of
    the same ranks (`overlap.lane_group`)."""

    def __init__(self, out_splits, in_splits, group, codecs, kind: str, b_lane_group=None):
        self.out_splits, self.in_splits = list(out_splits), list(in_splits)
        self.group, self.b_lane_group, self.codecs, self.kind = group, b_lane_group, codecs, kind
        self._fwd = self._bwd = None  # per tensor: the (receive buffer, work) pairs in flight

    def start_forward(self, tensors: Sequence[torch.Tensor]) -> None:
        self.hidden_and_dtype = [(t.shape[1] if t.dim() > 1 else 0, t.dtype) for t in tensors]
        sends = [codec.encode(t) if codec is not None else [t] for t, codec in zip(tensors, self.codecs)]
        lane = overlap.lane_group(self.group, self.b_lane_group)
        self._fwd = [[_a2a_start(part, self.out_splits, self.in_splits, lane) for part in parts] for parts in sends]
        overlap.comm_started(self.kind, "F", [work for parts in self._fwd for _, work in parts])

    def finish_forward(self) -> list[torch.Tensor]:
        overlap.wait_comm([work for parts in self._fwd for _, work in parts], self.kind, "F")
        out = []
        for parts, codec, (hidden, dtype) in zip(self._fwd, self.codecs, self.hidden_and_dtype):
            buffers = [buffer for buffer, _ in parts]
            out.append(codec.decode(buffers, hidden, dtype) if codec is not None else buffers[0])
        self._fwd = None
        return out

    def start_backward(self, grads: Sequence[torch.Tensor | None]) -> None:
        # the transposed routes; gradients travel in full precision (straight through the codec)
        lane = overlap.lane_group(self.group, self.b_lane_group)
        self._bwd = [
            None if grad is None else _a2a_start(grad, self.in_splits, self.out_splits, lane) for grad in grads
        ]
        overlap.comm_started(self.kind, "B", [work for _, work in filter(None, self._bwd)])

    def finish_backward(self) -> list[torch.Tensor | None]:
        overlap.wait_comm([work for _, work in filter(None, self._bwd)], self.kind, "B")
        out = [None if in_flight is None else in_flight[0] for in_flight in self._bwd]
        self._bwd = None
        return out


class _ExchangeStart(torch.autograd.Function):
    """Forward: issue the exchange, return an empty token that links the inputs to `_ExchangeWait` in the
    graph. Backward (runs after `_ExchangeWait`'s, which started the gradients' all-to-all): wait for it."""

    @staticmethod
    def forward(ctx, op: _Exchange, *tensors):
        ctx.op = op
        ctx.differentiable = [t.is_floating_point() for t in tensors]
        op.start_forward(tensors)
        return tensors[0].new_empty(0, dtype=torch.float32)

    @staticmethod
    def backward(ctx, _token_grad):
        grads = ctx.op.finish_backward()
        return (None, *(grad if differentiable else None for grad, differentiable in zip(grads, ctx.differentiable)))


class _ExchangeWait(torch.autograd.Function):
    """Forward: wait for the exchange, return the received tensors. Backward: start the gradients' transposed
    all-to-all and return at once (autograd runs other ready work, e.g. the shared experts' backward, while it
    travels; `_ExchangeStart.backward` waits)."""

    @staticmethod
    def forward(ctx, op: _Exchange, token):
        ctx.op, ctx.device = op, token.device
        outs = op.finish_forward()
        ctx.differentiable = [t.is_floating_point() for t in outs]
        ctx.mark_non_differentiable(*(t for t in outs if not t.is_floating_point()))
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.op.start_backward(
            [
                grad.contiguous() if differentiable and grad is not None else None
                for grad, differentiable in zip(grads, ctx.differentiable)
            ]
        )
        return None, torch.empty(0, dtype=torch.float32, device=ctx.device)


class PendingExchange:
    """Handle of a started `exchange_start`: `wait()` returns the received tensors (differentiable)."""

    def __init__(self, op: _Exchange | None, token=None, ready: list | None = None):
        self._op, self._token, self._ready = op, token, ready

    def wait(self) -> list[torch.Tensor]:
        if self._ready is not None:
            return self._ready
        outs = _ExchangeWait.apply(self._op, self._token)
        self._op = self._token = None
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def exchange_start(
    tensors: Sequence[torch.Tensor],
    out_splits: list[int],
    in_splits: list[int],
    group,
    group_size: int,
    codecs: Sequence[DispatchCodec | None] | None = None,
    kind: str = "dispatch",
    b_lane_group=None,
) -> PendingExchange:
    """Start the variable-split all-to-all of row-aligned `tensors` (async: `async_op=True`); `.wait()` on the
    result returns what arrived, with the numerics of `all_to_all` on each (forward and backward). `codecs[i]`
    encodes tensor i's payload (e.g. FP8 dispatch); `kind` ("dispatch" / "combine") names the exchange for
    the overlap accounting; `b_lane_group`: a second group of the same ranks, for the B lane of an overlapped
    pair (`overlap.lane_group`). A group of one moves nothing (codec round trip only)."""
    codecs = list(codecs) if codecs is not None else [None] * len(tensors)
    if group_size == 1:
        return PendingExchange(
            None,
            ready=[all_to_all(t, out_splits, in_splits, group, 1, codec) for t, codec in zip(tensors, codecs)],
        )
    op = _Exchange(out_splits, in_splits, group, codecs, kind, b_lane_group)
    return PendingExchange(op, token=_ExchangeStart.apply(op, *tensors))


def _exchange_counts(send_counts: torch.Tensor, group, group_size: int, b_lane_group=None) -> torch.Tensor:
    """Send every peer r the number of rows this rank will send it (`send_counts[r]`); returns the number each
    peer will send here."""
    if group_size == 1:
        return send_counts.clone()
    lane = overlap.lane_group(group, b_lane_group)
    recv, work = _a2a_start(send_counts, [1] * group_size, [1] * group_size, lane)
    overlap.comm_started("dispatch", "F", [work])
    overlap.wait_comm([work], "dispatch", "F")
    return recv


# ---------------------------------------------------------------------------------------------------


@dataclass
class DispatchStats:
    """What one dispatch sent from this rank. Combine sends the same number of rows back along the same
    routes, so its cross-node copies and payload bytes equal these (in the combine dtype)."""

    mode: str
    tokens: int = 0
    copies: int = 0  # token rows leaving this rank in dispatch, all hops, self-sends included
    cross_node_copies: int = 0  # rows that cross a node boundary
    cross_node_bytes: int = 0  # their payload bytes (codec-encoded activations)
    cross_node_meta_bytes: int = 0  # routing metadata that travels with them (expert ids, gate weights)
    intra_node_copies: int = 0  # rows moved between different ranks of one node
    extra: dict = field(default_factory=dict)

    @property
    def cross_node_per_token(self) -> float:
        return self.cross_node_copies / max(self.tokens, 1)

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "tokens": self.tokens,
            "copies": self.copies,
            "cross_node_copies": self.cross_node_copies,
            "cross_node_bytes": self.cross_node_bytes,
            "cross_node_meta_bytes": self.cross_node_meta_bytes,
            "intra_node_copies": self.intra_node_copies,
            "cross_node_per_token": self.cross_node_per_token,
        }


def count_cross_node_copies(
    idx_TK: torch.Tensor, num_experts: int, ep_size: int, ranks_per_node: int, src_rank: int, dedup: bool
) -> tuple[int, int]:
    """(cross-node copies, rows moved between ranks of the sender's node) that `moe_dispatch_combine` sends
    from EP rank `src_rank` for routing `idx_TK`, without communicating (used by the dispatch bench and
    tests). Copies a forwarding rank makes inside a remote node are counted by that rank, not here."""
    per_node = num_experts // ep_size * ranks_per_node
    node_TK = idx_TK // per_node
    my_node = src_rank // ranks_per_node
    if not dedup:
        owner = idx_TK // (num_experts // ep_size)
        cross = int((node_TK != my_node).sum())
        intra = int(((node_TK == my_node) & (owner != src_rank)).sum())
        return cross, intra
    hit_TN = torch.zeros(idx_TK.shape[0], ep_size // ranks_per_node, dtype=torch.bool, device=idx_TK.device)
    hit_TN.scatter_(1, node_TK, True)
    return int(hit_TN.sum() - hit_TN[:, my_node].sum()), 0


def moe_dispatch_combine(
    x_TH: torch.Tensor,
    idx_TK: torch.Tensor,
    w_TK: torch.Tensor,
    expert_fn: ExpertFn,
    num_experts: int,
    groups: EPGroups | None = None,
    dedup: bool = True,
    codec: DispatchCodec | None = None,
    weights_to_experts: bool = False,
    while_dispatching: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, DispatchStats]:
    """Routed-expert output sum_k w_{t,k} FFN_{e_{t,k}}(x_t) for this rank's tokens, with experts sharded over
    ``groups.ep_group``. ``expert_fn(x_NH, local_expert_N)`` runs this rank's experts on the rows it
    receives (local ids in [0, E/P)). ``while_dispatching()`` runs while the dispatched tokens travel (the
    shared experts, paper §3.2.1): the all-to-alls are started, then it runs, then they are waited for (it
    runs once, with EP = 1 too). Returns (out_TH in x's dtype, stats)."""
    # weights_to_experts: the routing weight of each row travels with it and `expert_fn(x_NH, local_expert_N,
    # scale_N)` applies it before its down projection (no k·H expert outputs kept for the weight's gradient)
    g = groups or single_process_groups()
    if idx_TK.shape != w_TK.shape or idx_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"dispatch: idx {tuple(idx_TK.shape)}, weights {tuple(w_TK.shape)} and tokens {tuple(x_TH.shape)} disagree"
        )
    L = g.experts_per_rank(num_experts)
    while_dispatching = while_dispatching or (lambda: None)
    if dedup and g.num_nodes > 1:
        return _dispatch_dedup(x_TH, idx_TK, w_TK, expert_fn, L, g, codec, weights_to_experts, while_dispatching)
    mode = "dedup" if dedup else "per_expert"
    return _dispatch_per_expert(x_TH, idx_TK, w_TK, expert_fn, L, g, codec, mode, weights_to_experts, while_dispatching)


def _id_dtype(n: int) -> torch.dtype:
    """Smallest index dtype every backend can move for values < n (metadata bytes count on the wire)."""
    return torch.uint8 if n <= 256 else torch.int32


def _payload_bytes(codec, x_TH) -> int:
    return (codec or IdentityCodec()).bytes_per_row(x_TH.shape[1], x_TH.element_size())


def _dispatch_per_expert(
    x_TH,
    idx_TK,
    w_TK,
    expert_fn,
    L,
    g: EPGroups,
    codec,
    mode,
    weights_to_experts=False,
    while_dispatching=lambda: None,
):
    """One copy of each token per selected expert, sent straight to the expert's owner (L experts per rank)."""
    T, K = idx_TK.shape
    flat_expert = idx_TK.reshape(-1)  # [T*K]
    # Sorting by expert id also sorts by owner rank (owner = e // L): contiguous send blocks.
    order = torch.argsort(flat_expert, stable=True)
    expert_sorted = flat_expert[order]
    src_token = order // K  # source token of each sorted pair
    send_counts = torch.bincount(expert_sorted // L, minlength=g.ep_size)
    recv_counts = _exchange_counts(send_counts, g.ep_group, g.ep_size, g.ep_group_b)
    send, recv = send_counts.tolist(), recv_counts.tolist()
    ep_group_size = (g.ep_group, g.ep_size)
    ep_b_lane = {"b_lane_group": g.ep_group_b}

    # dispatch: activations (codec-encoded), local expert ids [, routing weights] in one exchange
    local_ids = (expert_sorted % L).to(_id_dtype(L))
    payload = [x_TH[src_token], local_ids]
    if weights_to_experts:
        payload.append(w_TK.reshape(-1)[order][:, None])
    pending = exchange_start(
        payload, recv, send, *ep_group_size, codecs=[codec, None, None], kind="dispatch", **ep_b_lane
    )
    while_dispatching()  # e.g. shared experts, while the tokens travel
    received = pending.wait()
    x_recv, expert_recv = received[0], received[1].long()  # [N_recv, H], [N_recv] local ids
    if weights_to_experts:
        y_recv = expert_fn(x_recv, expert_recv, received[2][:, 0])  # weighted rows
        y_back = exchange_start([y_recv], send, recv, *ep_group_size, kind="combine", **ep_b_lane).wait()[0]
        out = combine_rows(y_back, src_token, T)
    else:
        y_recv = expert_fn(x_recv, expert_recv)
        # [T*K, H], in sorted order
        y_back = exchange_start([y_recv], send, recv, *ep_group_size, kind="combine", **ep_b_lane).wait()[0]
        w_sorted = w_TK.reshape(-1)[order].to(y_back.dtype)
        out = combine_rows(y_back * w_sorted[:, None], src_token, T)  # keeps only the index for backward

    R = g.ranks_per_node
    cross = sum(n for r, n in enumerate(send) if r // R != g.node)
    intra = sum(n for r, n in enumerate(send) if r // R == g.node and r != g.ep_rank)
    stats = DispatchStats(
        mode=mode,
        tokens=T,
        copies=T * K,
        cross_node_copies=cross,
        cross_node_bytes=cross * _payload_bytes(codec, x_TH),
        cross_node_meta_bytes=cross * local_ids.element_size(),
        intra_node_copies=intra,
    )
    return out.to(x_TH.dtype), stats


def _dispatch_dedup(
    x_TH, idx_TK, w_TK, expert_fn, L, g: EPGroups, codec, weights_to_experts=False, while_dispatching=lambda: None
):
    """Node-deduplicated dispatch in two hops: each token crosses once to every selected node, to the rank with
    the sender's in-node index (the relay rank, hop 1), which forwards it inside the node to the owners of the
    selected experts (hop 2). R ranks per node, N nodes, L experts per rank."""
    T, K = idx_TK.shape
    R, N = g.ranks_per_node, g.num_nodes
    experts_per_node = L * R
    node_TK = idx_TK // experts_per_node
    hit_TN = torch.zeros(T, N, dtype=torch.bool, device=idx_TK.device)
    hit_TN.scatter_(1, node_TK, True)
    # Hop 1: one (token, node) pair per selected node, grouped by node: node n's rows go to EP rank
    # n*R + local_index.
    pair_node, pair_token = hit_TN.t().nonzero(as_tuple=True)  # [C1] each, sorted by node
    pairs_per_node = torch.bincount(pair_node, minlength=N)
    send_counts = torch.zeros(g.ep_size, dtype=torch.long, device=x_TH.device)
    send_counts[torch.arange(N, device=x_TH.device) * R + g.local_index] = pairs_per_node
    recv_counts = _exchange_counts(send_counts, g.ep_group, g.ep_size, g.ep_group_b)
    node_hop_send, node_hop_recv = send_counts.tolist(), recv_counts.tolist()

    # Routing metadata for the relay rank: the token's experts on that node as in-node indices
    # (e - node*L*R, compact dtype); slots on other nodes carry the sentinel L*R and gate weight 0.
    on_node = node_TK[pair_token] == pair_node[:, None]  # [C1, K]
    ids_CK = torch.where(
        on_node,
        idx_TK[pair_token] - pair_node[:, None] * experts_per_node,
        torch.full_like(idx_TK[pair_token], experts_per_node),
    ).to(_id_dtype(experts_per_node + 1))
    w_CK = w_TK[pair_token] * on_node.to(w_TK.dtype)  # differentiable: gates flow back through it

    ep_group_size, ep_b_lane = (g.ep_group, g.ep_size), {"b_lane_group": g.ep_group_b}
    pending = exchange_start(
        [x_TH[pair_token], ids_CK, w_CK],
        node_hop_recv,
        node_hop_send,
        *ep_group_size,
        codecs=[codec, None, None],
        kind="dispatch",
        **ep_b_lane,
    )
    while_dispatching()  # e.g. shared experts, while the tokens travel
    x_relay, ids_relay, w_relay = pending.wait()  # rows this rank relays: [C1r, H], [C1r, K], [C1r, K]

    # Hop 2, inside the node: forward each received token to the owners of its selected experts.
    relay_row, slot = (ids_relay < experts_per_node).nonzero(as_tuple=True)
    in_node_expert = ids_relay[relay_row, slot].long()  # owner = in_node_expert // L
    by_owner = torch.argsort(in_node_expert, stable=True)  # by expert => by owner rank in the node
    relay_row, slot, in_node_expert = relay_row[by_owner], slot[by_owner], in_node_expert[by_owner]
    expert_hop_send_counts = torch.bincount(in_node_expert // L, minlength=R)
    expert_hop_recv_counts = _exchange_counts(expert_hop_send_counts, g.node_group, R, g.node_group_b)
    expert_hop_send, expert_hop_recv = expert_hop_send_counts.tolist(), expert_hop_recv_counts.tolist()
    node_group_size, node_b_lane = (g.node_group, R), {"b_lane_group": g.node_group_b}
    # the in-node hop carries the encoded payload too (re-encoding a decoded pow2-scaled tile is exact)
    expert_hop_payload = [x_relay[relay_row], (in_node_expert % L).to(_id_dtype(L))]
    if weights_to_experts:
        expert_hop_payload.append(w_relay[relay_row, slot][:, None])
    received = exchange_start(
        expert_hop_payload,
        expert_hop_recv,
        expert_hop_send,
        *node_group_size,
        codecs=[codec, None, None],
        kind="dispatch",
        **node_b_lane,
    ).wait()
    x_expert, local_expert = received[0], received[1].long()
    # Combine inside the node first: one weighted partial sum per (token, node) crosses back.
    if weights_to_experts:
        y_expert = expert_fn(x_expert, local_expert, received[2][:, 0])
        y_relay = exchange_start(
            [y_expert], expert_hop_send, expert_hop_recv, *node_group_size, kind="combine", **node_b_lane
        ).wait()[0]
        node_sum = combine_rows(y_relay, relay_row, x_relay.shape[0])
    else:
        y_expert = expert_fn(x_expert, local_expert)
        y_relay = exchange_start(  # [C2, H], in by_owner order
            [y_expert], expert_hop_send, expert_hop_recv, *node_group_size, kind="combine", **node_b_lane
        ).wait()[0]
        weighted = y_relay * w_relay[relay_row, slot].to(y_relay.dtype)[:, None]
        node_sum = combine_rows(weighted, relay_row, x_relay.shape[0])
    node_sum_back = exchange_start(  # [C1, H]
        [node_sum], node_hop_send, node_hop_recv, *ep_group_size, kind="combine", **ep_b_lane
    ).wait()[0]
    out = combine_rows(node_sum_back, pair_token, T)

    cross = sum(node_hop_send) - node_hop_send[g.node * R + g.local_index]
    stats = DispatchStats(
        mode="dedup",
        tokens=T,
        copies=sum(node_hop_send) + sum(expert_hop_send),
        cross_node_copies=cross,
        cross_node_bytes=cross * _payload_bytes(codec, x_TH),
        cross_node_meta_bytes=cross * K * (ids_CK.element_size() + w_CK.element_size()),
        intra_node_copies=sum(expert_hop_send) - expert_hop_send[g.local_index],
        extra={"forwarded_rows": sum(expert_hop_send)},
    )
    return out.to(x_TH.dtype), stats
