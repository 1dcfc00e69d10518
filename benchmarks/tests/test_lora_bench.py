"""`python -m benchmarks lora` at a tiny shape (1 step each): the JSON's figures, and that the models compared are
the same model on the same batch: one base (the FP8 buffers dequantize to the FP32 weights exactly), equal adapter
sizes, first-step losses (B = 0: the base's) reproduced exactly in this process, equal where the op sequence is the
same and within the reordering bound between ours and transformers + peft (no timing assertions)."""

import argparse

import torch
from tolerance import assert_within, model_bound

from benchmarks import lora
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.precision.fp8.quant import FP8_DTYPE, dequantize_blockwise

T, B = 16, 2
TINY = ["--preset", "tiny", "--seq-len", str(T), "--batch", str(B), "--rounds", "1", "--steps", "1", "--warmup", "1"]


def _run() -> dict:
    p = argparse.ArgumentParser()
    lora.add_arguments(p)
    return lora.run(p.parse_args([*TINY, "--threads", "1"]))


def _dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if q.dim() == 2:
        return dequantize_blockwise(q, s)
    return torch.stack([dequantize_blockwise(qe, se) for qe, se in zip(q, s)])  # routed experts [E, O, K]


def test_tiny_run_reports_the_figures_of_one_lora_on_one_base_and_batch(tmp_path):
    d = _run()
    assert d["bench"] == "lora" and {"ours", "baseline", "ratio", "env"} <= set(d)
    bases = {"fp8_base", "fp32_base"}
    assert set(d["ours"]) == set(d["ratio"]) == set(d["ratio_step_peak_rss"]) == bases
    assert set(d["ratio_step_peak_over_imports"]) == bases and set(d["lora_vs_full"]) == set(lora.LORA_VS_FULL)
    res = d["results"]
    for b in ("fp8_base", "fp32_base"):
        lo = res["lora_" + b.removesuffix("_base")]
        assert d["ratio"][b] == d["baseline"] / d["ours"][b] and d["ours"][b] == lo["cpu_ms"] > 0
    for key, (lo_i, full_i) in lora.LORA_VS_FULL.items():  # LoRA vs the full fine-tune of the same model
        lo, full, vs = res[lo_i], res[full_i], d["lora_vs_full"][key]
        assert vs["full"] == full_i
        assert vs["full_over_lora_cpu"] == full["cpu_ms"] / lo["cpu_ms"]
        assert vs["lora_faster"] == (lo["cpu_ms"] < full["cpu_ms"])
        assert vs["lora_lower_step_peak"] == (lo["step_peak_rss_mib"] < full["step_peak_rss_mib"])
    assert set(d["base_precision"]) == {"release", *lora.IMPLS} == {"release", *d["gemm_ms"]}
    for i, r in res.items():  # a step's GEMMs and fused attention: part of it, never all of it
        assert 0 < r["gemm_share"] < 1 and d["gemm_ms"][i] == r["gemm_share"] * r["cpu_ms"], i
    assert d["step_ms_for_1_5x_peft"] == d["baseline"] / 1.5
    targets = res["lora_fp32"]["targets"]
    assert targets == res["lora_fp8"]["targets"] == d["setup"]["targets"] and "o_proj" in targets
    assert res["lora_fp8"]["trainable"] == res["lora_fp32"]["trainable"] == res["peft_fp32"]["trainable"] > 0
    assert res["full_fp32"]["trainable"] == res["full_fp8"]["trainable"] > res["lora_fp32"]["trainable"]
    assert res["lora_fp8"]["frozen_mib"] < res["lora_fp32"]["frozen_mib"]  # 1 byte a GEMM weight, not 4

    loss = {i: torch.tensor(v, dtype=torch.float32) for i, v in d["first_step_loss"].items()}
    # our LoRA with B = 0 adds exact zeros to our full model's op sequence; FP8 training re-quantizes the dequantized
    # release into the same blocks and runs the frozen FP8 base's forward op for op: the same model in both pairs
    assert torch.equal(loss["lora_fp32"], loss["full_fp32"]) and torch.equal(loss["lora_fp8"], loss["full_fp8"])
    # transformers + peft: the same math on the same FP32 weights, reductions ordered differently (forward only)
    bound = model_bound(loss["lora_fp32"], DSv3Config.from_block(lora._block("tiny", T)), tokens=B * T, passes=1)
    assert_within(loss["peft_fp32"], loss["lora_fp32"], bound, "peft's first-step loss")

    # the same base (the bench's is seeded: written again here) and batch, in this process at the children's 1 thread
    spec = {"preset": "tiny", "seq_len": T, "batch": B, "rank": 16, "alpha": 32.0, "seed": 0}
    spec["base"] = lora.write_base(str(tmp_path / "base"), "tiny", T, 0)
    m8, step8, *_ = lora.build_ours("lora_fp8", spec)
    m32, step32, *_ = lora.build_ours("lora_fp32", spec)
    fp8 = {n: b for n, b in m8.named_buffers() if b.dtype == FP8_DTYPE}
    assert fp8
    for n, q in fp8.items():  # every frozen FP8 GEMM weight dequantizes exactly to the FP32 model's weight
        assert torch.equal(_dequantized(q, m8.get_buffer(n + "_scale_inv")), m32.get_parameter(n)), n
    p8 = dict(m8.named_parameters())
    for n, p in m32.named_parameters():  # the rest (norms, embedding, head, routers, adapters) is the same
        assert n in fp8 or torch.equal(p8[n], p), n
    ids = lora.batch(spec, m32.embed_tokens.weight.shape[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # the children's losses, op for op: the FP8 one is this FP8 base's on this batch
        assert torch.equal(step8(ids).detach(), loss["lora_fp8"])
        assert torch.equal(step32(ids).detach(), loss["lora_fp32"])
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(loss["lora_fp8"], loss["lora_fp32"])  # the FP8 GEMMs ran
