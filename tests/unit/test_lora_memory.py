"""The LoRA memory plan (`training.lora_memory`, `dsv3 memory-plan --lora-*`) against counts worked out by hand
for the tiny preset: adapters r·(d_in + d_out) per targeted matrix, the FP8 base's bytes with its 128×128 block
scales, the frozen BF16 parts, ZeRO-1's partition of the adapters' optimizer state; and the CLI's refusals."""

import json

from dsv3_plugin.cli import main
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.pipeline.trainable_gemms import adapter_params
from dsv3_plugin.training.lora_memory import fp8_matrix_bytes, lora_layer_delta, lora_rank_memory
from dsv3_plugin.training.memory_estimate import estimate_train_memory, model_param_count
from dsv3_plugin.training.memory_plan import GiB

# tiny: h 64, dense I 128, 3 layers (layer 0 dense), 4 heads, q_lora 32, kv_lora 32, d_nope 16, d_rope 8, d_v 16,
# 16 routed experts of I 32, top-4, 1 shared expert, vocab 256. Per layer, the matrices (d_out, d_in) and d_in + d_out:
# q_a (32, 64) 96; q_b (4·24, 32) 128; kv_a (32+8, 64) 104; kv_b (4·32, 32) 160; o (64, 4·16) 128 -> 616
# dense gate / up (128, 64), down (64, 128): 3·192 = 576; shared / one routed expert (32, 64), (64, 32): 3·96 = 288
R = 4
ATTN, DENSE, EXPERT = 616 * R, 576 * R, 288 * R  # 2464, 2304, 1152 adapter parameters


def _cfg(**lora):
    return DSv3Config.from_block({"preset": "tiny", "lora": {"rank": R, **lora}})


def test_adapter_counts_by_formula():
    cfg = _cfg()
    assert adapter_params(cfg, moe=False) == {"dense": ATTN + DENSE, "routed": 0}
    assert adapter_params(cfg, moe=True) == {"dense": ATTN + EXPERT, "routed": 0}  # shared only: experts off
    ex = _cfg(experts=True)
    assert adapter_params(ex, moe=True, ep=2) == {"dense": ATTN + EXPERT, "routed": EXPERT * 16 // 2}
    only = _cfg(targets=["o_proj", "down_proj"])  # o (64+64) and down (32+64 on the shared expert)
    assert adapter_params(only, moe=True) == {"dense": R * (128 + 96), "routed": 0}
    # the whole model on one rank: 3 attention blocks, 1 dense MLP, 2 shared experts (the MTP layer: none)
    m = lora_rank_memory(cfg, "1f1b", 1, 0, 1, 1)
    assert m.adapter_params == 3 * ATTN + DENSE + 2 * EXPERT == 12000


def test_fp8_base_and_frozen_bf16_bytes():
    assert fp8_matrix_bytes(576, 7168) == 576 * 7168 + 4 * 5 * 56  # kv_a_proj_with_mqa's scales are [5, 56]
    assert fp8_matrix_bytes(128, 128) == 128 * 128 + 4
    m = lora_rank_memory(_cfg(), "1f1b", 1, 0, 1, 1)  # lora.mtp off: no MTP layer
    # FP8 elements + 4 B per matrix (every tiny matrix is one 128×128 block)
    attn = 2048 + 3072 + 2560 + 4096 + 4096 + 5 * 4
    dense, shared, routed = 3 * 128 * 64 + 12, 3 * 32 * 64 + 12, 16 * (3 * 32 * 64 + 12)
    assert m.base_fp8_GiB * GiB == 3 * attn + dense + 2 * (shared + routed) == 281568
    # BF16: norms (2·64 + 32 + 32 a layer), routers (16 × 64, + the FP32 bias of 16), embedding, head + final norm
    bf16 = 2 * (3 * 192 + 2 * 16 * 64 + 256 * 64 + 256 * 64 + 64) + 2 * 4 * 16
    assert m.frozen_bf16_GiB * GiB == bf16
    frozen = lora_rank_memory(_cfg(mtp="frozen"), "1f1b", 1, 0, 1, 1)  # + an MoE layer, eh_proj, 3 norms: no adapter
    extra_bf16 = 2 * (192 + 16 * 64 + 2 * 64 * 64 + 3 * 64) + 4 * 16
    assert frozen.base_fp8_GiB * GiB == 281568 + attn + shared + routed
    assert frozen.frozen_bf16_GiB * GiB == bf16 + extra_bf16
    assert frozen.adapter_params == m.adapter_params


def test_zero1_partitions_only_the_adapters_state():
    cfg = _cfg(experts=True)
    dense, routed = 12000, 2 * EXPERT * 16 // 2  # 2 MoE layers, this EP rank's 8 experts (3 matrices each)
    m = lora_rank_memory(cfg, "1f1b", 1, 0, 2, 4)
    assert m.adapter_params == dense + routed
    assert m.adapters_GiB * GiB == m.adapter_grads_GiB * GiB == 4 * (dense + routed)  # FP32, not partitioned
    # AdamW's two FP32 moments over DP = 4 (dense adapters) and DP / EP = 2 (expert adapters)
    assert m.optimizer_GiB * GiB == 8 * (dense / 4 + routed / 2)
    half = lora_rank_memory(cfg, "1f1b", 1, 0, 2, 4, bf16_moments=True, adapter_bytes=2)  # + FP32 master
    assert half.optimizer_GiB * GiB == (4 + 4) * (dense / 4 + routed / 2)
    assert half.adapters_GiB * GiB == 2 * (dense + routed)


def test_activations_and_temporary():
    cfg = _cfg(experts=True)
    # every GEMM adapted: every Linear input stays; the adapters add A·x [64 tokens, r] in BF16 per matrix
    d = lora_layer_delta(cfg, True, 64, "none")
    assert d["adapters"] == 2 * R * 64 * (5 + 3 + 3 * 4)  # 5 attention, 3 shared, 3 routed on top-4 rows
    assert sum(v for k, v in d.items() if k != "adapters") == 0
    assert sum(lora_layer_delta(cfg, True, 64, "full").values()) == 0  # only the layer input is kept
    only_o = lora_layer_delta(_cfg(targets=["o_proj"]), False, 64, "none")
    # dropped: the normed x (q_a / kv_a), q_b's and kv_b's inputs, gate / up's and down's inputs (dense layer)
    assert only_o["mla_proj"] == -2 * 64 * (64 + 32 + 32) and only_o["dense_mlp"] == -2 * 64 * (64 + 128)
    drop = lora_layer_delta(_cfg(targets=["o_proj"], dropout=0.1), False, 64, "none")
    assert drop["adapters"] - only_o["adapters"] == (2 + 1) * 64 * 64  # dropout(x) in BF16 and its mask
    m = lora_rank_memory(cfg, "1f1b", 1, 0, 1, 1)
    assert m.gemm_temp_GiB * GiB == 2 * 128 * 64  # the largest matrix (dense gate / up / down) dequantized
    assert lora_rank_memory(cfg, "1f1b", 1, 0, 1, 1, fp8=True).gemm_temp_GiB * GiB == 128 * 64  # FP8 transpose


def test_cli_plans_lora_and_refuses_bad_flags(capsys):
    assert main(["memory-plan", "--preset", "tiny", "--dp", "4", "--ep", "2", "--lora-rank", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora_rank"] == 4 and out["ranks"][0]["adapter_params"] == 12000
    for flags, where in (
        (["--lora-rank", "0"], "--lora-rank: must be >= 1 (got 0)"),
        (["--lora-targets", "q_proj"], "--lora-targets q_proj: dsv3.lora.targets.0: 'q_proj' names no module"),
    ):
        assert main(["memory-plan", "--preset", "tiny", "--dp", "1", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {where}") and err.count("\n") == 1, err


def test_v3_lora_fits_two_nodes_only_with_full_recompute():
    """docs/finetune.md §9: DeepSeek-V3 LoRA r = 16 on 2 × 8 GPUs (pp 2, EP 8, DualPipeV) plans under 72 GiB a
    rank with full recompute, over it with less."""
    cfg = DSv3Config.from_block({"preset": "v3-671b", "lora": {"rank": 16}})

    def worst(rec):
        ranks = [lora_rank_memory(cfg, "dualpipev", 2, r, 8, 8, micro_batch_tokens=4096, recompute=rec) for r in (0, 1)]
        return max(m.total_GiB for m in ranks)

    assert worst("full") < 72 < worst("norm_and_mla_up")


def test_host_estimate_with_lora_counts_no_base_gradient_or_optimizer():
    """`dsv3 train`'s lower bound (training.memory_estimate): a frozen base has no gradient and no optimizer state,
    and takes at least its FP8 bytes; the full-training estimate would refuse runs LoRA fits."""
    full = estimate_train_memory(DSv3Config.from_block({"preset": "tiny"}))
    lora = estimate_train_memory(_cfg())
    P = model_param_count(DSv3Config.from_block({"preset": "tiny", "mtp": {"depth": 0}}))  # lora.mtp off: no MTP layer
    assert lora.parts["gradients"] == lora.parts["optimizer"] == 0 and lora.parts["weights"] == P
    assert lora.per_rank_bytes == P + 4 * 64 * 256 < full.per_rank_bytes  # + the logits of one 64-token row
