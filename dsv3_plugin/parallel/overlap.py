"""Computation-communication overlap of a forward and a backward chunk (DeepSeek-V3 §3.2.1, Fig. 4).

`run_overlapped(forward, backward)` runs the two chunks as two lanes that take turns to compute, so one chunk's
expert-parallel all-to-all (dispatch, combine: started by `dispatch.exchange_start`, waited for in `wait_comm`)
travels while the other chunk computes; the B lane communicates on second process groups (`lane_group`), so every
group sees one deterministic order of collectives. Losses and gradients equal F-then-B bit for bit.
`wait_clock()` / `recording()`: the all-to-all wait time and a Fig. 4-style timeline, for benchmarks.

NOTE: the CUDA path is written for NCCL's asynchronous collectives but has not run here (no GPU); its
`a2a_wait_s` counts host time only, which is not the exposed communication time on a GPU.

Design notes (lanes and turns, collective ordering, numerics, devices): docs/design_notes.md#parallel-overlap
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

__all__ = [
    "run_overlapped",
    "wait_comm",
    "lane_group",
    "comm_started",
    "wait_clock",
    "recording",
    "in_pair",
    "OverlapRecorder",
]


class _Clock:
    """Seconds a rank is held up by all-to-all, process-wide (updated under the pair's lock, or by one thread)."""

    def __init__(self):
        self.a2a_wait_s = 0.0
        self.waits = 0
        self.handovers = 0  # turns passed between the lanes of overlapped pairs
        self.pairs = 0  # overlapped pairs run
        self.lockstep_pairs = 0  # ... of which in lock step


_CLOCK = _Clock()


def wait_clock() -> _Clock:
    return _CLOCK


class _Pair:
    """Two lanes, F (the thread that made the pair) and B (any other thread: the helper thread, or on CUDA the
    autograd engine's device thread running the backward), and one compute turn between them.

    "turns" (CPU): the turn is a lock held only while a lane computes; a lane whose all-to-all has not arrived
    yet releases it, blocks on the transfer, then takes it back. Which lane computes when depends on timing,
    so the B lane communicates on its own groups (`lane_group`). "lockstep" (CUDA, or no second groups): the
    turn passes at every wait, in program order, and both lanes share the groups."""

    def __init__(self, lockstep: bool):
        self.lockstep = lockstep
        self.cond = threading.Condition()
        self.holder: str | None = "F"
        self.turn = "F"
        self.done = {"F": False, "B": False}
        self.f_thread = threading.get_ident()
        self.free_since: float | None = None

    def lane(self) -> str:
        return "F" if threading.get_ident() == self.f_thread else "B"

    @staticmethod
    def other(lane: str) -> str:
        return "B" if lane == "F" else "F"

    # -- "turns" --------------------------------------------------------------------------------------
    def _release(self, me: str) -> None:
        with self.cond:
            self.holder = None
            self.free_since = time.perf_counter()
            self.cond.notify_all()
        if _REC is not None:
            _REC.paused(me)

    def _acquire(self, me: str) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder is None)
            self.holder = me
            if self.free_since is not None:  # nobody computed since the release: exposed waiting
                _CLOCK.a2a_wait_s += time.perf_counter() - self.free_since
                self.free_since = None
            _CLOCK.handovers += 1
        if _REC is not None:
            _REC.resumed(me)

    # -- "lockstep" -----------------------------------------------------------------------------------
    def _pass_turn(self, me: str) -> None:
        you = self.other(me)
        with self.cond:
            if self.done[you]:
                return
            self.turn = you
            _CLOCK.handovers += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me or self.done[you])
        if _REC is not None:
            _REC.resumed(me)

    # -- both -----------------------------------------------------------------------------------------
    def start(self, me: str) -> None:
        if self.lockstep:
            with self.cond:
                self.cond.wait_for(lambda: self.turn == me or self.done[self.other(me)])
            if _REC is not None:
                _REC.resumed(me)
        elif me == "B":
            self._acquire(me)
        elif _REC is not None:
            _REC.resumed(me)

    def wait(self, works: list, kind: str) -> None:
        me = self.lane()
        if self.lockstep:
            self._pass_turn(me)
            _timed(works, kind, me, count=True)
        elif all(w.is_completed() for w in works):
            _timed(works, kind, me, count=False)
        else:
            self._release(me)
            _timed(works, kind, me, count=False)
            self._acquire(me)

    def finish(self, me: str) -> None:
        if _REC is not None:
            _REC.paused(me)
        with self.cond:
            self.done[me] = True
            self.turn = self.other(me)
            if self.holder == me:
                self.holder = None
                self.free_since = time.perf_counter() if not self.done[self.other(me)] else None
            self.cond.notify_all()


_PAIR: _Pair | None = None  # the pair running now (one at a time per process)


def in_pair() -> bool:
    return _PAIR is not None


def lane_group(group, b_lane_group):
    """The process group an all-to-all issued now goes on: `b_lane_group` (the same ranks, a second group) in the B
    lane of a "turns" pair, else `group`. Both lanes issue their collectives in their own program order, so
    each group sees one deterministic sequence, the same on every rank, whatever the timing."""
    p = _PAIR
    if p is None or p.lockstep or p.lane() == "F":
        return group
    if b_lane_group is None:
        raise RuntimeError(
            "overlap: an all-to-all in the backward lane of a pair needs the EP group's second "
            "group (EPGroups.ep_group_b / node_group_b)"
        )
    return b_lane_group


def _lane(phase: str) -> str:
    return _PAIR.lane() if _PAIR is not None else phase


def comm_started(kind: str, phase: str, works: list) -> None:
    """An all-to-all of `kind` ("dispatch" / "combine") was issued in `phase` ("F" forward / "B" backward)."""
    if _REC is not None:
        _REC.comm(kind, _lane(phase), works)


def _timed(works: list, kind: str, lane: str, count: bool) -> None:
    if _REC is not None:
        _REC.boundary(lane, kind, "wait")
    t0 = time.perf_counter()
    for w in works:
        w.wait()
    t1 = time.perf_counter()
    if count:
        _CLOCK.a2a_wait_s += t1 - t0
    _CLOCK.waits += 1
    if _REC is not None:
        _REC.waited(lane, t0, t1, kind)


def wait_comm(works: list, kind: str, phase: str) -> None:
    """Wait for the all-to-all `works` of `kind` issued in `phase` ("F" / "B"). Outside a pair: block, the
    blocked time added to `wait_clock()`. In a pair: let the other lane compute meanwhile (`_Pair`); the time
    neither lane computes is added."""
    p = _PAIR
    if p is None:
        _timed(works, kind, phase, count=True)
    else:
        p.wait(works, kind)


class _LaneThread:
    """The backward lanes' thread: one per process, started once and reused by every pair (a thread started
    per FB op costs a scheduler round trip on a loaded machine)."""

    def __init__(self):
        self._jobs: list = []
        self._cond = threading.Condition()
        threading.Thread(target=self._loop, name="dsv3-overlap-backward", daemon=True).start()

    def _loop(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs)
                fn, done = self._jobs.pop(0)
            try:
                fn()
            finally:
                done.set()

    def run(self, fn) -> threading.Event:
        done = threading.Event()
        with self._cond:
            self._jobs.append((fn, done))
            self._cond.notify()
        return done


_LANE_THREAD: _LaneThread | None = None


def _lane_thread() -> _LaneThread:
    global _LANE_THREAD
    if _LANE_THREAD is None:
        _LANE_THREAD = _LaneThread()
    return _LANE_THREAD


def run_overlapped(forward: Callable[[], object], backward: Callable[[], None], lockstep: bool = False):
    """Run `backward()` (helper thread) and `forward()` (this thread) as the two lanes of one overlapped pair
    (module docstring); returns forward's result. `lockstep`: pass the turn at every wait in program order (no
    second groups needed; the CUDA path). An exception in either lane is raised after both have finished."""
    global _PAIR
    if _PAIR is not None:
        raise RuntimeError("run_overlapped: a pair is already running in this process")
    pair = _Pair(lockstep)
    _CLOCK.pairs += 1
    _CLOCK.lockstep_pairs += int(lockstep)
    errors: dict[str, BaseException] = {}

    def b_lane():
        try:
            pair.start("B")
            backward()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            errors["B"] = e
        finally:
            pair.finish("B")

    _PAIR = pair
    if _REC is not None:
        _REC.pair_begin()
    out = None
    try:
        joined = _lane_thread().run(b_lane)
        try:
            pair.start("F")
            out = forward()
        except BaseException as e:  # noqa: BLE001
            errors["F"] = e
        finally:
            pair.finish("F")
        joined.wait()
    finally:
        _PAIR = None
        if _REC is not None:
            _REC.pair_end()
    if "F" in errors:
        raise errors["F"]
    if "B" in errors:
        raise errors["B"]
    return out


# ---------------------------------------------------------------------------------------------------
# timeline recording (benchmarks)


class OverlapRecorder:
    """Events of the chunks run while recording: compute segments per lane, labelled by the component they
    belong to, and all-to-all transfers from issue to completion (a completion callback on the work's future
    where the backend has one, else the end of the wait). Times in seconds from the recorder's start.

    A compute segment runs from the moment its lane holds the turn to its next communication event; its label
    is the component the lane is in: forward segments after a dispatch (until the combine) are "mlp" (shared
    experts while the tokens travel, then the routed experts), the others "attention" (attention, norms,
    embedding / head: everything outside the MoE); backward segments after a combine (until the dispatch) are
    "mlp", the others "attention". Waits are the exposed communication (no compute event covers them)."""

    def __init__(self, pair_index: int | None = None):
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self._seg: dict[str, float | None] = {}
        self._where: dict[str, str] = {}
        self._lock = threading.Lock()
        self.target = pair_index  # None: everything; k: only the k-th overlapped pair, times from its start
        self.pairs = 0
        self.active = pair_index is None

    def pair_begin(self) -> None:
        if self.target is not None:
            self.active = self.pairs == self.target
            if self.active:
                self.t0 = time.perf_counter()
        self.pairs += 1
        self._seg, self._where = {}, {}

    def pair_end(self) -> None:
        if self.target is not None:
            self.active = False

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _label(self, lane: str) -> str:
        return self._where.get(lane, "attention")

    def _close(self, lane: str, t: float) -> None:
        if not self.active:
            return
        start = self._seg.get(lane)
        if start is not None and t > start:
            self.events.append(
                {"lane": "compute", "chunk": lane, "label": self._label(lane), "start": start, "end": t, "mb": None}
            )
        self._seg[lane] = None

    def resumed(self, lane: str) -> None:
        self._seg[lane] = self._now()

    def paused(self, lane: str) -> None:
        self._close(lane, self._now())

    def boundary(self, lane: str, kind: str, what: str) -> None:
        """A communication event of `lane`: its compute segment ends here; after a start it goes on (now in
        the component that follows), at a wait it resumes when the wait returns (`waited`)."""
        self._close(lane, self._now())
        mlp_after = "dispatch" if lane == "F" else "combine"
        if what == "start":
            self._where[lane] = "mlp" if kind == mlp_after else "attention"
            self._seg[lane] = self._now()

    def comm(self, kind: str, lane: str, works: list) -> None:
        self.boundary(lane, kind, "start")
        if not self.active:
            return
        ev = {"lane": "comm", "chunk": lane, "label": kind, "start": self._now(), "end": None, "mb": None}
        self.events.append(ev)
        pending = [len(works)]

        def done(_fut):
            with self._lock:
                pending[0] -= 1
                if pending[0] == 0:
                    ev["end"] = self._now()

        for w in works:
            try:
                w.get_future().add_done_callback(done)
            except (AttributeError, RuntimeError):  # no future on this backend: the wait's end stands in
                pass

    def waited(self, lane: str, t0: float, t1: float, kind: str) -> None:
        if not self.active:
            return
        for ev in reversed(self.events):
            if ev["lane"] == "comm" and ev["chunk"] == lane and ev["label"] == kind and ev["end"] is None:
                ev["end"] = t1 - self.t0
                break
        self._seg[lane] = self._now()

    def finished(self) -> list[dict]:
        """The events, comm transfers with a missing end closed at their start (none on gloo)."""
        out = []
        for ev in self.events:
            e = dict(ev)
            if e["end"] is None:
                e["end"] = e["start"]
            out.append(e)
        return sorted(out, key=lambda e: (e["start"], e["lane"]))


_REC: OverlapRecorder | None = None


@contextlib.contextmanager
def recording(pair_index: int | None = None):
    """Record the timeline of what runs inside (yields the `OverlapRecorder`); with `pair_index` = k only the
    k-th overlapped pair run inside (counted from 0), its times from the pair's start."""
    global _REC
    rec = OverlapRecorder(pair_index)
    _REC = rec
    try:
        yield rec
    finally:
        _REC = None
