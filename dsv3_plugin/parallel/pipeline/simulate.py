"""Discrete-event timeline of a `ScheduleSpec`: the same op lists the runtime executes (`simulate`).

Each rank runs its ops in order; an op starts when the rank is free and its inputs exist; P2P is free.
Durations (`Durations`): F, B, I = B - W, W and an overlapped pair FB = F&B, or per component (§3.2.1's
attention / dispatch / MLP / combine). A rank's bubble is makespan - its busy time; `SimResult` compares it with
the published formulas (DualPipe README: `published_formula`, `comparison_table`) and counts activations per
(stage, micro-batch); `plot_timeline` draws the timeline.

Design notes (the formulas and their domains, per-component durations):
docs/design_notes.md#parallel-pipeline-simulate
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv3_plugin.parallel.pipeline.fb_overlap import ChunkComponents, two_lane_pair
from dsv3_plugin.parallel.pipeline.schedule import SCHEDULES, ScheduleSpec, build_schedule

__all__ = ["Durations", "SimResult", "simulate", "published_formula", "comparison_table", "plot_timeline"]


@dataclass(frozen=True)
class Durations:
    f: float = 1.0
    b: float = 2.0
    w: float = 1.0
    fb: float | None = None  # F&B of an overlapped pair; None -> f + b
    # per-component times; then f, b, w are their serial sums and fb the two-lane F&B (or None: no overlap)
    components: ChunkComponents | None = None

    def __post_init__(self):
        c = self.components
        if c is None:
            return
        for name, want in (("f", c.f), ("b", c.b), ("w", c.w)):
            if getattr(self, name) != want:
                raise ValueError(
                    f"Durations.{name}: {getattr(self, name)!r} is not the components' {want!r} "
                    f"(build it with Durations.from_components)"
                )
        if self.fb is not None and self.fb != two_lane_pair(c).makespan:
            raise ValueError(
                f"Durations.fb: {self.fb!r} is neither None (no overlap) nor the two-lane F&B "
                f"{two_lane_pair(c).makespan!r} of the components"
            )

    @classmethod
    def from_components(cls, c: ChunkComponents, overlap: bool = True) -> Durations:
        """F, B, W from the components run back to back; F&B from the two-lane pair, or F + B without overlap."""
        return cls(c.f, c.b, c.w, two_lane_pair(c).makespan if overlap else None, c)

    @property
    def fb_(self) -> float:
        return self.f + self.b if self.fb is None else self.fb

    def of(self, kind: str) -> float:
        return {"F": self.f, "B": self.b, "I": self.b - self.w, "W": self.w, "FB": self.fb_}[kind]


@dataclass
class SimResult:
    schedule: str
    pp: int
    chunks: int
    makespan: float
    idle: list[float]
    busy: list[float]
    bubble: float
    formula: float | None
    formula_unchecked: float | None
    formula_text: str
    peak_activations: list[int]
    param_copies: list[int]
    timeline: list[dict] = field(default_factory=list)  # {rank, op, kind, start, end}
    comm: dict | None = None  # with component durations: communication per rank, total and exposed

    def to_json(self, with_timeline: bool = False) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "schedule",
                "pp",
                "chunks",
                "bubble",
                "formula",
                "formula_unchecked",
                "formula_text",
                "makespan",
                "idle",
                "busy",
                "peak_activations",
                "param_copies",
            )
        }
        if self.comm is not None:
            d["comm"] = self.comm
        if with_timeline:
            d["timeline"] = self.timeline
        return d


def simulate(spec: ScheduleSpec, d: Durations) -> SimResult:
    if d.w < 0 or d.w > d.b:
        raise ValueError(f"simulate: need 0 <= W <= B (got W={d.w}, B={d.b})")
    P = spec.n_ranks
    done_f: dict[tuple[int, int, int], float] = {}  # (rank, chunk, mb) -> end of its F
    done_b: dict[tuple[int, int, int], float] = {}  # end of its B or I (input grad ready)
    free = [0.0] * P
    pos = [0] * P
    busy = [0.0] * P
    live = [0] * P
    peak = [0] * P
    born: list[list[tuple[float, int]]] = [[] for _ in range(P)]  # (time, +1/-1) activation events
    timeline: list[dict] = []

    def f_ready(r, c, m):
        prev = spec.prev_hop(m, r, c)
        return 0.0 if prev is None else done_f.get((prev[0], prev[1], m))

    def b_ready(r, c, m):
        nxt = spec.next_hop(m, r, c)
        return done_f.get((r, c, m)) if nxt is None else done_b.get((nxt[0], nxt[1], m))

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pos[r] < len(spec.ops[r]):
                op = spec.ops[r][pos[r]]
                if op.kind == "F":
                    deps = [f_ready(r, op.chunk, op.mb)]
                elif op.kind in ("B", "I"):
                    deps = [b_ready(r, op.chunk, op.mb)]
                elif op.kind == "W":
                    deps = [done_b.get((r, op.chunk, op.mb))]
                else:
                    deps = [f_ready(r, op.chunk, op.mb), b_ready(r, op.chunk2, op.mb2)]
                if any(t is None for t in deps):
                    break
                start = max([free[r], *deps])
                end = start + d.of(op.kind)
                free[r] = end
                busy[r] += end - start
                if op.kind in ("F", "FB"):
                    done_f[(r, op.chunk, op.mb)] = end
                    born[r].append((start, 1))
                if op.kind in ("B", "I"):
                    done_b[(r, op.chunk, op.mb)] = end
                    born[r].append((end, -1))
                if op.kind == "FB":
                    done_b[(r, op.chunk2, op.mb2)] = end
                    born[r].append((end, -1))
                timeline.append(
                    {
                        "rank": r,
                        "op": str(op),
                        "kind": op.kind,
                        "chunk": op.chunk,
                        "mb": op.mb,
                        "start": start,
                        "end": end,
                    }
                )
                pos[r] += 1
                progress = True
    stuck = [r for r in range(P) if pos[r] < len(spec.ops[r])]
    if stuck:
        raise RuntimeError(
            f"{spec.name}: schedule deadlocks (ranks {stuck} wait at {[str(spec.ops[r][pos[r]]) for r in stuck]})"
        )
    makespan = max(free)
    for r in range(P):
        # releases sort before births at the same instant: a B ending when the next F starts frees first
        for _, delta in sorted(born[r], key=lambda e: (e[0], e[1])):
            live[r] += delta
            peak[r] = max(peak[r], live[r])
    idle = [makespan - b for b in busy]
    formula, unchecked, text = published_formula(spec.name, P, d)
    return SimResult(
        spec.name,
        P,
        spec.n_chunks,
        makespan,
        idle,
        busy,
        max(idle),
        formula,
        unchecked,
        text,
        peak,
        [spec.chunks_per_rank] * P,
        timeline,
        _comm_per_rank(spec, d),
    )


def _comm_per_rank(spec: ScheduleSpec, d: Durations) -> dict | None:
    """Communication time each rank's ops contain and the part of it left exposed: all of it in a lone F, B or
    I (the input half of B holds all of B's communication), the two-lane model's exposed part in an F&B pair."""
    c = d.components
    if c is None:
        return None
    pair_exposed = two_lane_pair(c).exposed_comm if d.fb is not None else c.comm_f + c.comm_b
    per_op = {
        "F": (c.comm_f, c.comm_f),
        "B": (c.comm_b, c.comm_b),
        "I": (c.comm_b, c.comm_b),
        "W": (0.0, 0.0),
        "FB": (c.comm_f + c.comm_b, pair_exposed),
    }
    total, exposed, pairs = [], [], []
    for ops in spec.ops:
        total.append(sum(per_op[op.kind][0] for op in ops))
        exposed.append(sum(per_op[op.kind][1] for op in ops))
        pairs.append(sum(op.kind == "FB" for op in ops))
    return {"total": total, "exposed": exposed, "fb_pairs": pairs, "overlap": d.fb is not None}


def published_formula(name: str, P: int, d: Durations) -> tuple[float | None, float | None, str]:
    """(value inside the formula's exact domain or None, the expression's value anyway, the expression)."""
    F, B, W, FB = d.f, d.b, d.w, d.fb_
    eps = 1e-12
    if name == "1f1b":
        v = (P - 1) * (F + B)
        return v, v, "(PP-1)(F+B)"
    if name == "zb1p":
        v = (P - 1) * (F + B - 2 * W)
        return (v if W <= min(F, B - W) + eps else None), v, "(PP-1)(F+B-2W)"
    # The unit cell of the published figure: F = B-W, W <= F, and a physical overlap max(F, B) <= F&B <= F+B.
    unit = abs(F - (B - W)) <= eps and W <= F + eps and max(F, B) - eps <= FB <= F + B + eps
    if name == "dualpipe":
        v = (P / 2 - 1) * (FB + B - 3 * W)
        return (v if unit else None), v, "(PP/2-1)(F&B+B-3W), PP = ranks"
    if name == "dualpipev":
        v = (P - 1) * (FB + B - 3 * W)  # PP = 2P stages
        return (v if unit else None), v, "(PP/2-1)(F&B+B-3W), PP = 2*ranks stages"
    return None, None, "n/a"


TABLE_CASES = [
    # (label, F, B, W, F&B)
    ("unit cell F=B-W=W=1, no overlap", 1.0, 2.0, 1.0, None),
    ("unit cell, overlap F&B=2.5", 1.0, 2.0, 1.0, 2.5),
    ("unit cell, full overlap F&B=max(F,B)=2", 1.0, 2.0, 1.0, 2.0),
    ("F=2, B=4, W=2 (F=B-W), F&B=5", 2.0, 4.0, 2.0, 5.0),
    ("F > B-W (F=2, B=2, W=1)", 2.0, 2.0, 1.0, None),
    ("F < B-W (F=1, B=3, W=1)", 1.0, 3.0, 1.0, None),
    ("W > F (F=1, B=3, W=2)", 1.0, 3.0, 2.0, None),
    ("unphysical F&B=1.5 < B", 1.0, 2.0, 1.0, 1.5),
]


def comparison_table(pp: int = 8, chunks: int | None = None) -> tuple[list[dict], str]:
    """Simulated bubble next to the published formula for each schedule over a few duration cases.
    `pp` is the number of pipeline ranks (DualPipeV then has 2*pp stages)."""
    chunks = chunks or 4 * pp
    rows = []
    for label, F, B, W, FB in TABLE_CASES:
        d = Durations(F, B, W, FB)
        for name in SCHEDULES:
            res = simulate(build_schedule(name, pp, chunks), d)
            rows.append(
                {
                    "case": label,
                    "schedule": name,
                    "bubble": res.bubble,
                    "formula": res.formula,
                    "formula_unchecked": res.formula_unchecked,
                    "formula_text": res.formula_text,
                    "peak_activations": max(res.peak_activations),
                    "param_copies": max(res.param_copies),
                    "makespan": res.makespan,
                }
            )
    lines = [
        f"pp={pp} ranks, {chunks} micro-batches; bubble = max over ranks of (makespan - busy)",
        "",
        "| case | schedule | simulated bubble | published formula | formula value | in exact domain | "
        "peak act./rank | param copies/rank |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['schedule']} | {row['bubble']:g} | {row['formula_text']} | "
            f"{row['formula_unchecked']:g} | {'yes' if row['formula'] is not None else 'no'} | "
            f"{row['peak_activations']} | {row['param_copies']} |"
        )
    return rows, "\n".join(lines)


_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#e5ae38", "W": "#55a868", "FB": "#8172b2"}


def plot_timeline(res: SimResult, path: str) -> str:
    """Ranks x time, one box per op (F blue, B orange, I yellow, W green, overlapped F&B purple), labelled
    with the micro-batch; written atomically."""
    import os
    import tempfile

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    P = res.pp
    fig, ax = plt.subplots(figsize=(max(8.0, res.makespan * 0.22), 0.55 * P + 1.6))
    for ev in res.timeline:
        y = P - 1 - ev["rank"]
        w = ev["end"] - ev["start"]
        # chunk 1 (the reverse direction / the second stage of the rank) is drawn lighter
        ax.barh(
            y,
            w,
            left=ev["start"],
            height=0.8,
            color=_COLORS[ev["kind"]],
            edgecolor="black",
            linewidth=0.4,
            alpha=1.0 if ev["chunk"] == 0 else 0.6,
        )
        if ev["kind"] == "FB":  # "F0.3&B1.5" -> "3|5": forward micro-batch | backward micro-batch
            f, b = ev["op"].split("&")
            label = f"{f.split('.')[1]}|{b.split('.')[1]}"
        else:
            label = str(ev["mb"])
        if w >= 0.6:
            ax.text(
                ev["start"] + w / 2,
                y,
                label,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if ev["kind"] in ("F", "FB") else "black",
            )
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {P - 1 - i}" for i in range(P)])
    ax.set_xlabel("time (units of the F/B/W durations)")
    ax.set_xlim(0, res.makespan)
    formula = "n/a" if res.formula is None else f"{res.formula:g}"
    ax.set_title(
        f"{res.schedule}: pp={P}, {res.chunks} micro-batches, bubble {res.bubble:g} (published formula: {formula})"
    )
    ax.legend(
        handles=[
            Patch(color=c, label=k)
            for k, c in [
                ("F", _COLORS["F"]),
                ("B", _COLORS["B"]),
                ("B input (I)", _COLORS["I"]),
                ("W", _COLORS["W"]),
                ("F&B overlapped", _COLORS["FB"]),
            ]
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=5,
        fontsize=7,
        title="lighter: the rank's second chunk (reverse direction / stage 2P-1-r)",
        title_fontsize=7,
    )
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=d)
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path
