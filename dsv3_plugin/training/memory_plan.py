"""Per-rank training memory of DeepSeek-V3 under PP × DP (EP carved from DP) and ZeRO-1, by component (report
§3.2.1 Table 2, §3.2.3 / §3.3 memory techniques; DualPipe's per-device parameter and activation table).

Per pipeline rank (`rank_memory`): params, FP32 gradients, ZeRO-1 optimizer state, activations (per component,
times the micro-batches in flight read off the schedule's own op lists) and the host-side EMA. `dsv3 memory-plan`
prints it; `tests/unit/test_memory_plan.py` checks the activations against saved-tensor hooks.

NOTE: the attention state assumes a fused kernel (SDPA flash / memory-efficient: q, k, v, o, lse); on CPU v is
zero-padded to d_qk for the flash kernel (`pad_v`). Components and their formulas: docs/design_notes.md
(#training-memory-plan).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.parallel.pipeline.schedule import build_schedule
from dsv3_plugin.parallel.pipeline.stages import model_stage_layers
from dsv3_plugin.schedule_traits import schedule_traits

__all__ = [
    "SCHEDULES",
    "COMPONENTS",
    "param_counts",
    "layer_activation",
    "layer_activation_bytes",
    "stage_activation",
    "microbatch_activation",
    "inflight_peak",
    "RankParams",
    "rank_params",
    "rank_param_count",
    "RankMemory",
    "rank_memory",
    "plan",
    "plan_ranks",
    "format_table",
    "GiB",
]

SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
COMPONENTS = (
    "layer_inputs",
    "norms",
    "mla_proj",
    "attention",
    "router",
    "dispatch",
    "experts",
    "shared_experts",
    "dense_mlp",
    "head_mtp",
)
GiB = 1024**3
_TILE = 128


def param_counts(cfg: DSv3Config) -> dict:
    """Parameter counts of the pieces that are placed on stages (expert counts are for all experts)."""
    m, e = cfg.model, cfg.moe
    h, nh = m.hidden_size, m.num_attention_heads
    dqk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = h * nh * dqk if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * dqk
    attn = (
        q
        + h * (m.kv_lora_rank + m.qk_rope_head_dim)
        + m.kv_lora_rank
        + m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        + nh * m.v_head_dim * h
        + 2 * h
    )
    dense = 3 * h * m.intermediate_size
    routed = 3 * h * e.intermediate_size * e.n_routed_experts
    shared = 3 * h * e.intermediate_size * e.n_shared_experts
    router = e.n_routed_experts * h
    return {
        "attn": attn,
        "dense_mlp": dense,
        "routed_experts": routed,
        "shared_experts": shared,
        "router": router,
        "embed": m.vocab_size * h,
        "head": m.vocab_size * h + h,
        "mtp_extra": cfg.mtp.depth * (2 * h * h + 3 * h),
    }


# --------------------------------------------------------------------------------------------------
# Activations


def _fp8_t(K: int, M: int) -> float:
    """An FP8 Xᵀ cache of an [M, K] operand, 1×128 tiles along M: K·M bytes + K·⌈M/128⌉ FP32 scales."""
    return K * M + 4 * K * math.ceil(M / _TILE)


def _fp8_rows(M: int, K: int) -> float:
    """An FP8 [M, K] operand, 1×128 tiles along K."""
    return M * K + 4 * M * math.ceil(K / _TILE)


def _zero() -> dict:
    return {c: 0.0 for c in COMPONENTS}


def _norm(d: int, M: int, A: int, input_aliased: bool = False) -> float:
    """RMSNorm internals (fp32 math): the FP32 input (the input itself when activations are FP32 — then
    `input_aliased` says it is already counted), 1/rms, the normalized value before the weight."""
    x32 = 0 if (A == 4 and input_aliased) else 4 * d * M
    return x32 + 4 * M + A * d * M


def layer_activation(
    cfg: DSv3Config,
    moe: bool,
    tokens: int,
    recompute: str = "none",
    fp8: bool = False,
    act_bytes: int = 2,
    pad_v: bool = False,
) -> dict:
    """Bytes one decoder layer keeps for backward over `tokens` tokens (one micro-batch), by component."""
    if recompute not in ("none", "norm_and_mla_up", "full"):
        raise ConfigError(f"dsv3.memory.recompute: must be one of none, norm_and_mla_up, full (got {recompute!r})")
    m, e = cfg.model, cfg.moe
    M, A = tokens, act_bytes
    h, nh = m.hidden_size, m.num_attention_heads
    dn, dr, dv, kr = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    dqk = dn + dr
    qr = m.q_lora_rank
    d_attn_v = dqk if (pad_v and dv < dqk) else dv
    c = _zero()
    if recompute == "full":
        c["layer_inputs"] = A * h * M
        return c
    rec = recompute == "norm_and_mla_up"
    lin = (lambda K: _fp8_t(K, M)) if fp8 else (lambda K: A * K * M)  # a Linear's saved input
    # --- MLA (eqs. 1-11)
    if rec:
        c["layer_inputs"] += 2 * A * h * M  # the layer input and the residual after attention
    else:
        c["norms"] += _norm(h, M, A) + _norm(h, M, A)  # input_layernorm, post_attention_layernorm
    # q_a / kv_a input: FP8, one copy both read; else the normed x (norm_and_mla_up: freed, recomputed)
    c["mla_proj"] += _fp8_t(h, M) if fp8 else (0 if rec else A * h * M)
    if rec:
        c["mla_proj"] += A * ((qr or 0) + kr + dr) * M  # the latents c_Q, [c_KV | k^R]
    else:
        if qr:
            c["norms"] += _norm(qr, M, A, input_aliased=False)  # q_a_layernorm (its input: q_a's output)
            c["mla_proj"] += lin(qr)  # q_b input
        else:
            c["mla_proj"] += 0  # q_proj reads the normed x (counted above)
        # kv_a_layernorm reads c_KV, a view of kv_a's output [c_KV | k^R]: FP32 activations keep all of it
        c["norms"] += (4 * (kr + dr) * M if A == 4 else 4 * kr * M) + 4 * M + A * kr * M
        c["mla_proj"] += lin(kr)  # kv_b input
        v = nh * d_attn_v if d_attn_v != dv else nh * (dn + dv)  # unpadded v is a view of kv_b's output
        c["attention"] += A * (2 * nh * dqk + v) * M  # q, k, v
    c["attention"] += A * nh * d_attn_v * M + 4 * nh * M  # output, log-sum-exp
    c["mla_proj"] += lin(nh * dv)  # o_proj input (a copy of the heads' output)
    # --- FFN
    if moe:
        E, k, I = e.n_routed_experts, e.top_k, e.intermediate_size
        c["router"] += 0 if rec else A * h * M  # router input (the normed x, as given)
        c["router"] += (4 * E + 8 * k + 4 * k + 4) * M  # scores, top-k index, gates, their sum
        if e.seq_aux_alpha > 0:
            c["router"] += 8 * M  # balance-loss terms
        rows = k * M
        c["dispatch"] += 2 * 8 * rows  # token of each row, gate order
        if fp8:
            per_exp = rows / E
            hit = min(E, rows)
            c["dispatch"] += h * rows + 4 * h * hit * math.ceil(per_exp / _TILE)  # FP8 Xᵀ per expert
            c["experts"] += 2 * _fp8_rows(rows, I)  # g, u in FP8 (SwiGLU output recomputed)
        else:
            c["dispatch"] += A * h * rows  # gathered rows
            c["experts"] += 4 * A * I * rows  # g, u, silu(g), silu(g)·u
        c["experts"] += 4 * rows  # routing weight per row
        if e.n_shared_experts:
            Is = I * e.n_shared_experts
            inp = _fp8_t(h, M) if fp8 else 0  # else: the router's input, the same tensor
            c["shared_experts"] += inp + _swiglu(Is, M, A, fp8)
    else:
        inp = _fp8_t(h, M) if fp8 else (0 if rec else A * h * M)  # gate / up input (FP8: one copy for both)
        c["dense_mlp"] += inp + _swiglu(m.intermediate_size, M, A, fp8)
    return c


def _swiglu(I: int, M: int, A: int, fp8: bool) -> float:
    """down(silu(gate x) ⊙ up x) after its input: autograd keeps g, silu(g), u and the down projection's input;
    FP8 (`Fp8SwiGLUAct`, `Fp8Linear`) keeps g and u in FP8 and the down projection's FP8 input."""
    if fp8:
        return 2 * _fp8_rows(M, I) + _fp8_t(I, M)
    return 4 * A * I * M


def layer_activation_bytes(
    cfg: DSv3Config, moe: bool, recompute: str = "none", fp8: bool = False, act_bytes: int = 2
) -> float:
    """Bytes saved for backward per token by one decoder layer (at the config's sequence length)."""
    T = cfg.train.seq_len
    return sum(layer_activation(cfg, moe, T, recompute, fp8, act_bytes).values()) / T


def stage_activation(
    cfg: DSv3Config,
    layer_ids,
    batch: int,
    seq: int,
    first: bool,
    last: bool,
    recompute: str = "none",
    fp8: bool = False,
    act_bytes: int = 2,
    pad_v: bool = False,
) -> dict:
    """Bytes one micro-batch of `batch × seq` tokens keeps on a pipeline stage holding decoder layers
    `layer_ids` (+ the embedding when `first`; final norm, head and MTP when `last`), by component."""
    m, A = cfg.model, act_bytes
    h, V = m.hidden_size, m.vocab_size
    M = batch * seq
    out = _zero()

    def add(d):
        for k_, v in d.items():
            out[k_] += v

    for i in layer_ids:
        add(layer_activation(cfg, cfg.is_moe_layer(i), M, recompute, fp8, A, pad_v))
    rope = A * m.qk_rope_head_dim * seq if layer_ids else 0  # cos, sin [T, d_R/2], shared by all layers
    hm = 0.0
    if first:
        hm += 8 * M  # token ids (embedding backward)
    if last:
        rec = recompute == "norm_and_mla_up"
        hm += A * h * M if rec else _norm(h, M, A)  # final norm (its input, or its internals)
        hm += A * h * M  # head input (the normed hidden state)
        hm += 4 * V * M + 8 * M  # log-softmax (FP32), labels
        for k in range(1, cfg.mtp.depth + 1):
            S = batch * max(seq - k, 0)
            if S == 0:
                continue
            if not first:
                hm += 8 * M if k == 1 else 0  # the ids MTP embeds (sent with the activations)
            if rec:
                hm += A * h * S  # enorm input (the embedding); hnorm reads a view
            else:  # of the hidden state the head keeps
                hm += _norm(h, S, A) + _norm(h, S, A, input_aliased=True)
            hm += 2 * A * h * S  # eh_proj input [enorm(emb); hnorm(h)]
            add(layer_activation(cfg, True, S, recompute, fp8, A, pad_v))
            hm += A * h * S if rec else _norm(h, S, A)  # MTP's final norm
            hm += A * h * S + 4 * V * S  # head input, log-softmax
            if recompute == "full":
                hm -= 0  # MTP norms are not inside the recomputed block
            rope = rope or A * m.qk_rope_head_dim * seq
    out["head_mtp"] += hm
    out["attention"] += rope if recompute != "full" else 0
    out["layer_inputs"] += rope if recompute == "full" else 0
    return out


def microbatch_activation(
    cfg: DSv3Config,
    batch: int,
    seq: int,
    recompute: str = "none",
    fp8: bool = False,
    act_bytes: int = 2,
    pad_v: bool = False,
) -> dict:
    """The whole model (one stage) on one micro-batch: what `saved_activation_bytes` measures of a forward
    with the loss."""
    return stage_activation(
        cfg, range(cfg.model.num_hidden_layers), batch, seq, True, True, recompute, fp8, act_bytes, pad_v
    )


# --------------------------------------------------------------------------------------------------
# Parameters per rank


@dataclass
class RankParams:
    """Parameters pipeline rank `pp_rank` holds (EP rank: any; experts are even across EP ranks)."""

    schedule: str
    pp: int
    pp_rank: int
    ep: int
    stages: list  # model stages on this rank
    layers: list  # decoder layer ids on this rank
    dense: float  # parameters replicated over DP (attention, norms, router, shared, embed...)
    routed: float  # this EP rank's routed-expert parameters
    by_part: dict = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.dense + self.routed

    def bytes(self, param_bytes: int = 2) -> float:
        return param_bytes * self.total


def _stage_layers(cfg: DSv3Config, schedule: str, pp: int) -> list[list[int]]:
    n = schedule_traits(schedule, "parallel.schedule").n_stages(pp)
    return [list(r) for r in model_stage_layers(cfg.model.num_hidden_layers, cfg.mtp.depth, n)]


def rank_params(cfg: DSv3Config, schedule: str, pp: int, pp_rank: int, ep: int = 1) -> RankParams:
    """Parameter counts of pipeline rank `pp_rank` (any EP rank) for `schedule` on `pp` pipeline ranks."""
    t = schedule_traits(schedule, "parallel.schedule")
    if not 0 <= pp_rank < pp:
        raise ConfigError(f"dsv3.parallel.pp: rank {pp_rank} outside 0..{pp - 1}")
    if ep < 1 or cfg.moe.n_routed_experts % ep:
        raise ConfigError(f"dsv3.parallel.ep: must divide moe.n_routed_experts (got {cfg.moe.n_routed_experts} % {ep})")
    pc = param_counts(cfg)
    stages = _stage_layers(cfg, schedule, pp)
    last = t.n_stages(pp) - 1
    ids = sorted(set(t.stage_ids(pp, pp_rank)))
    part = {
        "attn": 0.0,
        "dense_mlp": 0.0,
        "router": 0.0,
        "shared_experts": 0.0,
        "routed_experts": 0.0,
        "embed": 0.0,
        "head": 0.0,
        "mtp_extra": 0.0,
    }
    layers = []
    D = cfg.mtp.depth
    for s in ids:
        for i in stages[s]:
            layers.append(i)
            part["attn"] += pc["attn"]
            if cfg.is_moe_layer(i):
                part["router"] += pc["router"]
                part["shared_experts"] += pc["shared_experts"]
                part["routed_experts"] += pc["routed_experts"] / ep
            else:
                part["dense_mlp"] += pc["dense_mlp"]
        if s == 0:
            part["embed"] += pc["embed"]
        if s == last:
            part["head"] += pc["head"]
            part["mtp_extra"] += pc["mtp_extra"]
            part["attn"] += D * pc["attn"]
            part["router"] += D * pc["router"]
            part["shared_experts"] += D * pc["shared_experts"]
            part["routed_experts"] += D * pc["routed_experts"] / ep
            if D and 0 not in ids:
                part["embed"] += pc["embed"]  # MTP embeds with its own copy when the first stage is apart
    routed = part["routed_experts"]
    return RankParams(schedule, pp, pp_rank, ep, ids, layers, sum(part.values()) - routed, routed, part)


# --------------------------------------------------------------------------------------------------
# In-flight micro-batches, from the schedules' op lists


@functools.lru_cache(maxsize=8)
def _schedule_ops(schedule: str, pp: int, n_chunks: int) -> tuple:
    """Every rank's op list of one step (built once per layout: `plan_ranks` walks it for each of the pp ranks, and
    building it costs O(pp^3))."""
    return tuple(build_schedule(schedule, pp, n_chunks).ops)


def inflight_peak(schedule: str, pp: int, rank: int, chunk_bytes: list[float], n_chunks: int | None = None):
    """Walk rank `rank`'s ops of `schedule`: each F adds a micro-batch's activations of that local chunk, each B
    (or W after a split I) frees them; an FB counts its F before its B frees (they overlap). Returns
    (peak bytes, micro-batches in flight per local chunk at the peak)."""
    t = schedule_traits(schedule, "parallel.schedule")
    C = n_chunks or max(t.min_chunks(pp), 2 * pp) * 2
    live = [0] * t.chunks_per_rank
    best, at = -1.0, list(live)

    def total():
        return sum(n * b for n, b in zip(live, chunk_bytes))

    for op in _schedule_ops(schedule, pp, C)[rank]:
        if op.kind in ("F", "FB"):
            live[op.chunk] += 1
            if total() > best:
                best, at = total(), list(live)
        if op.kind == "B" or op.kind == "W":
            live[op.chunk] -= 1
        if op.kind == "FB":
            live[op.chunk2] -= 1
    return best, at


# --------------------------------------------------------------------------------------------------
# Per-rank memory


@dataclass
class RankMemory:
    schedule: str
    pp_rank: int
    layers_on_rank: int
    inflight: list  # micro-batches in flight per local chunk at the activation peak
    params_GiB: float
    grads_GiB: float
    optimizer_GiB: float
    activations_GiB: float
    total_GiB: float
    activations_by_component_GiB: dict = field(default_factory=dict)
    params_by_part_GiB: dict = field(default_factory=dict)
    ema_cpu_GiB: float = 0.0


def rank_memory(
    cfg: DSv3Config,
    schedule: str,
    pp: int,
    pp_rank: int,
    ep: int,
    dp: int,
    *,
    micro_batch: tuple[int, int] | None = None,
    recompute: str | None = None,
    fp8: bool | None = None,
    bf16_moments: bool | None = None,
    ema: bool | None = None,
    act_bytes: int = 2,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    pad_v: bool = False,
) -> RankMemory:
    """Memory of pipeline rank `pp_rank` (GiB, by component). `micro_batch` = (batch, seq) of one micro-batch
    (default 1 × seq_len); other defaults come from `cfg` (memory.*, fp8.enabled)."""
    if pp < 1 or ep < 1 or dp < 1:
        raise ConfigError(f"dsv3.parallel: pp, ep and dp must be >= 1 (got pp={pp}, ep={ep}, dp={dp})")
    if dp % ep:
        raise ConfigError(f"dsv3.parallel.ep: EP ranks are carved out of DP; ep must divide dp (got dp={dp}, ep={ep})")
    batch, seq = micro_batch or (1, cfg.train.seq_len)
    recompute = cfg.memory.recompute if recompute is None else recompute
    fp8 = cfg.fp8.enabled if fp8 is None else fp8
    bf16_moments = cfg.memory.bf16_moments if bf16_moments is None else bf16_moments
    ema = cfg.memory.ema if ema is None else ema
    t = schedule_traits(schedule, "parallel.schedule")
    rp = rank_params(cfg, schedule, pp, pp_rank, ep)
    stages = _stage_layers(cfg, schedule, pp)
    last = t.n_stages(pp) - 1
    per_chunk = [
        stage_activation(cfg, stages[s], batch, seq, s == 0, s == last, recompute, fp8, act_bytes, pad_v)
        for s in t.stage_ids(pp, pp_rank)
    ]
    peak, live = inflight_peak(schedule, pp, pp_rank, [sum(c.values()) for c in per_chunk])
    acts = {k: sum(n * c[k] for n, c in zip(live, per_chunk)) for k in COMPONENTS}
    opt_per_param = 4 + (2 * 2 if bf16_moments else 2 * 4)
    params = param_bytes * rp.total
    grads = grad_bytes * rp.total
    optim = opt_per_param * (rp.dense / dp + rp.routed / (dp // ep))
    total = params + grads + optim + peak
    return RankMemory(
        schedule,
        pp_rank,
        len(rp.layers),
        live,
        params / GiB,
        grads / GiB,
        optim / GiB,
        peak / GiB,
        total / GiB,
        {k: v / GiB for k, v in acts.items()},
        {k: param_bytes * v / GiB for k, v in rp.by_part.items()},
        (4 * rp.total / GiB) if ema else 0.0,
    )


def rank_param_count(cfg: DSv3Config, schedule: str, pp: int, ep: int, pp_rank: int) -> dict:
    """{"dense", "routed", "total"} parameters of pipeline rank `pp_rank` (`rank_params` in short)."""
    rp = rank_params(cfg, schedule, pp, pp_rank, ep)
    return {"dense": rp.dense, "routed": rp.routed, "total": rp.total}


def plan_ranks(cfg: DSv3Config, schedule: str, pp: int, ep: int, dp: int, **kw) -> list[RankMemory]:
    """Every pipeline rank's memory for `schedule`."""
    return [rank_memory(cfg, schedule, pp, r, ep, dp, **kw) for r in range(pp)]


def plan(
    cfg: DSv3Config,
    pp: int,
    ep: int,
    dp: int,
    micro_batch_tokens: int | None = None,
    recompute: str | None = None,
    fp8: bool | None = None,
    bf16_moments: bool | None = None,
    schedules=SCHEDULES,
    **kw,
) -> list[RankMemory]:
    """The worst pipeline rank per schedule. `micro_batch_tokens`: one sequence of that many tokens."""
    if cfg.moe.n_routed_experts % ep:
        raise ConfigError(f"dsv3.parallel.ep: must divide moe.n_routed_experts (got {cfg.moe.n_routed_experts} % {ep})")
    mb = (1, micro_batch_tokens) if micro_batch_tokens else None
    out = []
    for sched in schedules:
        check = schedule_traits(sched, "parallel.schedule")
        if check.even_ranks and pp % 2:
            continue
        rows = plan_ranks(
            cfg, sched, pp, ep, dp, micro_batch=mb, recompute=recompute, fp8=fp8, bf16_moments=bf16_moments, **kw
        )
        out.append(max(rows, key=lambda r: r.total_GiB))
    return out


def format_table(rows: list[RankMemory], components: bool = True) -> str:
    cols = [
        "schedule",
        "pp_rank",
        "layers_on_rank",
        "inflight",
        "params_GiB",
        "grads_GiB",
        "optimizer_GiB",
        "activations_GiB",
        "total_GiB",
    ]
    lines = ["  ".join(f"{c:>15}" for c in cols)]
    for r in rows:
        d = asdict(r)
        d["inflight"] = "+".join(str(n) for n in r.inflight)
        lines.append("  ".join(f"{d[c]:>15.2f}" if isinstance(d[c], float) else f"{d[c]:>15}" for c in cols))
    if components:
        used = [c for c in COMPONENTS if any(r.activations_by_component_GiB[c] for r in rows)]
        lines.append("")
        lines.append("activations by component (GiB):")
        lines.append("  ".join(f"{c:>15}" for c in ["schedule", *used]))
        for r in rows:
            lines.append(
                "  ".join([f"{r.schedule:>15}"] + [f"{r.activations_by_component_GiB[c]:>15.2f}" for c in used])
            )
    return "\n".join(lines)
