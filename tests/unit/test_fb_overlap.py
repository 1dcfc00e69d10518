"""The two-lane F&B model (paper §3.2.1, Fig. 4), its use in the pipeline simulator, the first-principles
component times of the report's setup, and `dsv3 simulate`'s component / --paper-setup flags."""

import json
from dataclasses import replace

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.parallel.pipeline.comm_model import Hardware, break_even_mfu, paper_setup
from dsv3_plugin.parallel.pipeline.fb_overlap import ChunkComponents, two_lane_pair
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.simulate import Durations, simulate

# Every duration is a multiple of 1/4, so every start, end and sum below is exact in binary floating point
# (in any order): the model's results compare with ==.
# Per layer: computation 1 + 1 + 0.5 + 1 + 1 + 0.5 = 5; each communication fits behind the computation it
# overlaps (combine_b 0.5 <= attention 1; dispatch 0.5 <= mlp_b + mlp_w; dispatch_b 1 <= mlp_w + mlp;
# combine 0.75 + two PP sends 0.5 <= attention_b + attention_w 1.5).
HIDDEN = ChunkComponents(
    attention=1.0,
    dispatch=0.5,
    mlp=1.0,
    combine=0.75,
    combine_b=0.5,
    mlp_b=1.0,
    dispatch_b=1.0,
    attention_b=1.0,
    mlp_w=0.5,
    attention_w=0.5,
    pp=0.25,
)


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_hidden_communication_costs_nothing(layers):
    c = replace(HIDDEN, layers=layers)
    pair = two_lane_pair(c, mb_f=4, mb_b=2)
    assert pair.exposed_comm == 0
    assert pair.makespan == pair.compute == 5 * layers
    assert pair.comm == layers * (0.5 + 0.75 + 0.5 + 1.0) + 2 * 0.25
    assert pair.serial == c.f + c.b == layers * (1 + 0.5 + 1 + 0.75 + 0.5 + 1 + 1 + 1 + 0.5 + 0.5) + 2 * 0.25
    # the lanes never overlap themselves, and each micro-batch's components run in Fig. 4's order
    for lane in ("compute", "comm"):
        evs = [e for e in pair.events if e["lane"] == lane]
        assert all(a["end"] <= b["start"] for a, b in zip(evs, evs[1:]))
    f_labels = [e["label"] for e in sorted(pair.events, key=lambda e: e["start"]) if e["chunk"] == "F"]
    assert f_labels == ["attention", "dispatch", "mlp", "combine"] * layers + ["pp"]
    b_labels = [e["label"] for e in sorted(pair.events, key=lambda e: e["start"]) if e["chunk"] == "B"]
    assert b_labels == ["combine", "mlp", "dispatch", "attention"] * layers + ["pp"]
    assert {e["mb"] for e in pair.events if e["chunk"] == "F"} == {4}
    assert {e["mb"] for e in pair.events if e["chunk"] in "BW"} == {2}


@pytest.mark.parametrize("layers", [1, 3])
def test_excess_communication_is_exposed_by_exactly_the_excess(layers):
    # the first backward combine (1.25) runs beside the first forward attention (1): 0.25 is exposed; later
    # ones run beside attention_w + attention (1.5) and stay hidden
    c = replace(HIDDEN, combine_b=1.25, layers=layers)
    pair = two_lane_pair(c)
    assert pair.exposed_comm == 0.25 and pair.makespan == 5 * layers + 0.25
    # the last forward combine and the PP sends run beside attention_b + attention_w (1.5): 2 + 0.5 - 1.5 = 1
    pair = two_lane_pair(replace(HIDDEN, combine=2.0))
    assert pair.exposed_comm == 1.0 and pair.makespan == 5 + 1.0
    # no computation at all: F&B is the communication lane, all of it exposed
    zero = ChunkComponents(0.0, 0.5, 0.0, 0.75, 0.5, 0.0, 1.0, 0.0, 0.0, 0.0)
    pair = two_lane_pair(zero)
    assert pair.compute == 0 and pair.exposed_comm == pair.makespan == pair.comm == 2.75


def test_components_drive_the_pipeline_simulator():
    c = replace(HIDDEN, layers=2)
    d = Durations.from_components(c)
    assert (d.f, d.b, d.w, d.fb) == (c.f, c.b, c.w, 10.0)
    assert Durations.from_components(c, overlap=False).fb_ == c.f + c.b
    spec = build_schedule("dualpipe", 4, 8)
    ov, no = simulate(spec, d), simulate(spec, Durations.from_components(c, overlap=False))
    assert ov.makespan < no.makespan
    for r, ops in enumerate(spec.ops):
        n = {k: sum(op.kind == k for op in ops) for k in ("F", "B", "I", "W", "FB")}
        lone = n["F"] * c.comm_f + (n["B"] + n["I"]) * c.comm_b
        assert ov.comm["exposed"][r] == lone  # the pairs hide all of theirs
        assert no.comm["exposed"][r] == no.comm["total"][r] == lone + n["FB"] * (c.comm_f + c.comm_b)
        assert ov.comm["fb_pairs"][r] == n["FB"] > 0
    with pytest.raises(ValueError, match="Durations.f"):
        Durations(1.0, c.b, c.w, components=c)
    with pytest.raises(ValueError, match="Durations.fb"):
        Durations(c.f, c.b, c.w, 3.0, components=c)
    with pytest.raises(ValueError, match="ChunkComponents.mlp_w"):
        replace(HIDDEN, mlp_w=-1.0)
    with pytest.raises(ValueError, match="ChunkComponents.layers"):
        replace(HIDDEN, layers=0)


def test_paper_setup_numbers_from_the_stated_constants():
    """Recomputed here from the report's numbers, not by calling the derivation's helpers."""
    comp, det = paper_setup(Hardware(mfu=0.5))
    T, h, H = 4096, 7168, 128
    rate_fp8 = 1979e12 * 0.5 * 112 / 132  # FP8 GEMMs (§3.3) on the 112 SMs not spent on communication
    rate_bf16 = 989e12 * 0.5 * 112 / 132  # core attention and the router stay BF16
    proj = 7168 * 1536 + 1536 * H * 192 + 7168 * 576 + 512 * H * 256 + H * 128 * 7168  # MLA q/kv/o
    core = 2 * T * H * (192 + 128) * (T + 1) / 2  # causal QK^T and PV
    router = 2 * T * h * 256
    mlp = 2 * T * 3 * h * 2048 * 9  # 8 routed + 1 shared
    up = 1536 * H * 192 + 512 * H * 256  # recomputed in backward
    ib = 50e9
    exp_ms = {
        "attention": (2 * T * proj / rate_fp8 + (core + router) / rate_bf16) * 1e3,
        "mlp": mlp / rate_fp8 * 1e3,
        "attention_b": (2 * T * (proj + up) / rate_fp8 + (2.5 * core + router) / rate_bf16) * 1e3,
        "attention_w": (2 * T * proj / rate_fp8 + router / rate_bf16) * 1e3,
        # 4 of 8 nodes per token, the own node (1 in 8) needs no IB; FP8 + one FP32 scale per 128, or BF16
        "dispatch": T * 4 * 7 / 8 * (h + h // 128 * 4) / ib * 1e3,
        "combine": T * 4 * 7 / 8 * h * 2 / ib * 1e3,
    }
    exp_ms.update(mlp_b=exp_ms["mlp"], mlp_w=exp_ms["mlp"], combine_b=exp_ms["dispatch"], dispatch_b=exp_ms["combine"])
    # the same sums in a different order: a few dozen roundings of 2^-53 each, far inside rel 1e-12
    for k, v in exp_ms.items():
        assert getattr(comp, k) == pytest.approx(v, rel=1e-12), k
    assert comp.pp == pytest.approx(T * h * 2 / ib * 1e3, rel=1e-12)
    assert comp.layers == 4 and det["nodes"] == 8 and det["ib_copies_per_token"] == 3.5
    # NVLink (8 copies / 160 GB/s) is below IB (3.5 copies / 50 GB/s): the all-to-all is IB-bound
    assert 8 / 160 < 3.5 / 50
    pair = two_lane_pair(comp)
    ratio = pair.compute / pair.a2a
    assert ratio == pytest.approx(
        4
        * sum(exp_ms[k] for k in ("attention", "mlp", "attention_b", "mlp_b", "attention_w", "mlp_w"))
        / (4 * sum(exp_ms[k] for k in ("dispatch", "combine", "combine_b", "dispatch_b"))),
        rel=1e-12,
    )
    # break-even: hidden just below it, exposed just above
    be = break_even_mfu(Hardware())
    assert 0 < be < 1
    assert two_lane_pair(paper_setup(Hardware(mfu=be))[0]).exposed_comm <= 1e-9
    assert two_lane_pair(paper_setup(Hardware(mfu=be + 2e-4))[0]).exposed_comm > 0
    with pytest.raises(ValueError, match="Hardware.mfu"):
        Hardware(mfu=1.5)


def test_cli_paper_setup_json_and_fig4(tmp_path, capsys):
    png = tmp_path / "fig4.png"
    assert main(["simulate", "--paper-setup", "--chunks", "32", "--json", "--fig4", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("bubble", "makespan", "idle", "comm", "components", "fb_pair", "step", "paper_setup"):
        assert k in out, k
    fp, st = out["fb_pair"], out["step"]
    for k in ("fb", "compute", "comm", "a2a", "exposed_comm", "serial_f_plus_b", "compute_to_a2a"):
        assert k in fp, k
    assert fp["compute_to_a2a"] == fp["compute"] / fp["a2a"]
    assert out["schedule"] == "dualpipe" and out["pp"] == 16 and out["chunks"] == 32
    assert st["makespan_overlap"] < st["makespan_no_overlap"] and st["speedup"] > 1
    assert out["paper_setup"]["hardware"]["mfu"] == 0.5 and "break_even_mfu" in out["paper_setup"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # explicit components: the hidden cell above on 2 DualPipeV ranks
    args = [
        "simulate",
        "--schedule",
        "dualpipev",
        "--pp",
        "2",
        "--json",
        "--attention",
        "1",
        "--dispatch",
        "0.5",
        "--mlp",
        "1",
        "--combine",
        "0.75",
        "--combine-b",
        "0.5",
        "--mlp-b",
        "1",
        "--dispatch-b",
        "1",
        "--attention-b",
        "1",
        "--mlp-w",
        "0.5",
        "--attention-w",
        "0.5",
        "--pp-comm",
        "0.25",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fb_pair"]["fb"] == 5.0 and out["fb_pair"]["exposed_comm"] == 0.0
    assert main(args + ["--no-overlap"]) == 0
    assert json.loads(capsys.readouterr().out)["comm"]["overlap"] is False


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--paper-setup", "--mfu", "0"], "--mfu"),
        (["--paper-setup", "--mfu", "1.5"], "--mfu"),
        (["--paper-setup", "--ib-gbps", "0"], "--ib-gbps"),
        (["--mfu", "0.5"], "--mfu"),
        (["--paper-setup", "--f", "1"], "--f"),
        (["--paper-setup", "--attention", "1"], "--attention"),
        (["--attention", "1"], "--dispatch"),
        (["--fig4", "x.png"], "--fig4"),
        (["--layers", "2"], "--layers"),
        (["--paper-setup", "--layers", "0"], "--layers"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_flag(argv, flag, capsys):
    assert main(["simulate", *argv]) == 2
    assert flag in capsys.readouterr().err
