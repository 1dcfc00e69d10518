"""The Fig. 4-style two-lane picture (paper §3.2.1): writes a PNG atomically, rejects malformed events by name."""

import os

import pytest

from dsv3_plugin.parallel.pipeline.overlap_timeline import plot_overlap_timeline, validate_events


def _pair():
    # one layer: forward mb 3 (attention, dispatch, mlp, combine), backward mb 1 in reverse, W after each B
    return [
        {"lane": "compute", "chunk": "F", "label": "attention", "start": 0.0, "end": 1.0, "mb": 3},
        {"lane": "comm", "chunk": "B", "label": "combine", "start": 0.0, "end": 0.75, "mb": 1},
        {"lane": "compute", "chunk": "B", "label": "mlp", "start": 1.0, "end": 2.0, "mb": 1},
        {"lane": "compute", "chunk": "W", "label": "weights", "start": 2.0, "end": 2.5, "mb": 1},
        {"lane": "comm", "chunk": "F", "label": "dispatch", "start": 1.0, "end": 1.5, "mb": 3},
        {"lane": "compute", "chunk": "F", "label": "mlp", "start": 2.5, "end": 3.0, "mb": 3},
        {"lane": "comm", "chunk": "B", "label": "dispatch", "start": 2.0, "end": 2.5, "mb": 1},
        {"lane": "compute", "chunk": "B", "label": "attention", "start": 3.0, "end": 4.0, "mb": 1},
        {"lane": "compute", "chunk": "W", "label": "weights", "start": 4.0, "end": 4.5},
        {"lane": "comm", "chunk": "F", "label": "combine", "start": 3.0, "end": 3.5, "mb": 3},
        {"lane": "comm", "chunk": "F", "label": "pp", "start": 3.5, "end": 3.75, "mb": None},
    ]


def test_writes_a_png(tmp_path):
    path = tmp_path / "fig4.png"
    assert plot_overlap_timeline(_pair(), str(path), title="one FB pair") == str(path)
    data = path.read_bytes()
    assert data[:4] == b"\x89PNG" and len(data) > 5_000
    assert os.listdir(tmp_path) == ["fig4.png"]  # the temp file was renamed, none left behind


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda e: e.pop("lane"), "events[2].lane"),
        (lambda e: e.update(lane="network"), "events[2].lane"),
        (lambda e: e.update(chunk="I"), "events[2].chunk"),
        (lambda e: e.update(label=""), "events[2].label"),
        (lambda e: e.update(start="0"), "events[2].start"),
        (lambda e: e.update(end=float("nan")), "events[2].end"),
        (lambda e: e.update(end=0.5), "events[2].end"),  # before its start (1.0)
        (lambda e: e.update(mb=1.0), "events[2].mb"),
    ],
)
def test_bad_events_name_the_field(tmp_path, mutate, field):
    events = _pair()
    mutate(events[2])
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        plot_overlap_timeline(events, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_bad_containers():
    with pytest.raises(ValueError, match="events: empty"):
        validate_events([])
    with pytest.raises(ValueError, match="events: expected a list"):
        validate_events({"lane": "compute"})
    with pytest.raises(ValueError, match=r"events\[0\]: expected a dict"):
        validate_events(["attention"])
