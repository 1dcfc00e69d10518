"""Routing telemetry (loads, MaxVio_batch/global, dropped tokens, cross-node copies) and `dsv3 plot-routing`."""

import json

import pytest
import torch
from tolerance import reorder_bound

from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.model.moe.balancing import update_expert_bias
from dsv3_plugin.parallel.expert_parallel import expert_parallel
from dsv3_plugin.parallel.groups import single_process_groups
from dsv3_plugin.training.telemetry import RoutingTelemetry
from dsv3_plugin.training.transforms import build_model


def _model():
    cfg = DSv3Config.from_block({"preset": "tiny", "mtp": {"depth": 0}, "model": {"num_hidden_layers": 2}})
    m = build_model(cfg)
    m.reset_parameters(seed=0)
    return expert_parallel(m, single_process_groups()).train(), cfg


def test_record_counts_every_routed_token():
    model, cfg = _model()
    tel = RoutingTelemetry(model, warmup_steps=1)
    recs = []
    for step in range(3):
        ids = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
        model(ids)
        recs.append(tel.record(update_expert_bias(model, 0.01)))
    r = recs[-1]
    assert list(r["moe_layers"]) == ["layers.1.mlp"]
    lay = r["moe_layers"]["layers.1.mlp"]
    assert sum(lay["loads"]) == 16 * cfg.moe.top_k  # every (token, slot) counted once
    loads = torch.tensor(lay["loads"], dtype=torch.float64)
    # integer loads: sum and mean (E = 16) are exact in float32; the divide and the −1 round (float32 vs this
    # float64 reference), each by <= u of max/mean
    ratio = float(loads.max() / loads.mean())
    assert abs(lay["maxvio_batch"] - (ratio - 1)) <= reorder_bound(2, ratio)
    assert lay["tokens_dropped"] == 0 and lay["cross_node_per_token"] == 0.0
    assert recs[0]["maxvio_global"] is None  # still warming up
    glob = torch.tensor([recs[i]["moe_layers"]["layers.1.mlp"]["loads"] for i in (1, 2)], dtype=torch.float64).sum(0)
    ratio = float(glob.max() / glob.mean())
    assert abs(lay["maxvio_global"] - (ratio - 1)) <= reorder_bound(2, ratio)  # as above
    json.dumps(r)  # JSON-ready


def test_dropped_tokens_are_reported():
    model, cfg = _model()
    tel = RoutingTelemetry(model)
    model(torch.zeros(1, 4, dtype=torch.long))
    layer = model.layers[1].mlp
    layer.dispatch_counters["processed_rows"] -= 3  # as if an expert had skipped three rows
    assert tel.record(update_expert_bias(model, 0.0))["tokens_dropped"] == 3


def _write_run(path, gamma, loads_fn):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for s in range(1, 6):
            loads = loads_fn(s)
            mv = max(loads) / (sum(loads) / len(loads)) - 1
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "gamma": gamma,
                        "maxvio_batch": mv,
                        "maxvio_global": mv if s > 2 else None,
                        "moe_layers": {"layers.1.mlp": {"loads": loads}},
                    }
                )
                + "\n"
            )


def test_plot_routing_png(tmp_path, capsys):
    _write_run(tmp_path / "on", 0.01, lambda s: [10, 11, 9, 10])
    _write_run(tmp_path / "off", 0.0, lambda s: [30, 5, 3, 2])
    out = tmp_path / "r.png"
    assert cli_main(["plot-routing", str(tmp_path / "on"), str(tmp_path / "off"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "empty").mkdir()
    assert cli_main(["plot-routing", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--layer"):
        from dsv3_plugin.training.routing_plot import plot_routing

        plot_routing([str(tmp_path / "on")], str(out), layer="nope")
    # default output: FIRST_RUN_DIR/routing.png
    assert cli_main(["plot-routing", str(tmp_path / "on")]) == 0
    assert (tmp_path / "on" / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_running_totals_survive_a_state_dict_round_trip():
    """What a checkpoint carries: a fresh telemetry loaded from step 2's state records step 3 as the original."""
    model, cfg = _model()
    tel = RoutingTelemetry(model, warmup_steps=1)
    batches = [
        torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)
    ]
    for ids in batches[:2]:
        model(ids)
        tel.record(update_expert_bias(model, 0.0))
    state = json.loads(json.dumps(tel.state_dict()))  # plain values
    model(batches[2])
    stats = update_expert_bias(model, 0.0)
    fresh = RoutingTelemetry(model)
    fresh.load_state_dict(state)
    assert fresh.record(stats) == tel.record(stats)
    assert RoutingTelemetry(model).record(stats) != tel.record(stats)  # without the state the totals differ
    with pytest.raises(ValueError, match="saved for routers"):
        RoutingTelemetry(model).load_state_dict({**state, "router_names": ["x"]})
