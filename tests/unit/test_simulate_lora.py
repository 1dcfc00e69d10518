"""The simulator knows a frozen GEMM has no W op: with `dsv3.lora` the W cost is the adapters' weight-gradient
FLOPs, 2·T·r·(d_in + d_out) per adapted matrix (`comm_model.layer_flops`), and `dsv3 simulate --paper-setup
--lora-rank R` schedules with it."""

import json

from dsv3_plugin.cli import main
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.pipeline.comm_model import Hardware, layer_flops, paper_setup
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.simulate import Durations, simulate

T, R = 4096, 16
# DeepSeek-V3's attention matrices, d_in + d_out: q_a 7168 + 1536, q_b 1536 + 128·192, kv_a 7168 + 576,
# kv_b 512 + 128·256, o 128·128 + 7168; a shared expert's (or one routed expert's) gate, up, down: 3 × (7168 + 2048)
ATTN_SUM = 8704 + 26112 + 7744 + 33280 + 23552
EXPERT_SUM = 3 * (7168 + 2048)


def _v3(**lora):
    return DSv3Config.from_block({"preset": "v3-671b", "lora": {"rank": R, **lora}})


def test_w_flops_are_the_adapters_weight_gradients():
    fl = layer_flops(_v3(), T)
    assert fl["attention_w"] == {"fp8": 0.0, "bf16": 2.0 * T * R * ATTN_SUM}  # no base Wgrad, router frozen
    assert fl["mlp_w"] == {"fp8": 0.0, "bf16": 2.0 * T * R * EXPERT_SUM}  # the shared expert only
    ex = layer_flops(_v3(experts=True), T)
    assert ex["mlp_w"]["bf16"] == 2.0 * T * R * EXPERT_SUM * (1 + 8)  # + top-8 routed rows per token
    full = layer_flops(DSv3Config.from_block({"preset": "v3-671b"}), T)
    # forward and input gradient keep the frozen GEMMs and add one adapter pass each
    assert fl["attention"]["fp8"] == full["attention"]["fp8"]
    assert fl["mlp_b"] == {"fp8": full["mlp_b"]["fp8"], "bf16": fl["mlp_w"]["bf16"]}


def test_simulated_w_ops_take_the_adapters_time():
    hw = Hardware()
    comp, _ = paper_setup(hw, layers=4, cfg=_v3())
    full, _ = paper_setup(hw, layers=4)
    w = 4 * hw.compute_ms(0.0, 2.0 * T * R * (ATTN_SUM + EXPERT_SUM))
    assert abs(comp.w - w) <= 1e-12 * w
    assert comp.w < full.w / 100 and comp.f > full.f
    res = simulate(build_schedule("dualpipev", 4, 8), Durations.from_components(comp))
    ws = [e["end"] - e["start"] for e in res.timeline if e["kind"] == "W"]
    assert ws and all(abs(d - comp.w) <= 1e-9 * comp.b for d in ws)


def test_cli_lora_flags(capsys):
    assert main(["simulate", "--paper-setup", "--pp", "4", "--chunks", "8", "--lora-rank", str(R), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["paper_setup"]["lora"]["rank"] == R
    assert out["components"]["mlp_w"] == Hardware().compute_ms(0.0, 2.0 * T * R * EXPERT_SUM)
    assert main(["simulate", "--lora-rank", "4"]) == 2  # no model to derive W from
    assert main(["simulate", "--paper-setup", "--lora-targets", "q_proj"]) == 2  # V3 has q_a / q_b
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("error: --lora-rank 4: needs --paper-setup") and "'q_proj' names no module" in err[1]
