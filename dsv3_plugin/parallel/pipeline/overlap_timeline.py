"""Two-lane picture of one overlapped forward & backward pair, in the style of DeepSeek-V3 Fig. 4 (§3.2.1).

The report splits each chunk into attention, all-to-all dispatch, MLP and all-to-all combine (the backward in
the reverse order, with attention and MLP split into "backward for input" and "backward for weights"), plus a
PP communication component, and lays the two chunks of a pair on a computation lane and a communication lane
so that one micro-batch's communication runs while the other computes. Fig. 4's caption: "Orange denotes
forward, green denotes 'backward for input', blue denotes 'backward for weights', purple denotes PP
communication"; this module uses those colours.

Design notes: docs/design_notes.md#parallel-pipeline-overlap-timeline
"""

from __future__ import annotations

import math
import os
import tempfile

__all__ = ["plot_overlap_timeline", "validate_events", "LANES", "CHUNKS"]

LANES = ("compute", "comm")
CHUNKS = ("F", "B", "W")
# Fig. 4 caption: orange forward, green backward for input, blue backward for weights, purple PP communication.
_COLORS = {"F": "#f28e2b", "B": "#59a14f", "W": "#4e79a7", "pp": "#9467bd"}
_SHORT = {"attention": "ATTN", "dispatch": "DISP", "mlp": "MLP", "combine": "COMB", "weights": "W", "pp": "PP"}
_REQUIRED = ("lane", "chunk", "label", "start", "end")


def validate_events(events: list[dict]) -> None:
    """Raise ValueError naming `events[i].<field>` for the first malformed event."""
    if not isinstance(events, (list, tuple)):
        raise ValueError(f"events: expected a list of dicts, got {type(events).__name__}")
    if not events:
        raise ValueError("events: empty (nothing to draw)")
    for i, ev in enumerate(events):
        where = f"events[{i}]"
        if not isinstance(ev, dict):
            raise ValueError(f"{where}: expected a dict, got {type(ev).__name__}")
        for key in _REQUIRED:
            if key not in ev:
                raise ValueError(f"{where}.{key}: missing (an event needs {', '.join(_REQUIRED)}; mb optional)")
        if ev["lane"] not in LANES:
            raise ValueError(f"{where}.lane: must be one of {LANES}, got {ev['lane']!r}")
        if ev["chunk"] not in CHUNKS:
            raise ValueError(f"{where}.chunk: must be one of {CHUNKS}, got {ev['chunk']!r}")
        if not isinstance(ev["label"], str) or not ev["label"]:
            raise ValueError(f"{where}.label: must be a non-empty str, got {ev['label']!r}")
        for key in ("start", "end"):
            v = ev[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{where}.{key}: must be a finite number, got {v!r}")
        if ev["end"] < ev["start"]:
            raise ValueError(f"{where}.end: {ev['end']!r} is before start {ev['start']!r}")
        mb = ev.get("mb")
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int)):
            raise ValueError(f"{where}.mb: must be an int or None, got {mb!r}")


def _color(ev: dict) -> str:
    return _COLORS["pp"] if ev["label"] == "pp" else _COLORS[ev["chunk"]]


def plot_overlap_timeline(events: list[dict], path: str, title: str = "") -> str:
    """Draw `events` as two lanes (computation above, communication below), forward / backward-for-input /
    backward-for-weights / PP colour-coded, each bar labelled inside with its component (and micro-batch).
    Writes the PNG atomically (temp file in the target folder, then os.replace) and returns `path`."""
    validate_events(events)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(ev["start"] for ev in events)
    t1 = max(ev["end"] for ev in events)
    span = (t1 - t0) or 1.0
    y_of = {"compute": 1.0, "comm": 0.0}
    n_bars = max(sum(ev["lane"] == lane for ev in events) for lane in LANES)
    fig, ax = plt.subplots(figsize=(min(26.0, max(12.0, 0.55 * n_bars)), 2.9))
    for ev in events:
        w = ev["end"] - ev["start"]
        if w <= 0:
            continue
        y = y_of[ev["lane"]]
        ax.barh(y, w, left=ev["start"], height=0.72, color=_color(ev), edgecolor="black", linewidth=0.5)
        arrow = "\u25b3" if ev["chunk"] == "F" else "\u25b2"  # Fig. 4: open triangle forward, filled backward
        short = _SHORT.get(ev["label"], ev["label"])
        mb = "" if ev.get("mb") is None else f"\nmb {ev['mb']}"
        # the whole label inside the bar when it fits, a short two-line tag in narrower bars, nothing in slivers
        if w >= 0.07 * span:
            text, size = (ev["label"] if ev["label"] == "pp" else f"{ev['label']} ({ev['chunk']}){arrow}") + mb, 6.5
        elif w >= 0.018 * span:
            text = (
                short
                if ev["label"] == "pp"
                else (f"{short}{arrow}" if short == ev["chunk"] else f"{short}\n{ev['chunk']}{arrow}")
            )
            size = 5.5
        else:
            continue
        ax.text(ev["start"] + w / 2, y, text, ha="center", va="center", fontsize=size)
    ax.set_yticks([1.0, 0.0])
    ax.set_yticklabels(["computation", "communication"])
    ax.set_ylim(-0.6, 1.6)
    ax.set_xlim(t0, t1)
    ax.set_xlabel("time")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(
        handles=[
            Patch(color=_COLORS["F"], label="forward chunk \u25b3"),
            Patch(color=_COLORS["B"], label="backward for input \u25b2"),
            Patch(color=_COLORS["W"], label="backward for weights \u25b2"),
            Patch(color=_COLORS["pp"], label="PP communication"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.32),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=d)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the figure private to its writer
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        plt.close(fig)
    return path
