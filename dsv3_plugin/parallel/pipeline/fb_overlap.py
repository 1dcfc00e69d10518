"""Two-lane model of one overlapped forward & backward pair (DeepSeek-V3 §3.2.1, Fig. 4).

    computation:   ATTN(F)   MLP(B) MLP(W)    MLP(F)      ATTN(B) ATTN(W)
    communication: COMBINE(B) DISPATCH(F)     DISPATCH(B) COMBINE(F)           [+ PP(F), PP(B) at the end]

Each component starts when its lane is free and its input exists (the previous component of the same
micro-batch); the pair's duration F&B is when both lanes are done. Communication that the computation lane
waits for is *exposed*: the computation lane's idle time, F&B - (computation time). A lone F or B chunk has
nobody to overlap with: its components run back to back (NOTE: real kernels could still overlap e.g. the
shared expert with the dispatch; the model does not).

Design notes: docs/design_notes.md#parallel-pipeline-fb-overlap
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

__all__ = ["ChunkComponents", "PairTimeline", "two_lane_pair"]


@dataclass(frozen=True)
class ChunkComponents:
    """Per-layer durations of the components of one chunk, the layers per chunk, and the PP send of a chunk.

    Forward: attention, dispatch, mlp, combine. Backward for input: combine_b, mlp_b, dispatch_b,
    attention_b (run in that order). Backward for weights: mlp_w, attention_w. `pp`: sending one chunk's
    boundary tensor (activation forward, its gradient backward) to the neighbouring stage."""

    attention: float
    dispatch: float
    mlp: float
    combine: float
    combine_b: float
    mlp_b: float
    dispatch_b: float
    attention_b: float
    mlp_w: float
    attention_w: float
    layers: int = 1
    pp: float = 0.0

    def __post_init__(self):
        for f_ in fields(self):
            v = getattr(self, f_.name)
            if f_.name == "layers":
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"ChunkComponents.layers: must be an int >= 1, got {v!r}")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ChunkComponents.{f_.name}: must be a finite number >= 0, got {v!r}")

    # serial (not overlapped) chunk times, as the pipeline simulator's F, B, W
    @property
    def f(self) -> float:
        return self.layers * (self.attention + self.dispatch + self.mlp + self.combine) + self.pp

    @property
    def b(self) -> float:
        """Full backward: input and weight parts."""
        return (
            self.layers
            * (self.combine_b + self.mlp_b + self.dispatch_b + self.attention_b + self.mlp_w + self.attention_w)
            + self.pp
        )

    @property
    def w(self) -> float:
        return self.layers * (self.mlp_w + self.attention_w)

    @property
    def compute_f(self) -> float:
        return self.layers * (self.attention + self.mlp)

    @property
    def comm_f(self) -> float:
        """All-to-all and PP time of a forward chunk."""
        return self.layers * (self.dispatch + self.combine) + self.pp

    @property
    def compute_b(self) -> float:
        return self.layers * (self.mlp_b + self.attention_b + self.mlp_w + self.attention_w)

    @property
    def comm_b(self) -> float:
        return self.layers * (self.combine_b + self.dispatch_b) + self.pp


@dataclass
class PairTimeline:
    makespan: float  # F&B of the pair
    compute: float  # busy time of the computation lane
    comm: float  # busy time of the communication lane (all-to-all + PP)
    a2a: float  # all-to-all part of `comm`
    exposed_comm: float  # idle time of the computation lane (= makespan - compute): communication not hidden
    serial: float  # F + B: the same components with no overlap
    events: list[dict] = field(default_factory=list)  # overlap_timeline events

    def to_json(self) -> dict:
        return {
            "fb": self.makespan,
            "compute": self.compute,
            "comm": self.comm,
            "a2a": self.a2a,
            "exposed_comm": self.exposed_comm,
            "hidden_comm": self.comm - self.exposed_comm,
            "serial_f_plus_b": self.serial,
            "compute_to_a2a": (self.compute / self.a2a if self.a2a else None),
        }


def _pair_ops(c: ChunkComponents):
    """Lanes in Fig. 4 order. An op: (key, chunk, label, layer, duration, dependency key or None)."""
    L = c.layers
    compute, comm = [], []
    for i in range(L):
        j = L - 1 - i  # the backward micro-batch walks the layers down
        compute += [
            (("F", "attention", i), "F", "attention", i, c.attention, ("F", "combine", i - 1) if i else None),
            (("B", "mlp", j), "B", "mlp", j, c.mlp_b, ("B", "combine", j)),
            (("W", "mlp", j), "W", "weights", j, c.mlp_w, ("B", "mlp", j)),
            (("F", "mlp", i), "F", "mlp", i, c.mlp, ("F", "dispatch", i)),
            (("B", "attention", j), "B", "attention", j, c.attention_b, ("B", "dispatch", j)),
            (("W", "attention", j), "W", "weights", j, c.attention_w, ("B", "attention", j)),
        ]
        after = ("B", "attention", j + 1) if j < L - 1 else None  # the layer above's attention backward
        comm += [
            (("B", "combine", j), "B", "combine", j, c.combine_b, after),
            (("F", "dispatch", i), "F", "dispatch", i, c.dispatch, ("F", "attention", i)),
            (("B", "dispatch", j), "B", "dispatch", j, c.dispatch_b, ("B", "mlp", j)),
            (("F", "combine", i), "F", "combine", i, c.combine, ("F", "mlp", i)),
        ]
    if c.pp > 0:  # each chunk sends its boundary tensor once it exists
        comm += [
            (("F", "pp", L - 1), "F", "pp", L - 1, c.pp, ("F", "combine", L - 1)),
            (("B", "pp", 0), "B", "pp", 0, c.pp, ("B", "attention", 0)),
        ]
    return {"compute": compute, "comm": comm}


def two_lane_pair(c: ChunkComponents, mb_f: int | None = None, mb_b: int | None = None) -> PairTimeline:
    """Schedule one F&B pair (forward micro-batch `mb_f`, backward micro-batch `mb_b`) on the two lanes."""
    lanes = _pair_ops(c)
    done: dict[tuple, float] = {}
    free = {"compute": 0.0, "comm": 0.0}
    pos = {"compute": 0, "comm": 0}
    events: list[dict] = []
    idle = 0.0
    progress = True
    while progress:
        progress = False
        for lane, ops in lanes.items():
            while pos[lane] < len(ops):
                key, chunk, label, layer, dur, dep = ops[pos[lane]]
                if dep is not None and dep not in done:
                    break
                start = max(free[lane], done[dep]) if dep is not None else free[lane]
                if lane == "compute":
                    idle += start - free[lane]  # the computation lane waits for a communication
                end = start + dur
                done[key] = end
                free[lane] = end
                events.append(
                    {
                        "lane": lane,
                        "chunk": chunk,
                        "label": label,
                        "start": start,
                        "end": end,
                        "mb": mb_f if chunk == "F" else mb_b,
                        "layer": layer,
                    }
                )
                pos[lane] += 1
                progress = True
    if any(pos[k] < len(v) for k, v in lanes.items()):  # cannot happen for the order above
        raise RuntimeError(f"two_lane_pair: lanes stuck at {pos}")
    makespan = max(free.values())
    idle += makespan - free["compute"]  # communication still running after the last computation
    compute = c.compute_f + c.compute_b
    comm = c.comm_f + c.comm_b
    a2a = c.layers * (c.dispatch + c.combine + c.combine_b + c.dispatch_b)
    return PairTimeline(makespan, compute, comm, a2a, idle, c.f + c.b, events)
