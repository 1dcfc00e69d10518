"""Pipeline schedules as data: per-rank op lists that both the runtime and the simulator execute.

A `ScheduleSpec` holds each micro-batch's route (the (rank, local chunk) hops, one per stage) and every rank's
ordered `Op`s; nothing here touches tensors, so one object drives `PipelineRuntime` and `simulate()`. Op kinds
(zero-bubble notation, Qi et al. 2023): F, B (full backward), I (input grads), W (queued weight grads), FB (F
overlapped with B, §3.2.1). Schedules (`build_schedule`, `SCHEDULES`): 1F1B (PipeDream-flush), ZB1P (ZB-H1),
DualPipe (DeepSeek-V3 §3.2.1, Fig. 5) and DualPipeV (the cut-in-half V: 2P stages on P ranks).

Design notes (op semantics, each schedule's layout): docs/design_notes.md#parallel-pipeline-schedule
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv3_plugin.schedule_traits import SCHEDULES, ScheduleTraits, check_chunks, schedule_traits

__all__ = [
    "Op",
    "ScheduleSpec",
    "ScheduleTraits",
    "one_f_one_b",
    "zb1p",
    "dualpipe",
    "dualpipev",
    "build_schedule",
    "builder",
    "forward_only",
    "schedule_traits",
    "check_chunks",
    "SCHEDULES",
]


@dataclass(frozen=True)
class Op:
    kind: str  # F, B, I, W, FB
    chunk: int  # local chunk (0 or 1) of F / B / I / W, the forward half of FB
    mb: int
    chunk2: int = -1  # FB: chunk of the backward half
    mb2: int = -1

    def __str__(self) -> str:
        if self.kind == "FB":
            return f"F{self.chunk}.{self.mb}&B{self.chunk2}.{self.mb2}"
        return f"{self.kind}{self.chunk}.{self.mb}"


@dataclass
class ScheduleSpec:
    """`routes[mb]`: the (rank, chunk) hops of micro-batch mb in forward order; `ops[rank]`: what it runs."""

    name: str
    n_ranks: int
    n_chunks: int  # micro-batches per step
    chunks_per_rank: int  # stage modules held by each rank (1 or 2)
    n_stages: int  # distinct stages of the model
    routes: list[list[tuple[int, int]]]
    ops: list[list[Op]]
    stage_of: dict[tuple[int, int], int] = field(default_factory=dict)  # (rank, chunk) -> model stage
    traits: ScheduleTraits | None = None  # what the schedule needs and guarantees (SCHEDULES)
    _hop: dict = field(default_factory=dict, repr=False)

    @property
    def loss_rank(self) -> int:
        """The rank that returns every micro-batch's loss."""
        return self.traits.loss_rank(self.n_ranks)

    def end_ranks(self) -> dict[int, list[int]]:
        """rank -> the micro-batches whose route ends there (their losses / outputs are computed there)."""
        out: dict[int, list[int]] = {}
        for m, route in enumerate(self.routes):
            out.setdefault(route[-1][0], []).append(m)
        return out

    def hop(self, mb: int, rank: int, chunk: int) -> int:
        """Position of (rank, chunk) on micro-batch mb's route."""
        if not self._hop:
            for m, route in enumerate(self.routes):
                for k, rc in enumerate(route):
                    self._hop[(m, *rc)] = k
        return self._hop[(mb, rank, chunk)]

    def prev_hop(self, mb: int, rank: int, chunk: int) -> tuple[int, int] | None:
        k = self.hop(mb, rank, chunk)
        return self.routes[mb][k - 1] if k > 0 else None

    def next_hop(self, mb: int, rank: int, chunk: int) -> tuple[int, int] | None:
        k = self.hop(mb, rank, chunk)
        route = self.routes[mb]
        return route[k + 1] if k + 1 < len(route) else None

    def validate(self) -> None:
        """Every (rank, chunk, mb) on a route gets exactly one F and one backward (B, or I then W), in order."""
        need = {(r, c, m) for m, route in enumerate(self.routes) for r, c in route}
        for r, ops in enumerate(self.ops):
            f, b, i, w = set(), set(), set(), []
            for op in ops:
                parts = (
                    [("F", op.chunk, op.mb), ("B", op.chunk2, op.mb2)]
                    if op.kind == "FB"
                    else [(op.kind, op.chunk, op.mb)]
                )
                for kind, c, m in parts:
                    key = (r, c, m)
                    if key not in need:
                        raise ValueError(f"{self.name}: rank {r} runs {kind}{c}.{m}, which is not on mb {m}'s route")
                    if kind == "F":
                        if key in f:
                            raise ValueError(f"{self.name}: rank {r} runs F{c}.{m} twice")
                        f.add(key)
                    elif kind in ("B", "I"):
                        if key not in f or key in b:
                            raise ValueError(f"{self.name}: rank {r} runs {kind}{c}.{m} before its F or twice")
                        b.add(key)
                        if kind == "I":
                            i.add(key)
                            w.append(key)
                    elif kind == "W":
                        if not w or w[0] != key:
                            raise ValueError(f"{self.name}: rank {r} W{c}.{m} is not the oldest pending I")
                        w.pop(0)
            mine = {k for k in need if k[0] == r}
            if f != mine or b != mine:
                raise ValueError(f"{self.name}: rank {r} misses F/B ops for {sorted(mine - (f & b))}")
            if w:
                raise ValueError(f"{self.name}: rank {r} leaves weight grads of {w} unflushed")


class _Program:
    """Appends ops for one rank, drawing micro-batches per chunk in order and tracking the W FIFO."""

    def __init__(self, mbs_of_chunk: dict[int, list[int]]):
        self.mbs = mbs_of_chunk
        self.next_f = {c: 0 for c in mbs_of_chunk}
        self.next_b = {c: 0 for c in mbs_of_chunk}
        self.pending_w: list[tuple[int, int]] = []
        self.ops: list[Op] = []

    def _take(self, counter: dict, c: int) -> int:
        m = self.mbs[c][counter[c]]
        counter[c] += 1
        return m

    def F(self, c: int) -> None:
        self.ops.append(Op("F", c, self._take(self.next_f, c)))

    def B(self, c: int, split: bool = False) -> None:
        m = self._take(self.next_b, c)
        self.ops.append(Op("I" if split else "B", c, m))
        if split:
            self.pending_w.append((c, m))

    def W(self) -> None:
        c, m = self.pending_w.pop(0)
        self.ops.append(Op("W", c, m))

    def FB(self, cf: int, cb: int) -> None:
        mf = self._take(self.next_f, cf)
        mb = self._take(self.next_b, cb)
        self.ops.append(Op("FB", cf, mf, cb, mb))


def one_f_one_b(n_ranks: int, n_chunks: int) -> ScheduleSpec:
    """1F1B: rank r warms up with P-1-r forwards, then alternates F/B, then drains the backwards."""
    P, C = n_ranks, n_chunks
    check_chunks("1f1b", P, C)
    routes = [[(r, 0) for r in range(P)] for _ in range(C)]
    ops = []
    for r in range(P):
        prog = _Program({0: list(range(C))})
        warm = min(P - 1 - r, C)
        for _ in range(warm):
            prog.F(0)
        for _ in range(C - warm):
            prog.F(0)
            prog.B(0)
        for _ in range(warm):
            prog.B(0)
        ops.append(prog.ops)
    return _finish("1f1b", P, C, routes, ops, {(r, 0): r for r in range(P)})


def zb1p(n_ranks: int, n_chunks: int) -> ScheduleSpec:
    """ZB-H1: the 1F1B order with every backward split into I + W. Rank r keeps up to r weight-grad jobs
    pending in the steady state (same activation memory as 1F1B) and spends them in the cool-down bubble,
    so the critical path through the I's is shorter by W per hop."""
    P, C = n_ranks, n_chunks
    check_chunks("zb1p", P, C)
    routes = [[(r, 0) for r in range(P)] for _ in range(C)]
    ops = []
    for r in range(P):
        prog = _Program({0: list(range(C))})
        warm = min(P - 1 - r, C)
        for _ in range(warm):
            prog.F(0)
        for _ in range(C - warm):
            prog.F(0)
            prog.B(0, split=True)
            if len(prog.pending_w) > r:
                prog.W()
        for _ in range(warm):
            prog.B(0, split=True)
            if len(prog.pending_w) > r:
                prog.W()
        while prog.pending_w:
            prog.W()
        ops.append(prog.ops)
    return _finish("zb1p", P, C, routes, ops, {(r, 0): r for r in range(P)})


def _dual_program(prog: _Program, n: int, h: int, per_phase: int, phase_chunk: tuple[int, int]) -> None:
    """The 8-step DualPipe program of one rank. `n`: ranks per direction (P/2 for DualPipe, P for DualPipeV),
    `h`: the rank's distance from its nearer end, `per_phase`: micro-batches per phase, `phase_chunk`: the
    local chunk that runs phase 0 / phase 1 (phase 0 is the direction this rank meets first)."""
    c0, c1 = phase_chunk
    for _ in range(2 * (n - h - 1)):  # 1: fill with phase-0 forwards
        prog.F(c0)
    for _ in range(h + 1):  # 2: both directions arrive
        prog.F(c0)
        prog.F(c1)
    for _ in range(n - h - 1):  # 3: zero-bubble backwards start
        prog.B(c1, split=True)
        prog.W()
        prog.F(c1)
    for i in range(per_phase - 2 * n + h + 1):  # 4: steady state, two overlapped F&B pairs
        if i == 0 and h == n - 1:
            # The middle rank's first pair is not overlapped: its B can start before the F ends.
            prog.F(c0)
            prog.B(c1)
        else:
            prog.FB(c0, c1)
        prog.FB(c1, c0)
    for _ in range(n - h - 1):  # 5
        prog.B(c1)
        prog.FB(c1, c0)
    split = False
    steps6 = h + 1
    for i in range(steps6):  # 6: drain, the second half with deferred weight grads
        if i == steps6 // 2 and h % 2 == 1:
            split = True
        prog.B(c1, split=split)
        if i == steps6 // 2 and h % 2 == 0:
            split = True
        prog.B(c0, split=split)
    for _ in range(n - h - 1):  # 7
        prog.W()
        prog.B(c0, split=True)
    while prog.pending_w:  # 8: flush the remaining weight grads (h + 1 of them)
        prog.W()


def dualpipe(n_ranks: int, n_chunks: int) -> ScheduleSpec:
    """DualPipe: micro-batches 0..C/2-1 enter at rank 0 (chunk 0 = stage r), C/2..C-1 enter at rank P-1
    (chunk 1 = stage P-1-r on rank r). Needs P even, C even and C >= 2P."""
    P, C = n_ranks, n_chunks
    check_chunks("dualpipe", P, C)
    half = C // 2
    down = list(range(half))
    up = list(range(half, C))
    routes = [[(s, 0) for s in range(P)] for _ in down] + [[(P - 1 - s, 1) for s in range(P)] for _ in up]
    ops = []
    for r in range(P):
        second = r >= P // 2
        h = min(r, P - 1 - r)
        prog = _Program({0: down, 1: up})
        _dual_program(prog, P // 2, h, half, (1, 0) if second else (0, 1))
        ops.append(prog.ops)
    stage_of = {**{(r, 0): r for r in range(P)}, **{(r, 1): P - 1 - r for r in range(P)}}
    return _finish("dualpipe", P, C, routes, ops, stage_of)


def dualpipev(n_ranks: int, n_chunks: int) -> ScheduleSpec:
    """DualPipeV: 2P stages, rank r holds stage r (chunk 0) and stage 2P-1-r (chunk 1); the route turns
    on the last rank without communication. Needs C >= 2P."""
    P, C = n_ranks, n_chunks
    check_chunks("dualpipev", P, C)
    route = [(s, 0) for s in range(P)] + [(P - 1 - s, 1) for s in range(P)]
    routes = [list(route) for _ in range(C)]
    ops = []
    for r in range(P):
        prog = _Program({0: list(range(C)), 1: list(range(C))})
        _dual_program(prog, P, r, C, (0, 1))
        ops.append(prog.ops)
    stage_of = {**{(r, 0): r for r in range(P)}, **{(r, 1): 2 * P - 1 - r for r in range(P)}}
    return _finish("dualpipev", P, C, routes, ops, stage_of)


def _finish(name, P, C, routes, ops, stage_of) -> ScheduleSpec:
    t = SCHEDULES[name]
    spec = ScheduleSpec(name, P, C, t.chunks_per_rank, t.n_stages(P), routes, ops, stage_of, traits=t)
    spec.validate()
    return spec


def forward_only(spec: ScheduleSpec) -> ScheduleSpec:
    """Inference: each rank keeps its forwards in the training order (a valid order, since F only waits on F)."""
    ops = []
    for rank_ops in spec.ops:
        ops.append([Op("F", o.chunk, o.mb) for o in rank_ops if o.kind in ("F", "FB")])
    return ScheduleSpec(
        spec.name + "-forward",
        spec.n_ranks,
        spec.n_chunks,
        spec.chunks_per_rank,
        spec.n_stages,
        spec.routes,
        ops,
        spec.stage_of,
        traits=spec.traits,
    )


def builder(traits: ScheduleTraits):
    """The program that builds a schedule, chosen by its traits: one stage per rank (1F1B, or ZB1P with W ops)
    or two fed from both ends (DualPipe, or DualPipeV with the V-shaped 2P stages)."""
    if traits.chunks_per_rank == 1:
        return zb1p if traits.has_w else one_f_one_b
    return dualpipev if traits.v_shape else dualpipe


def build_schedule(name: str, n_ranks: int, n_chunks: int) -> ScheduleSpec:
    return builder(schedule_traits(name))(n_ranks, n_chunks)
