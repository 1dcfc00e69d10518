"""`dsv3 train` with expert parallelism (EP=2 on 2 ranks, one rank per simulated node): the JSON lines carry
the routing telemetry (loads, MaxVio_batch/global, cross-node copies per token, dropped tokens = 0) and the
router biases end identical on every rank."""

from helpers import run_ranks


def _train_ep2():
    from dsv3_plugin.deepspeed.run_config import default_ds_config
    from dsv3_plugin.deepspeed.train import train

    ds = default_ds_config()
    ds["dsv3"]["parallel"] = {"ep": 2}
    ds["dsv3"]["train"]["seq_len"] = 32
    res = train(ds, steps=3, progress=False, echo=False, save=False)
    return res["history"], res["router_bias"]


def test_train_ep2_telemetry():
    (hist, bias0), (hist1, bias1) = run_ranks(_train_ep2, 2)
    assert bias0 == bias1  # counts all-reduced over DP x EP
    assert any(v != 0 for b in bias0.values() for v in b)  # and the bias did move
    drop = lambda h: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in h]  # noqa: E731 (timing)
    assert drop(hist) == drop(hist1)  # every rank recorded the same step metrics
    from dsv3_plugin.config import DSv3Config

    M = DSv3Config.from_block({"preset": "tiny"}).moe.topk_group
    for rec in hist:
        assert rec["tokens_dropped"] == 0
        assert 0 < rec["cross_node_per_token"] <= M
        assert rec["maxvio_batch"] == rec["maxvio"] and rec["maxvio_global"] is not None
        layers = rec["moe_layers"]
        assert list(layers) == ["layers.1.mlp", "layers.2.mlp", "mtp.0.layer.mlp"]
        for lay in layers.values():
            assert len(lay["loads"]) == 16 and lay["tokens_dropped"] == 0
