"""Per-rank memory of LoRA fine-tuning on the frozen FP8 release (Hu et al. 2021; DeepSeek-V3 §3.3 weights).

A `d_out × d_in` matrix with an adapter adds A [r, d_in] and B [d_out, r]: r·(d_in + d_out) trainable parameters.
The base stays as released: decoder Linears and routed experts in FP8 E4M3 (1 B) + one FP32 `weight_scale_inv`
per 128×128 block; embedding, head, norms, router and `eh_proj` in BF16 (router bias FP32). Frozen tensors
have no gradient and no optimizer state; ZeRO-1 splits the adapters' state over DP (expert adapters over DP/EP).
Activations: `memory_plan.stage_activation` without the inputs of frozen GEMMs no adapter reads (a frozen
weight needs no Wgrad), plus each adapter's A·x (and its dropout input and mask). One frozen GEMM at a time
holds a temporary: its weight dequantized (BF16 compute) or its FP8 transpose for Dgrad (FP8 GEMMs).
NOTE: norms keep their full-training internals (an upper bound); `lora.mtp = off` plans no MTP layer;
`frozen` plans it without adapters. Formulas: docs/finetune.md (#memory-plan-for-lora).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.parallel.pipeline.trainable_gemms import adapter_params, is_adapted, layer_matrices
from dsv3_plugin.schedule_traits import schedule_traits
from dsv3_plugin.training.memory_plan import (
    COMPONENTS,
    GiB,
    _stage_layers,
    inflight_peak,
    rank_params,
    stage_activation,
)

__all__ = [
    "BLOCK",
    "LORA_COMPONENTS",
    "fp8_matrix_bytes",
    "lora_layer_delta",
    "LoRARankMemory",
    "lora_rank_memory",
    "lora_plan_ranks",
    "lora_plan",
    "format_lora_table",
]

BLOCK = 128  # the release's weight_block_size [128, 128]
LORA_COMPONENTS = (*COMPONENTS, "adapters")
_ATTN_IN = ("q_proj", "q_a_proj", "kv_a_proj_with_mqa")  # GEMMs that read the normed layer input


def fp8_matrix_bytes(d_out: int, d_in: int) -> int:
    """A released FP8 matrix: 1 B per element + an FP32 `weight_scale_inv` [⌈d_out/128⌉, ⌈d_in/128⌉]."""
    return d_out * d_in + 4 * math.ceil(d_out / BLOCK) * math.ceil(d_in / BLOCK)


def lora_layer_delta(
    cfg: DSv3Config, moe: bool, tokens: int, recompute: str, act_bytes: int = 2, mtp: bool = False
) -> dict:
    """Bytes LoRA changes in one layer's saved activations (`layer_activation`, BF16 path) over `tokens`
    tokens: minus the inputs of frozen GEMMs that no adapter reads, plus each adapter's A·x [tokens, r] (with
    dropout, its dropped input and a 1-byte mask). Under full recompute only the layer input is kept: 0."""
    d = {c: 0.0 for c in LORA_COMPONENTS}
    if recompute == "full":
        return d
    m, e, lo = cfg.model, cfg.moe, cfg.lora
    M, A, rec = tokens, act_bytes, recompute == "norm_and_mla_up"
    h, nh = m.hidden_size, m.num_attention_heads
    mats = layer_matrices(cfg, moe)
    on = {(n, g) for n, g, _, _ in mats if is_adapted(cfg, n, g, mtp)}
    names = {n for n, _ in on}
    if not rec and not names & set(_ATTN_IN):
        d["mla_proj"] -= A * h * M  # q_a / kv_a input (the normed x)
    if not rec and m.q_lora_rank and "q_b_proj" not in names:
        d["mla_proj"] -= A * m.q_lora_rank * M
    if not rec and "kv_b_proj" not in names:
        d["mla_proj"] -= A * m.kv_lora_rank * M
    if "o_proj" not in names:
        d["mla_proj"] -= A * nh * m.v_head_dim * M
    up = ("gate_proj", "up_proj")
    if moe:
        rows = e.top_k * M
        shared_up = any((n, "shared") in on for n in up)
        if not rec and not shared_up:
            d["router"] -= A * h * M  # the normed x the frozen router and the shared experts' gate / up read
        if not any((n, "routed") in on for n in up):
            d["dispatch"] -= A * h * rows  # the gathered rows the experts' gate / up read
        if ("down_proj", "routed") not in on:
            d["experts"] -= A * e.intermediate_size * rows
        if e.n_shared_experts and ("down_proj", "shared") not in on:
            d["shared_experts"] -= A * e.intermediate_size * e.n_shared_experts * M
    else:
        if not rec and not any((n, "dense_mlp") in on for n in up):
            d["dense_mlp"] -= A * h * M
        if ("down_proj", "dense_mlp") not in on:
            d["dense_mlp"] -= A * m.intermediate_size * M
    for name, group, _, d_in in mats:
        if (name, group) in on:
            n = e.top_k * M if group == "routed" else M  # rows through this matrix
            d["adapters"] += A * lo.rank * n  # A x, B's input
            if lo.dropout > 0:
                d["adapters"] += (A + 1) * d_in * n  # dropout(x), A's input, and its mask
    return d


def _stage_activation(cfg, layer_ids, seq, first, last, recompute, A) -> dict:
    """`stage_activation` of one `seq`-token micro-batch (BF16 path) with each decoder / MTP layer's
    `lora_layer_delta`, and without the inputs of the frozen head and `eh_proj`."""
    out = {**stage_activation(cfg, layer_ids, 1, seq, first, last, recompute, False, A), "adapters": 0.0}
    deltas = [lora_layer_delta(cfg, cfg.is_moe_layer(i), seq, recompute, A) for i in layer_ids]
    if last:
        out["head_mtp"] -= A * cfg.model.hidden_size * seq  # the head's input
        for k in range(1, cfg.mtp.depth + 1):
            S = max(seq - k, 0)
            if S:
                deltas.append(lora_layer_delta(cfg, True, S, recompute, A, mtp=True))
                out["head_mtp"] -= 3 * A * cfg.model.hidden_size * S  # eh_proj's input [2h], the MTP head's
    for dl in deltas:
        for c, v in dl.items():
            out[c] += v
    return out


@dataclass
class LoRARankMemory:
    """One pipeline rank's LoRA memory (GiB): the frozen base, the adapters' state, activations, the temporary."""

    schedule: str
    pp_rank: int
    layers_on_rank: int
    inflight: list
    base_fp8_GiB: float  # FP8 weights + their FP32 block scales
    frozen_bf16_GiB: float  # embedding, head, norms, router (+ FP32 bias), eh_proj
    adapters_GiB: float
    adapter_grads_GiB: float
    optimizer_GiB: float  # ZeRO-1 partition of the adapters' moments (+ FP32 master for BF16 adapters)
    activations_GiB: float
    gemm_temp_GiB: float  # one frozen matrix dequantized (BF16 GEMMs) or its FP8 transpose (FP8 GEMMs)
    total_GiB: float
    adapter_params: int = 0
    activations_by_component_GiB: dict = field(default_factory=dict)


def _planned_cfg(cfg: DSv3Config) -> DSv3Config:
    if cfg.lora is None:
        raise ConfigError("dsv3.lora: the LoRA plan needs a lora block (null plans full fine-tuning)")
    return cfg.model_copy(update={"mtp": cfg.mtp.model_copy(update={"depth": 0})}) if cfg.lora.mtp == "off" else cfg


def _frozen_bytes(cfg: DSv3Config, i: int | None, ep: int) -> tuple[float, float, int]:
    """(FP8 bytes, BF16/FP32 bytes, largest matrix's elements) of decoder layer `i` (None: an MTP layer, MoE)."""
    m, e = cfg.model, cfg.moe
    moe = True if i is None else cfg.is_moe_layer(i)
    fp8, big = 0.0, 0
    for _, group, d_out, d_in in layer_matrices(cfg, moe):
        n = e.n_routed_experts // ep if group == "routed" else 1
        fp8 += n * fp8_matrix_bytes(d_out, d_in)
        big = max(big, d_out * d_in)
    norms = 2 * m.hidden_size + (m.q_lora_rank or 0) + m.kv_lora_rank
    bf16 = 2 * norms + ((2 * m.hidden_size + 4) * e.n_routed_experts if moe else 0)  # router weight, FP32 bias
    return fp8, bf16, big


def lora_rank_memory(
    cfg: DSv3Config,
    schedule: str,
    pp: int,
    pp_rank: int,
    ep: int,
    dp: int,
    *,
    micro_batch_tokens: int | None = None,
    recompute: str | None = None,
    fp8: bool | None = None,
    bf16_moments: bool | None = None,
    adapter_bytes: int = 4,
    grad_bytes: int = 4,
    act_bytes: int = 2,
) -> LoRARankMemory:
    """LoRA memory of pipeline rank `pp_rank` (any EP rank). `fp8`: the frozen GEMMs run in FP8 (else BF16 on a
    dequantized weight); `adapter_bytes` 4 (FP32 adapters) or 2 (BF16, with an FP32 master in the optimizer)."""
    if dp % ep:
        raise ConfigError(f"dsv3.parallel.ep: EP ranks are carved out of DP; ep must divide dp (got dp={dp}, ep={ep})")
    c = _planned_cfg(cfg)
    seq = micro_batch_tokens or c.train.seq_len
    recompute = c.memory.recompute if recompute is None else recompute
    fp8 = c.fp8.enabled if fp8 is None else fp8
    bf16_moments = c.memory.bf16_moments if bf16_moments is None else bf16_moments
    t = schedule_traits(schedule, "parallel.schedule")
    rp = rank_params(c, schedule, pp, pp_rank, ep)
    D = c.mtp.depth
    last = t.n_stages(pp) - 1
    holds_last = last in rp.stages
    fp8_b = bf16_b = 0.0
    big, dense_n, routed_n = 0, 0, 0
    for i in [*rp.layers, *([None] * (D if holds_last else 0))]:
        f, b, g = _frozen_bytes(c, i, ep)
        fp8_b, bf16_b, big = fp8_b + f, bf16_b + b, max(big, g)
        if i is not None:
            n = adapter_params(c, c.is_moe_layer(i), ep)
            dense_n, routed_n = dense_n + n["dense"], routed_n + n["routed"]
    bf16_b += 2 * (rp.by_part["embed"] + rp.by_part["head"])  # the head's part includes the final norm
    bf16_b += 2 * rp.by_part["mtp_extra"]  # eh_proj, enorm, hnorm, the MTP head's norm (BF16 as released)
    stages = _stage_layers(c, schedule, pp)
    per_chunk = [
        _stage_activation(c, stages[s], seq, s == 0, s == last, recompute, act_bytes) for s in t.stage_ids(pp, pp_rank)
    ]
    peak, live = inflight_peak(schedule, pp, pp_rank, [sum(x.values()) for x in per_chunk])
    acts = {k: sum(n * x[k] for n, x in zip(live, per_chunk)) for k in LORA_COMPONENTS}
    n_ad = dense_n + routed_n
    per_state = (4 if bf16_moments else 8) + (4 if adapter_bytes != 4 else 0)
    optim = per_state * (dense_n / dp + routed_n / (dp // ep))
    temp = big * (1 if fp8 else act_bytes)
    parts = [fp8_b, bf16_b, adapter_bytes * n_ad, grad_bytes * n_ad, optim, peak, temp]
    return LoRARankMemory(
        schedule,
        pp_rank,
        len(rp.layers),
        live,
        *(p / GiB for p in parts),
        sum(parts) / GiB,
        n_ad,
        {k: v / GiB for k, v in acts.items()},
    )


def lora_plan_ranks(cfg: DSv3Config, schedule: str, pp: int, ep: int, dp: int, **kw) -> list[LoRARankMemory]:
    """Every pipeline rank's LoRA memory for `schedule`."""
    return [lora_rank_memory(cfg, schedule, pp, r, ep, dp, **kw) for r in range(pp)]


def lora_plan(cfg: DSv3Config, pp: int, ep: int, dp: int, schedules, **kw) -> list[LoRARankMemory]:
    """The worst pipeline rank of each schedule in `schedules`."""
    return [max(lora_plan_ranks(cfg, s, pp, ep, dp, **kw), key=lambda r: r.total_GiB) for s in schedules]


def format_lora_table(rows: list[LoRARankMemory]) -> str:
    """The rows as a text table (GiB), then activations by component."""
    cols = [k for k in asdict(rows[0]) if k != "activations_by_component_GiB"] if rows else []
    lines = ["  ".join(f"{c:>17}" for c in cols)]
    for r in rows:
        d = asdict(r)
        d["inflight"] = "+".join(str(n) for n in r.inflight)
        lines.append("  ".join(f"{d[c]:>17.2f}" if isinstance(d[c], float) else f"{d[c]:>17}" for c in cols))
    used = [c for c in LORA_COMPONENTS if any(r.activations_by_component_GiB[c] for r in rows)]
    lines += ["", "activations by component (GiB):", "  ".join(f"{c:>15}" for c in ["schedule", *used])]
    for r in rows:
        lines.append("  ".join([f"{r.schedule:>15}"] + [f"{r.activations_by_component_GiB[c]:>15.2f}" for c in used]))
    return "\n".join(lines)
