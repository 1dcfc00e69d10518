"""Executes a `ScheduleSpec` over torch.distributed P2P: `OneFOneB`, `ZeroBubble1P`, `DualPipe`, `DualPipeV`.

One class (`PipelineRuntime`) runs every schedule: the schedule is data (`schedule.py`), the simulator replays
the same ops, and what a schedule needs is read from its `ScheduleTraits`, never from its name. A step splits
full-batch inputs/labels into `num_chunks` micro-batches, runs this rank's ops in order and returns the
per-micro-batch losses (`StepOutput`) on the rank that holds the loss. Losses are not scaled: the criterion
decides. FB ops call a stage's `overlapped_forward_backward` when it has one (`parallel.overlap`).

Design notes (training vs inference, the W queue, the overlap hook, loss gathering, mirror sync):
docs/design_notes.md#parallel-pipeline-runtime
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from dsv3_plugin.parallel.overlap import wait_clock
from dsv3_plugin.parallel.pipeline.p2p import P2P, Message, PipelineError
from dsv3_plugin.parallel.pipeline.schedule import (
    Op,
    ScheduleSpec,
    builder,
    check_chunks,
    forward_only,
    schedule_traits,
)
from dsv3_plugin.parallel.pipeline.simulate import Durations, simulate
from dsv3_plugin.parallel.pipeline.weight_grad import WeightGradQueue

__all__ = ["PipelineRuntime", "OneFOneB", "ZeroBubble1P", "DualPipe", "DualPipeV", "StepOutput", "PipelineError"]


class StepOutput(NamedTuple):
    losses: torch.Tensor | None  # [num_chunks] on loss_rank (micro-batch order), else None
    outputs: object | None  # last-stage outputs concatenated along batch_dim, on request


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class PipelineRuntime:
    schedule_name = ""

    def __init__(
        self,
        modules: nn.Module | Sequence[nn.Module],
        *,
        process_group=None,
        rank_mapping: Sequence[int] | None = None,
        batch_dim: int = 0,
        timeout_s: float = 300.0,
        p2p_shapes: list[tuple[Sequence[int], torch.dtype]] | None = None,
        mirror_grad_sync: bool = True,
        device: torch.device | str | None = None,
        p2p_order: str | None = None,
        timeout_name: str = "timeout_s",
        schedule: str | None = None,
        overlap: bool = True,
    ):
        # `schedule`: a name of `SCHEDULES` (the subclasses below fix it); `overlap`: use the stage type's
        # overlap hook for FB ops where it has one (False: F then B, in sequence)
        self.schedule_name = schedule or type(self).schedule_name
        self.traits = schedule_traits(self.schedule_name)
        self.modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        self.group = process_group
        self.P = dist.get_world_size(process_group) if dist.is_initialized() else 1
        me = dist.get_rank(process_group) if dist.is_initialized() else 0
        if rank_mapping is None:
            rank_mapping = list(range(self.P))
        if sorted(rank_mapping) != list(range(self.P)):
            raise ValueError(f"rank_mapping must be a permutation of range({self.P}) (got {list(rank_mapping)})")
        self.rank = rank_mapping[me]  # pipeline rank of this process
        inv = {pr: gr for gr, pr in enumerate(rank_mapping)}
        to_global = (
            (lambda gr: dist.get_global_rank(process_group, gr)) if process_group is not None else (lambda gr: gr)
        )
        self.pipe_to_global = [to_global(inv[p]) for p in range(self.P)] if dist.is_initialized() else [0]
        self.batch_dim = batch_dim
        self.timeout_s = timeout_s
        self.mirror_grad_sync = mirror_grad_sync
        if device is None:
            p = next((p for m in self.modules for p in m.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        # `timeout_name`: what the error message calls the limit (e.g. the config key it came from)
        self.p2p = P2P(
            process_group, self.pipe_to_global, self.rank, self.device, timeout_s, p2p_shapes, timeout_name=timeout_name
        )
        # "sender": post each send at once, receive in the sender's order when needed (gloo: sends are
        # asynchronous). "pairwise": issue each pair's sends and receives in one order both ends share, for
        # backends whose sends block until the receive is posted (NCCL). Default by backend.
        if p2p_order is None:
            backend = dist.get_backend(process_group) if dist.is_initialized() else "gloo"
            p2p_order = "pairwise" if str(backend).lower() == "nccl" else "sender"
        if p2p_order not in ("sender", "pairwise"):
            raise ValueError(f"p2p_order must be 'sender' or 'pairwise' (got {p2p_order!r})")
        self.p2p_order = p2p_order
        self._orders: dict = {}
        self.wq = WeightGradQueue()
        self._specs: dict[tuple[int, bool], ScheduleSpec] = {}
        check_chunks(self.schedule_name, self.P, pp_key="process_group")
        need = self.traits.chunks_per_rank
        if len(self.modules) != need:
            raise ValueError(f"{self.schedule_name}: each rank holds {need} stage module(s), got {len(self.modules)}")
        m0 = self.modules[0]
        self._overlap = (
            overlap
            and len(self.modules) == 2
            and type(self.modules[1]) is type(m0)
            and callable(getattr(type(m0), "overlapped_forward_backward", None))
        )
        self.op_seconds: dict[str, float] = {}  # time per op kind of the last step
        self.op_a2a_wait_s: dict[str, float] = {}  # ... of which blocked in EP all-to-all waits
        self.op_p2p_wait_s: dict[str, float] = {}  # ... and blocked in pipeline receives / sends
        # the last step: wall_s, busy_s (= compute_s), idle_s and grad_sync_s (see `step`), w_closures (deferred
        # weight-grad GEMM jobs its W ops ran: 0 when no module defers, e.g. without `split_weight_grads`),
        # a2a_wait_s (blocked in EP all-to-all waits, part of busy_s), fb_hook (FB ops run by the overlap hook)
        self.last_step: dict[str, float] = {}
        self._w_closures = 0

    # -- schedule -------------------------------------------------------------------------------------
    def spec(self, num_chunks: int, training: bool = True) -> ScheduleSpec:
        key = (num_chunks, training)
        if key not in self._specs:
            check_chunks(self.schedule_name, self.P, num_chunks, chunks_key="num_chunks", pp_key="process_group")
            spec = builder(self.traits)(self.P, num_chunks)
            self._specs[key] = spec if training else forward_only(spec)
        return self._specs[key]

    @property
    def loss_rank(self) -> int:
        return self.traits.loss_rank(self.P)

    def _sends_of(self, spec: ScheduleSpec, rank: int, training: bool, gather: tuple[bool, bool]):
        """(op index, dst, Message) in the order `rank` sends them; receivers replay this to post receives
        in order. The end-of-step gather (to `loss_rank`, DualPipe) has op index len(ops)."""
        out = []
        for i, op in enumerate(spec.ops[rank]):
            parts = (
                [("F", op.chunk, op.mb), ("B", op.chunk2, op.mb2)] if op.kind == "FB" else [(op.kind, op.chunk, op.mb)]
            )
            for kind, c, m in parts:
                if kind == "F":
                    nxt = spec.next_hop(m, rank, c)
                    if nxt is not None and nxt[0] != rank:
                        out.append((i, nxt[0], Message("act", m, nxt[1])))
                elif kind in ("B", "I") and training:
                    prv = spec.prev_hop(m, rank, c)
                    if prv is not None and prv[0] != rank:
                        out.append((i, prv[0], Message("grad", m, prv[1])))
        if rank != spec.loss_rank and rank in spec.end_ranks():
            end = len(spec.ops[rank])
            if gather[0]:
                out.append((end, spec.loss_rank, Message("loss", 0, 0)))
            if gather[1]:
                out.append((end, spec.loss_rank, Message("out", 0, 0)))
        return out

    def _pair_orders(self, spec: ScheduleSpec, training: bool, gather) -> dict[int, list]:
        """For each peer: every message between this rank and the peer, both directions, in one order both
        ends derive alike: by the simulated time its producing op ends (unit durations), then sender rank,
        then the sender's own order. That order is consistent with causality (a message is produced before
        anything that needs it), so issuing each pair's operations strictly in it cannot deadlock even when
        a send blocks until its receive is posted (NCCL)."""
        res = simulate(spec, Durations(1.0, 2.0, 1.0))
        ends: dict[tuple[int, int], float] = {}
        count = [0] * self.P
        for ev in res.timeline:
            ends[(ev["rank"], count[ev["rank"]])] = ev["end"]
            count[ev["rank"]] += 1
        me = self.rank
        orders: dict[int, list] = {p: [] for p in range(self.P) if p != me}
        for src in range(self.P):
            for seq, (i, dst, msg) in enumerate(self._sends_of(spec, src, training, gather)):
                if src != me and dst != me:
                    continue
                peer = dst if src == me else src
                t = ends.get((src, i), res.makespan + 1.0)
                orders[peer].append((t, src, seq, src == me, msg))
        for peer in orders:
            orders[peer].sort(key=lambda e: e[:3])
        return orders

    # -- the step -------------------------------------------------------------------------------------
    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
    ) -> StepOutput:
        training = torch.is_grad_enabled()
        spec = self.spec(num_chunks, training)
        me, C = self.rank, num_chunks
        feeds = [m for m in range(C) if spec.routes[m][0][0] == me]
        ends = [m for m in range(C) if spec.routes[m][-1][0] == me]
        mb_in = self._split(inputs, C, "inputs") if feeds else None
        if ends and training and criterion is None:
            raise PipelineError(
                f"{self.schedule_name}: pipeline rank {me} holds a last stage: training needs a criterion there"
            )
        mb_lab = self._split(labels, C, "labels") if ends and criterion is not None else None
        if any(r != spec.loss_rank for r in spec.end_ranks()):  # some routes end away from the loss rank
            gather = (criterion is not None, return_outputs)
        else:
            gather = (False, False)
        self._expect_sends = iter(self._sends_of(spec, me, training, gather))
        key = (C, training, gather)
        if self.p2p_order == "pairwise":
            if key not in self._orders:
                self._orders[key] = self._pair_orders(spec, training, gather)
            self._order = {p: [(mine, m) for _, _, _, mine, m in o] for p, o in self._orders[key].items()}
        else:
            # the peer's sends only: (False, msg) for messages to this rank, (None, msg) for other ranks'
            self._order = {
                src: [(False if dst == me else None, m) for _, dst, m in self._sends_of(spec, src, training, gather)]
                for src in range(self.P)
                if src != me
            }
        self._pos = {src: 0 for src in self._order}
        self._mailbox: dict = {}
        self._local_act: dict = {}
        self._local_grad: dict = {}
        self._state: dict = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, tuple] = {}
        self._spec, self._training, self._criterion = spec, training, criterion
        self._mb_in, self._mb_lab = mb_in, mb_lab
        self.op_seconds = {}
        self.op_a2a_wait_s = {}
        self.op_p2p_wait_s = {}
        self.wq.clear()
        self._w_closures = 0
        self._fb_hook = 0
        clock = wait_clock()
        t_step, blocked0 = time.perf_counter(), self.p2p.blocked_s
        try:
            for op in spec.ops[me]:
                t0, a0, b0 = time.perf_counter(), clock.a2a_wait_s, self.p2p.blocked_s
                self._run(op)
                self.op_p2p_wait_s[op.kind] = self.op_p2p_wait_s.get(op.kind, 0.0) + self.p2p.blocked_s - b0
                self.op_seconds[op.kind] = self.op_seconds.get(op.kind, 0.0) + time.perf_counter() - t0
                self.op_a2a_wait_s[op.kind] = self.op_a2a_wait_s.get(op.kind, 0.0) + clock.a2a_wait_s - a0
            compute_s = sum(self.op_seconds.values()) - (self.p2p.blocked_s - blocked0)
            if len(self.wq):
                raise PipelineError(f"{self.schedule_name}: {len(self.wq)} weight-grad jobs left after the step")
            losses, outputs = self._collect(C, gather, return_outputs)
            self.p2p.wait_sends()
            blocked_sched = self.p2p.blocked_s
            grad_sync_s = 0.0
            if training and self.traits.mirror_sync and self.mirror_grad_sync and self.P > 1:
                t_sync = time.perf_counter()
                self._mirror_sync()
                grad_sync_s = time.perf_counter() - t_sync
            # Busy: time in stage compute (F/B/I/W/FB ops, their P2P waits excluded); idle: every wait on a peer
            # during the schedule (receives inside ops, the end-of-step gather, outstanding sends). DualPipe's
            # mirror exchange is a gradient reduction like DualPipeV's / 1F1B's data-parallel all-reduce (which
            # runs after the step, outside these figures), so it is counted apart (grad_sync_s, whole exchange
            # wall time) rather than as pipeline idle time: a bubble is what the W split can fill, a gradient
            # reduction is not. Two perf_counter reads per op: cheap enough to run on every step.
            idle_s = blocked_sched - blocked0
            self.last_step = {
                "wall_s": time.perf_counter() - t_step,
                "compute_s": compute_s,
                "busy_s": compute_s,
                "idle_s": idle_s,
                "grad_sync_s": grad_sync_s,
                "w_closures": self._w_closures,
                "a2a_wait_s": sum(self.op_a2a_wait_s.values()),
                "fb_hook": self._fb_hook,
            }
        finally:
            self._state.clear()
            self._mailbox.clear()
            self._local_act.clear()
            self._local_grad.clear()
            self.wq.clear()
        return StepOutput(losses, outputs)

    def _split(self, tensors: Sequence[torch.Tensor], C: int, what: str) -> list[tuple]:
        parts = []
        for i, t in enumerate(tensors):
            if not torch.is_tensor(t):
                raise PipelineError(
                    f"{self.schedule_name}: {what}[{i}] must be a tensor on pipeline rank "
                    f"{self.rank} (got {type(t).__name__})"
                )
            n = t.shape[self.batch_dim]
            if n < C:
                raise PipelineError(f"{self.schedule_name}: {what}[{i}] has batch {n} < num_chunks {C}")
            parts.append(torch.tensor_split(t, C, dim=self.batch_dim))
        return [tuple(p[m] for p in parts) for m in range(C)]

    # -- messages -------------------------------------------------------------------------------------
    def _send(self, dst: int, msg: Message, tensors) -> None:
        want = next(self._expect_sends, None)
        if want is None or want[1] != dst or want[2].key() != msg.key():
            raise PipelineError(f"internal: pipeline rank {self.rank} sends {msg} to {dst}, schedule says {want}")
        if self.p2p_order == "pairwise":
            self._advance(dst, (True, msg.key()))
        self.p2p.send(msg, dst, tensors)

    def _recv(self, src: int, msg: Message) -> list[torch.Tensor]:
        key = (src, msg.key())
        if key not in self._mailbox:
            self._advance(src, (False, msg.key()))
        return self._mailbox.pop(key)

    def _advance(self, peer: int, until: tuple) -> None:
        """Walk the message order shared with `peer` up to `until` = (sent by me?, message key), receiving
        every message from the peer on the way into the mailbox. In "sender" order the list holds only the
        peer's sends (entries (None, msg) are for other ranks and skipped); in "pairwise" order it holds both
        directions, and `until` a send of mine stops there (the caller sends it)."""
        order = self._order[peer]
        while True:
            i = self._pos[peer]
            if i >= len(order):
                raise PipelineError(
                    f"internal: pipeline rank {self.rank} waits for {until} that rank {peer} never sends"
                )
            mine, m = order[i]
            if until[0] and mine and m.key() == until[1]:
                self._pos[peer] = i + 1
                return
            if mine:
                raise PipelineError(
                    f"internal: pipeline rank {self.rank}: pairwise order expects its own send "
                    f"{m} to rank {peer} before {until}"
                )
            self._pos[peer] = i + 1
            if mine is None:
                continue
            self._mailbox[(peer, m.key())] = self.p2p.recv(m, peer)
            if not until[0] and m.key() == until[1]:
                return

    # -- ops ------------------------------------------------------------------------------------------
    def _run(self, op: Op) -> None:
        if op.kind == "F":
            self._f_finish(op.chunk, op.mb, *self._f_compute(op.chunk, op.mb, self._f_inputs(op.chunk, op.mb)))
        elif op.kind in ("B", "I"):
            outs, grads, loss = self._b_inputs(op.chunk, op.mb)
            if op.kind == "I":
                with self.wq.deferring((op.chunk, op.mb)):
                    self._backward(outs, grads, loss)
            else:
                self._backward(outs, grads, loss)
            self._b_finish(op.chunk, op.mb)
        elif op.kind == "W":
            self._w_closures += self.wq.pop(expect_tag=(op.chunk, op.mb))
        elif op.kind == "FB":
            x = self._f_inputs(op.chunk, op.mb)
            outs, grads, loss = self._b_inputs(op.chunk2, op.mb2)
            if self._overlap:
                f_mod, b_mod = self.modules[op.chunk], self.modules[op.chunk2]
                loss_fn = self._loss_fn(op.chunk, op.mb)
                self._fb_hook += 1
                f_outs, f_loss = type(f_mod).overlapped_forward_backward(f_mod, x, loss_fn, b_mod, loss, outs, grads)
                f_res = (x, _as_tuple(f_outs), f_loss)
            else:
                f_res = self._f_compute(op.chunk, op.mb, x)
                self._backward(outs, grads, loss)
            self._f_finish(op.chunk, op.mb, *f_res)
            self._b_finish(op.chunk2, op.mb2)
        else:
            raise PipelineError(f"unknown op {op}")

    def _f_inputs(self, c: int, m: int) -> tuple:
        prv = self._spec.prev_hop(m, self.rank, c)
        if prv is None:
            return self._mb_in[m]
        if prv[0] == self.rank:
            return self._local_act.pop((c, m))
        x = self._recv(prv[0], Message("act", m, c))
        if not self._training:
            x = [t.detach() for t in x]
        return tuple(x)

    def _loss_fn(self, c: int, m: int):
        if self._spec.next_hop(m, self.rank, c) is not None or self._criterion is None:
            return None
        crit, labels = self._criterion, self._mb_lab[m]
        return lambda outs: crit(*_as_tuple(outs), *labels)

    def _f_compute(self, c: int, m: int, x: tuple):
        outs = _as_tuple(self.modules[c](*x))
        loss_fn = self._loss_fn(c, m)
        loss = loss_fn(outs) if loss_fn is not None else None
        return x, outs, loss

    def _f_finish(self, c: int, m: int, x: tuple, outs: tuple, loss) -> None:
        nxt = self._spec.next_hop(m, self.rank, c)
        if nxt is None:
            if loss is not None:
                self._losses[m] = loss.detach()
            self._outputs[m] = tuple(o.detach() for o in outs)
        elif nxt[0] == self.rank:
            # The V turn: the next stage is local; hand over detached tensors (no P2P), graph cut like P2P.
            self._local_act[(nxt[1], m)] = tuple(
                o.detach().requires_grad_(o.requires_grad) if o.is_floating_point() else o for o in outs
            )
        else:
            self._send(nxt[0], Message("act", m, nxt[1]), outs)
        if self._training:
            self._state[(c, m)] = (x, outs, loss)

    def _b_inputs(self, c: int, m: int):
        x, outs, loss = self._state[(c, m)]
        nxt = self._spec.next_hop(m, self.rank, c)
        if nxt is None:
            if loss is None:
                raise PipelineError(f"{self.schedule_name}: no loss for micro-batch {m} (criterion missing)")
            return None, None, loss
        if nxt[0] == self.rank:
            grads = self._local_grad.pop((c, m))
        else:
            grads = self._recv(nxt[0], Message("grad", m, c))
        need = [o for o in outs if o.requires_grad]
        if len(need) != len(grads):
            raise PipelineError(
                f"{self.schedule_name}: micro-batch {m} chunk {c}: {len(grads)} output grads for "
                f"{len(need)} outputs that require grad"
            )
        return need, list(grads), None

    @staticmethod
    def _backward(outs, grads, loss) -> None:
        if loss is not None:
            loss.backward()
        elif outs:
            torch.autograd.backward(outs, grads)

    def _b_finish(self, c: int, m: int) -> None:
        x, _, _ = self._state.pop((c, m))
        prv = self._spec.prev_hop(m, self.rank, c)
        if prv is None:
            return
        gx = [t.grad if t.grad is not None else torch.zeros_like(t) for t in x if t.requires_grad]
        if prv[0] == self.rank:
            self._local_grad[(prv[1], m)] = gx
        else:
            self._send(prv[0], Message("grad", m, prv[1]), gx)

    # -- end of step ----------------------------------------------------------------------------------
    def _collect(self, C: int, gather: tuple[bool, bool], return_outputs: bool):
        me, spec = self.rank, self._spec
        ends = spec.end_ranks()  # rank -> micro-batches ending there, in order
        if me != spec.loss_rank:
            if me in ends and gather[0]:
                self._send(spec.loss_rank, Message("loss", 0, 0), [torch.stack([self._losses[m] for m in ends[me]])])
            if me in ends and gather[1]:
                self._send(spec.loss_rank, Message("out", 0, 0), self._cat([self._outputs[m] for m in ends[me]]))
            return None, None
        losses = outputs = None
        for src in sorted(ends):
            if src == me:
                continue
            mbs = ends[src]
            if gather[0]:
                got = self._recv(src, Message("loss", 0, 0))[0]
                self._losses.update({m: got[i] for i, m in enumerate(mbs)})
            if gather[1]:
                got = self._recv(src, Message("out", 0, 0))
                parts = [torch.tensor_split(t, len(mbs), dim=self.batch_dim) for t in got]
                self._outputs.update({m: tuple(p[i] for p in parts) for i, m in enumerate(mbs)})
        if self._criterion is not None and self._losses:
            losses = torch.stack([self._losses[m] for m in range(C)])
        if return_outputs:
            outs = self._cat([self._outputs[m] for m in range(C)])
            outputs = outs[0] if len(outs) == 1 else tuple(outs)
        return losses, outputs

    def _cat(self, per_mb: list[tuple]) -> list[torch.Tensor]:
        return [torch.cat([o[i] for o in per_mb], dim=self.batch_dim) for i in range(len(per_mb[0]))]

    def stage_parameters_by_stage(self) -> list[nn.Parameter]:
        """This rank's parameters ordered by model stage, each once (a module shared by both chunks counts
        once): the mirror rank of DualPipe lists the same tensors in the same order."""
        spec = self.spec(self.traits.min_chunks(self.P))
        order = sorted(range(len(self.modules)), key=lambda c: spec.stage_of[(self.rank, c)])
        seen, params = set(), []
        for c in order:
            for p in self.modules[c].parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _mirror_sync(self) -> None:
        """`mirror_sync` schedules (DualPipe): rank r and P-1-r hold the same two stages; sum their gradients
        (own + mirror's, the same IEEE sum on both sides, so the two copies stay bit-identical)."""
        mirror = self.P - 1 - self.rank
        params = self.stage_parameters_by_stage()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        peer = self.pipe_to_global[mirror]
        other = torch.empty_like(flat)
        # one batched pair: a plain send-then-recv on both sides can block each other under NCCL
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, flat, peer, group=self.group),
                dist.P2POp(dist.irecv, other, peer, group=self.group),
            ]
        )
        for w in works:
            self.p2p._wait(w, f"mirror gradient sync with pipeline rank {mirror}")
        total = flat + other
        off = 0
        for p in params:
            n = p.numel()
            p.grad = total[off : off + n].view_as(p).clone()
            off += n


class OneFOneB(PipelineRuntime):
    """1F1B baseline: one stage per rank; inputs on rank 0, labels/criterion/losses on the last rank."""

    schedule_name = "1f1b"


class ZeroBubble1P(PipelineRuntime):
    """ZB-H1: 1F1B with deferred weight gradients filling the cool-down bubble."""

    schedule_name = "zb1p"


class DualPipe(PipelineRuntime):
    """DualPipe: modules = (stage r, stage P-1-r). Inputs/labels/criterion on ranks 0 and P-1 (the full batch
    on both: micro-batches < C/2 enter at rank 0, the rest at rank P-1); losses of all micro-batches come
    back on rank 0. P even, num_chunks even and >= 2P."""

    schedule_name = "dualpipe"


class DualPipeV(PipelineRuntime):
    """DualPipeV: modules = (stage r, stage 2P-1-r) of 2P stages; inputs, labels, criterion and losses on
    rank 0. num_chunks >= 2P."""

    schedule_name = "dualpipev"
