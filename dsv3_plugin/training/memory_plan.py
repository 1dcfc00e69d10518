"""Per-rank training-memory estimate for DeepSeek-V3 under PP × DP (with EP inside DP) and ZeRO-1
(report §3.1–3.3; DualPipe table of parameter copies and in-flight activations).

Per rank and pipeline schedule:

* params     — BF16 compute copy of the rank's stages (`2` bytes/param). DualPipe holds two stages per
               rank (stage r and PP−1−r: 2 copies of the model overall); DualPipeV splits the model into
               2·PP chunks, rank r holding chunks r and 2PP−1−r (1 copy); 1F1B one stage.
* grads      — FP32 gradient accumulation buffers (report §3.3.3), `4` bytes/param.
* optimizer  — FP32 master weights + AdamW moments (FP32, or BF16 with `memory.bf16_moments`), partitioned
               by ZeRO-1 over the data-parallel replicas of each parameter: `dp` for dense parameters,
               `dp / ep` for routed experts (EP shards the experts; EP ranks are carved out of DP).
* activations — saved-for-backward bytes per token per layer (`layer_activation_bytes`, the same tensors
               this package's model keeps, checked against a measurement in the tests) × tokens of one
               micro-batch × layers per stage × in-flight micro-batches of the schedule on its worst rank:
               1F1B: PP − r on rank r; DualPipe: PP+1; DualPipeV: 2PP+1 chunks of half the layers (the
               DualPipe README's per-device bound, used for every rank).

Embedding on the first stage; output head, final norm and the MTP modules on the last stage (with DualPipe
they share a rank, as in the report). Layers are split by the pipeline's own rule
(`parallel.pipeline.stages.model_stage_layers`: the last stage's head and MTP modules count as layers).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.parallel.pipeline.stages import model_stage_layers
from dsv3_plugin.schedule_traits import schedule_traits

__all__ = ["param_counts", "rank_param_count", "layer_activation_bytes", "RankMemory", "plan", "format_table", "SCHEDULES"]

SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
GiB = 1024 ** 3


def param_counts(cfg: DSv3Config) -> dict:
    """Parameter counts of the pieces that are placed on stages (expert counts are for all experts)."""
    m, e = cfg.model, cfg.moe
    h, nh = m.hidden_size, m.num_attention_heads
    dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * nh * dqk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * dqk
    attn = (q + h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim) + nh * m.v_head_dim * h + 2 * h)
    dense = 3 * h * m.intermediate_size
    routed = 3 * h * e.intermediate_size * e.n_routed_experts
    shared = 3 * h * e.intermediate_size * e.n_shared_experts
    router = e.n_routed_experts * h
    return {"attn": attn, "dense_mlp": dense, "routed_experts": routed, "shared_experts": shared, "router": router,
            "embed": m.vocab_size * h, "head": m.vocab_size * h + h,
            "mtp_extra": cfg.mtp.depth * (2 * h * h + 3 * h)}


def layer_activation_bytes(cfg: DSv3Config, moe: bool, recompute: str = "none", fp8: bool = False,
                           act_bytes: int = 2) -> float:
    """Bytes saved for backward per token by one decoder layer (activations in `act_bytes` precision;
    FP8 GEMM inputs cached at 1 byte + one FP32 scale per 128). `recompute` = none / norm_and_mla_up / full."""
    m, e = cfg.model, cfg.moe
    h, nh = m.hidden_size, m.num_attention_heads
    dn, dr, dv, kr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    qr = m.q_lora_rank or 0
    gemm_in = (1 + 4 / 128) if fp8 else act_bytes     # a Linear's saved input, per element
    if recompute == "full":
        return h * act_bytes                           # only the layer input is kept
    # RMSNorm (fp32 math): input, normalized value, 1/rms; its output is the next GEMM's saved input
    norm = lambda d: d * act_bytes + d * 4 + 4         # noqa: E731
    b = 0.0
    # --- MLA (eqs. 1-11)
    if recompute != "norm_and_mla_up":
        b += norm(h)                                   # input_layernorm internals
        if qr:
            b += qr * act_bytes + norm(qr) + qr * gemm_in    # q_a output, q_a_layernorm, q_b input
        b += norm(kr)                                  # kv_a_layernorm internals
        b += kr * gemm_in                              # kv_b_proj input
    else:
        b += h * act_bytes                             # the recomputed pieces' input (the layer input)
    b += h * gemm_in                                   # q_a / kv_a input (normed x), shared
    b += (kr + dr) * act_bytes                         # kv_a output (c_KV | k^R)
    # the up-projection outputs stay alive even when recomputed: RoPE keeps q, attention keeps v (views)
    b += nh * (dn + dr) * act_bytes                    # q
    b += nh * (dn + dv) * act_bytes                    # kv_b output (k_nope | v)
    b += 2 * nh * dr * act_bytes                       # RoPE intermediates
    b += 2 * nh * (dn + dr) * act_bytes                # q, k after concatenation (attention inputs)
    b += nh * dv * act_bytes + nh * 4                  # attention output + log-sum-exp
    b += nh * dv * gemm_in                             # o_proj input
    # --- FFN
    if recompute != "norm_and_mla_up":
        b += norm(h)                                   # post_attention_layernorm internals
    else:
        b += h * act_bytes
    b += h * gemm_in                                   # FFN input (normed)
    swiglu = lambda i: 3 * i * act_bytes + i * gemm_in     # noqa: E731  gate out, silu out, up out; down input
    if moe:
        k, I = e.top_k, e.intermediate_size
        b += e.n_routed_experts * 4 * 3                # router scores / sigmoid / balance-loss terms (fp32)
        # gathered expert inputs, per-slot SwiGLU, expert outputs before and after the gate weighting, indices
        if fp8:   # fp8_experts: Xᵀ once + SwiGLU inputs g, u cached in FP8, SwiGLU output recomputed
            b += k * (h * gemm_in + 2 * I * gemm_in) + 2 * k * h * act_bytes + k * 8 * 2
        else:
            b += k * h * gemm_in + k * swiglu(I) + 2 * k * h * act_bytes + k * 8 * 2
        b += swiglu(e.intermediate_size * e.n_shared_experts)
    else:
        b += swiglu(m.intermediate_size)
    return b


@dataclass
class RankMemory:
    schedule: str
    layers_on_rank: int
    params_GiB: float
    grads_GiB: float
    optimizer_GiB: float
    activations_GiB: float
    total_GiB: float


def rank_param_count(cfg: DSv3Config, schedule: str, pp: int, ep: int, pp_rank: int) -> dict:
    """Parameters one rank holds under (`schedule`, `pp`, `ep`) as the rank-local model builds them
    (`training.rank_local`): {"dense": ..., "routed": ... (its E/ep experts), "total": ...}. The embedding sits
    on the first stage and, when MTP reuses it, on the last (one copy on a rank holding both, as under DualPipe)."""
    traits = schedule_traits(schedule)
    n_stages = traits.n_stages(pp)
    L, D = cfg.model.num_hidden_layers, cfg.mtp.depth
    pc = param_counts(cfg)
    ranges = model_stage_layers(L, D, n_stages)
    ids = set(traits.stage_ids(pp, pp_rank))
    first, last = 0 in ids, n_stages - 1 in ids
    moe_dense = pc["attn"] + pc["shared_experts"] + pc["router"]
    dense = routed = 0.0
    for i in sorted({i for s in ids for i in ranges[s]}):
        if cfg.is_moe_layer(i):
            dense, routed = dense + moe_dense, routed + pc["routed_experts"] / ep
        else:
            dense += pc["attn"] + pc["dense_mlp"]
    if first or (last and D):
        dense += pc["embed"]
    if last:
        dense += pc["head"] + pc["mtp_extra"] + D * moe_dense
        routed += D * pc["routed_experts"] / ep
    return {"dense": dense, "routed": routed, "total": dense + routed}


def plan(cfg: DSv3Config, pp: int, ep: int, dp: int, micro_batch_tokens: int | None = None,
         recompute: str | None = None, fp8: bool | None = None, bf16_moments: bool | None = None,
         schedules=SCHEDULES) -> list[RankMemory]:
    """Worst-rank memory per schedule. Defaults come from `cfg` (seq_len tokens per micro-batch, memory.*)."""
    if pp < 1 or ep < 1 or dp < 1:
        raise ConfigError(f"dsv3.parallel: pp, ep and dp must be >= 1 (got pp={pp}, ep={ep}, dp={dp})")
    if dp % ep:
        raise ConfigError(f"dsv3.parallel.ep: EP ranks are carved out of DP; ep must divide dp (got dp={dp}, ep={ep})")
    if cfg.moe.n_routed_experts % ep:
        raise ConfigError(f"dsv3.parallel.ep: must divide moe.n_routed_experts "
                          f"(got {cfg.moe.n_routed_experts} % {ep})")
    tokens = micro_batch_tokens or cfg.train.seq_len
    recompute = cfg.memory.recompute if recompute is None else recompute
    fp8 = cfg.fp8.enabled if fp8 is None else fp8
    bf16_moments = cfg.memory.bf16_moments if bf16_moments is None else bf16_moments
    L, D = cfg.model.num_hidden_layers, cfg.mtp.depth
    pc = param_counts(cfg)
    moe_dense = pc["attn"] + pc["shared_experts"] + pc["router"]
    moe_routed = pc["routed_experts"] / ep
    kinds = ["dense" if not cfg.is_moe_layer(i) else "moe" for i in range(L)]
    opt_per_param = 4 + (2 * 2 if bf16_moments else 2 * 4)
    act = {k: layer_activation_bytes(cfg, k == "moe", recompute, fp8) * tokens for k in ("dense", "moe")}

    def stage_bytes(layer_ids: list[int], first: bool, last: bool):
        dense_p = routed_p = 0.0
        for i in layer_ids:
            if kinds[i] == "moe":
                dense_p += moe_dense
                routed_p += moe_routed
            else:
                dense_p += pc["attn"] + pc["dense_mlp"]
        if first:
            dense_p += pc["embed"]
        if last:
            dense_p += pc["head"] + pc["mtp_extra"] + D * moe_dense
            routed_p += D * moe_routed
        a = sum(act[kinds[i]] for i in layer_ids) + (D * act["moe"] if last else 0)
        return dense_p, routed_p, a

    out = []
    for sched in schedules:
        traits = schedule_traits(sched)
        n_stages = traits.n_stages(pp)
        stages = [list(r) for r in model_stage_layers(L, D, n_stages)]   # the pipeline's own split
        per_rank = [traits.stage_ids(pp, r) for r in range(pp)]
        # micro-batches in flight per rank at the steady state (the schedules' published activation counts)
        if sched == "1f1b":   # stage r holds PP - r micro-batches at the 1F1B steady state
            inflight = [pp - r for r in range(pp)]
        elif sched == "dualpipe":
            inflight = [pp + 1] * pp
        else:
            inflight = [2 * pp + 1] * pp
        worst = None
        for ranks_stages, n_inflight in zip(per_rank, inflight):
            dense_p = routed_p = 0.0
            act_units = []
            for s in sorted(set(ranks_stages)):
                d, rt, a = stage_bytes(stages[s], s == 0, s == n_stages - 1)
                dense_p, routed_p = dense_p + d, routed_p + rt
                act_units.append(a)
            params = 2 * (dense_p + routed_p)
            grads = 4 * (dense_p + routed_p)
            optim = opt_per_param * (dense_p / dp + routed_p / (dp // ep))
            # in-flight micro-batches, each holding one stage's activations (the largest on this rank)
            acts = n_inflight * max(act_units)
            total = params + grads + optim + acts
            row = RankMemory(sched, sum(len(stages[s]) for s in ranks_stages), params / GiB, grads / GiB,
                             optim / GiB, acts / GiB, total / GiB)
            if worst is None or row.total_GiB > worst.total_GiB:
                worst = row
        out.append(worst)
    return out


def format_table(rows: list[RankMemory]) -> str:
    cols = ["schedule", "layers_on_rank", "params_GiB", "grads_GiB", "optimizer_GiB", "activations_GiB",
            "total_GiB"]
    lines = ["  ".join(f"{c:>15}" for c in cols)]
    for r in rows:
        d = asdict(r)
        lines.append("  ".join(f"{d[c]:>15.2f}" if isinstance(d[c], float) else f"{d[c]:>15}" for c in cols))
    return "\n".join(lines)

