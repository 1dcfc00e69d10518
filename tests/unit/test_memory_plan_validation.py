"""`dsv3 memory-plan` runs the validation `dsv3 check-config` / `dsv3 train` run, for the layout it plans, before it
plans (issue 27): what check-config refuses it refuses with exit 2, the same reason, and the flag that made the layout
wrong, in well under a second of work (it used to plan `--pp 1000` on a 3-layer model for minutes and gigabytes, and
to plan `--pp 30`, which check-config refuses)."""

import json
import time

import pytest

from dsv3_plugin.cli import main

OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}


def _ds(tmp_path, block: dict, name: str = "ds.json", **keys) -> str:
    p = tmp_path / name
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": OPTIMIZER, **keys, "dsv3": block}))
    return str(p)


def _err(capsys, argv: list[str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    assert main(argv) == 2
    dt = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: ") : -1], dt


@pytest.mark.parametrize("pp", [30, 1000])
def test_a_pipeline_check_config_refuses_is_refused_fast_with_its_reason(tmp_path, capsys, pp):
    """The issue's two cases on the tiny preset (3 layers): check-config's reason, led by --pp."""
    checked, _ = _err(
        capsys, ["check-config", _ds(tmp_path, {"preset": "tiny", "parallel": {"pp": pp}}), "--nproc", str(pp)]
    )
    plan, dt = _err(capsys, ["memory-plan", "--preset", "tiny", "--pp", str(pp), "--dp", "1"])  # (modules loaded)
    assert plan == f"--pp {pp}: {checked}"
    assert dt < 1.0, f"{dt:.2f} s to refuse"
    # with a --config file the flag overrides its block, and the file's DeepSpeed keys are checked too
    conf = _ds(tmp_path, {"preset": "tiny"})
    plan, dt = _err(capsys, ["memory-plan", "--config", conf, "--pp", str(pp), "--dp", "1"])
    assert plan == f"--pp {pp}: {checked}"


def test_the_world_of_pp_times_dp_ranks_is_checked_as_check_config_checks_nproc(tmp_path, capsys):
    plan, _ = _err(capsys, ["memory-plan", "--preset", "v3-671b", "--pp", "16", "--ep", "64", "--dp", "96"])
    block = {"preset": "v3-671b", "parallel": {"pp": 16, "ep": 64}}
    checked, _ = _err(capsys, ["check-config", _ds(tmp_path, block, gradient_accumulation_steps=32), "--nproc", "1536"])
    assert plan == f"--dp 96: {checked}" and checked.startswith("dsv3.parallel.ep: must divide the data-parallel size")


def test_the_config_file_is_validated_whole(tmp_path, capsys):
    """A --config file check-config refuses (a DeepSpeed key, a value of its block) is refused as check-config refuses
    it, whatever the flags."""
    for keys, block in (
        ({"zero_optimization": {"stage": 3}}, {"preset": "tiny"}),
        ({}, {"preset": "tiny", "moe": {"route_scale": 1e30}}),
    ):
        conf = _ds(tmp_path, block, **keys)
        plan, _ = _err(capsys, ["memory-plan", "--config", conf, "--dp", "1"])
        checked, _ = _err(capsys, ["check-config", conf])
        assert plan == checked


def test_other_flags_are_named_when_they_break_a_rule(tmp_path, capsys):
    plan, _ = _err(capsys, ["memory-plan", "--preset", "tiny", "--micro-batch-tokens", "100000", "--dp", "1"])
    assert plan.startswith("--micro-batch-tokens 100000: dsv3.train.seq_len: must be <= model.max_position_embeddings")
    plan, _ = _err(capsys, ["memory-plan", "--preset", "tiny", "--ep", "3", "--dp", "3"])
    assert plan.startswith("--ep 3: dsv3.parallel.ep: must divide moe.n_routed_experts")
    plan, _ = _err(capsys, ["memory-plan", "--preset", "tiny", "--dp", "0"])
    assert plan == "--dp: must be >= 1 (got 0)"
    plan, _ = _err(
        capsys, ["memory-plan", "--preset", "tiny", "--pp", "2", "--dp", "1", "--materialize", "--pp-rank", "5"]
    )
    assert plan == "--pp-rank 5: outside 0..1 (the layout has 2 such ranks)"
    plan, _ = _err(capsys, ["memory-plan", "--preset", "tiny", "--dp", "1", "--schedule", "dualpipev"])
    assert plan.startswith("--schedule: names the schedule of the --materialize rank")


def test_a_valid_layout_plans_and_the_schedules_it_cannot_run_are_listed_with_the_reason(tmp_path, capsys):
    assert main(["memory-plan", "--preset", "tiny", "--pp", "2", "--dp", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in d["ranks"]] == ["1f1b", "dualpipe", "dualpipev"] and d["not_planned"] == {}
    # DualPipe on 4 ranks of a 3-layer model: the config's schedule plans; 1F1B and DualPipeV on 4 ranks would leave a
    # rank without a layer, as check-config says for them
    block = {"preset": "tiny", "parallel": {"pp": 4, "schedule": "dualpipe"}}
    conf = _ds(tmp_path, block, gradient_accumulation_steps=8)
    assert main(["memory-plan", "--config", conf, "--dp", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in d["ranks"]] == ["dualpipe"] and sorted(d["not_planned"]) == ["1f1b", "dualpipev"]
    for sched, why in d["not_planned"].items():
        other = _ds(
            tmp_path, {**block, "parallel": {"pp": 4, "schedule": sched}}, "other.json", gradient_accumulation_steps=8
        )
        checked, _ = _err(capsys, ["check-config", other, "--nproc", "4"])
        assert why == checked
    assert main(["memory-plan", "--config", conf, "--dp", "1"]) == 0
    out = capsys.readouterr().out
    assert "not planned: 1f1b (dsv3.model.num_hidden_layers: 1f1b with pp=4 needs >= 5 decoder layers" in out
