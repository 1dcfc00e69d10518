"""Simulator of the pipeline schedules (the runtime's own op lists) against the published bubble formulas."""

import json

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.parallel.pipeline.schedule import Op, build_schedule, forward_only
from dsv3_plugin.parallel.pipeline.simulate import Durations, comparison_table, simulate

# Every duration is a multiple of 1/2, so each start/finish time, idle sum and formula value is a small
# dyadic rational, exact in binary floating point in any order: bubbles compare with ==, no tolerance.
UNIT_CELLS = [
    (1, 2, 1, None),
    (1, 2, 1, 2.0),
    (1, 2, 1, 2.5),
    (2, 4, 2, 5.0),
    (2, 3, 1, None),
    (3, 4, 1, 5.5),
    (1, 1, 0, None),
    (2, 3, 1, 3.0),
]


@pytest.mark.parametrize("P", [2, 4, 8])
def test_1f1b_bubble_on_every_rank(P):
    for F, B, W in [(1, 2, 1), (2, 3, 1), (1, 5, 0)]:
        for C in (P, 2 * P + 1):
            res = simulate(build_schedule("1f1b", P, C), Durations(F, B, W))
            assert res.idle == [(P - 1) * (F + B)] * P
            assert res.bubble == res.formula == (P - 1) * (F + B)
            assert res.peak_activations[0] == min(P, C)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_zb1p_bubble_inside_and_outside_its_domain(P):
    for F, B, W in [(1, 2, 1), (2, 3, 1), (1, 2, 0.5), (2, 4, 2)]:
        res = simulate(build_schedule("zb1p", P, 3 * P), Durations(F, B, W))
        assert W <= min(F, B - W)
        assert res.bubble == res.formula == (P - 1) * (F + B - 2 * W)
    res = simulate(build_schedule("zb1p", P, 3 * P), Durations(1, 3, 2))  # W > F: outside
    assert res.formula is None and res.formula_unchecked == 0
    assert res.bubble == (P - 1) * max(1 + 3 - 4, 1, 3 - 2)


@pytest.mark.parametrize(
    "name,P",
    [
        ("dualpipe", 2),
        ("dualpipe", 4),
        ("dualpipe", 8),
        ("dualpipev", 1),
        ("dualpipev", 2),
        ("dualpipev", 4),
        ("dualpipev", 8),
    ],
)
def test_dualpipe_bubbles_in_the_unit_cell(name, P):
    for F, B, W, FB in UNIT_CELLS:
        fb = F + B if FB is None else FB
        for C in {2 * P, 2 * P + 2, 5 * P + (P % 2)}:
            res = simulate(build_schedule(name, P, C), Durations(F, B, W, FB))
            stages_half = P / 2 if name == "dualpipe" else P  # PP/2 with PP = number of stages
            want = (stages_half - 1) * (fb + B - 3 * W)
            assert res.formula is not None and res.bubble == want, (name, P, C, F, B, W, FB)
            assert res.bubble == max(res.idle)


def test_dualpipe_outside_the_unit_cell_reports_both_values():
    P = 8
    # F > B-W: the timeline exceeds the formula by (PP/2-1)(F-(B-W))
    res = simulate(build_schedule("dualpipe", P, 20), Durations(2, 2, 1))
    assert res.formula is None
    assert res.bubble - res.formula_unchecked == (P / 2 - 1) * (2 - (2 - 1))
    # F < B-W: the formula overestimates
    res = simulate(build_schedule("dualpipe", P, 20), Durations(1, 3, 1))
    assert res.formula is None and res.bubble < res.formula_unchecked
    # an overlapped pair shorter than its longer half is not physical: the formula does not hold
    res = simulate(build_schedule("dualpipev", 4, 8), Durations(1, 2, 1, 1.5))
    assert res.formula is None and res.bubble > res.formula_unchecked


def test_memory_and_parameter_copies():
    for P in (4, 8):
        d = simulate(build_schedule("dualpipe", P, 4 * P), Durations())
        v = simulate(build_schedule("dualpipev", P, 4 * P), Durations())
        one = simulate(build_schedule("1f1b", P, 4 * P), Durations())
        assert d.peak_activations == [P + 1] * P  # README: PP + 1 (PP = stages = ranks)
        assert v.peak_activations == [2 * P + 1] * P  # PP + 1 with PP = 2P half-size stages
        assert one.peak_activations == list(range(P, 0, -1))
        assert d.param_copies == v.param_copies == [2] * P and one.param_copies == [1] * P


def test_schedule_invariants_and_errors():
    for name, P, C in [("1f1b", 4, 6), ("zb1p", 4, 6), ("dualpipe", 4, 8), ("dualpipev", 3, 7)]:
        spec = build_schedule(name, P, C)
        spec.validate()
        fwd = forward_only(spec)
        assert all(op.kind == "F" for ops in fwd.ops for op in ops)
        assert sum(len(o) for o in fwd.ops) == C * spec.n_stages
        simulate(fwd, Durations())
    with pytest.raises(ValueError, match="even number of pipeline ranks"):
        build_schedule("dualpipe", 3, 12)
    with pytest.raises(ValueError, match="micro-batches"):
        build_schedule("dualpipe", 4, 6)
    with pytest.raises(ValueError, match=">= 2\\*pp"):
        build_schedule("dualpipev", 4, 7)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("gpipe", 4, 8)
    spec = build_schedule("1f1b", 2, 2)
    spec.ops[1] = [Op("B", 0, 0), Op("F", 0, 0), Op("F", 0, 1), Op("B", 0, 1)]
    with pytest.raises(ValueError, match="before its F"):
        spec.validate()
    spec.ops[0] = [Op("F", 0, 0), Op("B", 0, 1), Op("F", 0, 1), Op("B", 0, 0)]
    with pytest.raises(ValueError, match="before its F"):
        spec.validate()
    spec.ops[0] = [Op("F", 0, 0), Op("B", 0, 0), Op("F", 0, 1), Op("B", 0, 1)]
    spec.ops[1] = [Op("F", 0, 1), Op("B", 0, 1), Op("F", 0, 0), Op("B", 0, 0)]  # waits for F of mb 1 first
    spec.validate()
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(spec, Durations())


def test_cli_json_png_table(tmp_path, capsys):
    png = tmp_path / "t.png"
    assert (
        main(
            [
                "simulate",
                "--schedule",
                "dualpipev",
                "--pp",
                "4",
                "--chunks",
                "10",
                "--f",
                "1",
                "--b",
                "2",
                "--w",
                "1",
                "--fb",
                "2.5",
                "--json",
                "--png",
                str(png),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    for k in ("bubble", "formula", "makespan", "idle", "peak_activations", "param_copies"):
        assert k in out
    assert out["bubble"] == out["formula"] == 3 * (2.5 + 2 - 3)
    assert len(out["idle"]) == 4
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["simulate", "--table", "--pp", "4"]) == 0
    text = capsys.readouterr().out
    assert "(PP/2-1)(F&B+B-3W)" in text and "| dualpipev |" in text
    rows, _ = comparison_table(4)
    assert any(r["formula"] is None for r in rows) and any(r["formula"] is not None for r in rows)
    assert main(["simulate", "--schedule", "dualpipe", "--pp", "3"]) == 2
    assert main(["simulate", "--schedule", "1f1b", "--w", "3", "--b", "2"]) == 2
    assert "error:" in capsys.readouterr().err
