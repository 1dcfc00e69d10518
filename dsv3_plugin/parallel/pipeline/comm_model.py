"""First-principles component times of one DeepSeek-V3 pipeline chunk in the report's training setup
(§3.1-3.3: PP16, EP64 over 8-GPU H800 nodes, micro-batch 1 x 4096 tokens), for the two-lane F&B model.

Computation: FLOPs of one MoE layer per GPU (MLA projections and core attention, router, 8 routed + 1 shared
SwiGLU expert), at an assumed throughput (dense peak x MFU x the share of SMs left to computation).
Communication: bytes one GPU sends per all-to-all over InfiniBand (node-limited routing: a token crosses IB at
most once per target node, §3.2.2), at the IB bandwidth; the NVLink forwarding inside a node runs concurrently
(§3.2.2: "communications via IB and NVLink are fully overlapped"), so an all-to-all takes the longer of the two.
With `dsv3.lora` the base is frozen: its GEMMs keep forward and input gradient, the W op keeps only the
adapters' weight gradients (`trainable_gemms.adapter_flops`), and the adapters add one pass each to F and B.
This is a model, not a measurement: every constant below names its source or is marked as an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsv3_plugin.config import DSv3Config
from dsv3_plugin.parallel.pipeline.fb_overlap import ChunkComponents, two_lane_pair
from dsv3_plugin.parallel.pipeline.trainable_gemms import adapter_flops

__all__ = [
    "Hardware",
    "layer_flops",
    "a2a_bytes",
    "paper_setup",
    "break_even_mfu",
    "TOKENS_PER_MICRO_BATCH",
    "LAYERS_PER_CHUNK",
    "MICRO_BATCHES_PER_STEP",
    "PAPER_PP",
    "REPORTED_TOKENS_PER_S_PER_GPU",
]

# --- hardware (H800 SXM) -----------------------------------------------------------------------------------
# Dense tensor-core peaks of the H100/H800 SXM (NVIDIA datasheet: 3958 / 1979 TFLOPS *with* 2:4 sparsity; the
# H800 differs from the H100 in interconnect and FP64, not in tensor-core rate). Assumption, not in the report.
H800_FP8_DENSE_TFLOPS = 1979.0
H800_BF16_DENSE_TFLOPS = 989.0
H800_SMS = 132  # streaming multiprocessors of an H800 SXM (§3.2.2 speaks of "20 SMs" of them)
COMM_SMS = 20  # §3.2.2: "only 20 SMs are sufficient to fully utilize the bandwidths
# of IB and NVLink"
IB_GBPS = 50.0  # §3.2.2: IB 50 GB/s (per GPU, one direction)
NVLINK_GBPS = 160.0  # §3.2.2: NVLink 160 GB/s, "roughly 3.2 times that of IB"
# Assumption: fraction of the peak the computation kernels reach on the SMs left to them. The report gives no
# MFU; 0.5 is a round middle value. The JSON reports the break-even MFU above which communication is exposed.
DEFAULT_MFU = 0.5

# --- the training setup ------------------------------------------------------------------------------------
TOKENS_PER_MICRO_BATCH = 4096  # sequence length 4K (§4.2), micro-batch of one sequence (dualpipe_facts §1.3:
# the profiled pair is "EP64, TP1 with 4K sequence length")
LAYERS_PER_CHUNK = 4  # dualpipe_facts §1.3 (profile-data): "each chunk contains 4 MoE layers";
# 61 layers / 16 stages = 3.8
PAPER_PP = 16  # §3.2: 16-way PP, DualPipe
# Global batch 15360 sequences (§4.2, after the ramp) over 2048 GPUs / PP16 = 128 data-parallel replicas
# -> 120 micro-batches of one sequence per replica and step.
MICRO_BATCHES_PER_STEP = 15360 // (2048 // PAPER_PP)
# §1 (Table 1): "training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU hours" -- a whole-model
# figure (dense layers, head, MTP, optimizer, every bubble), printed next to the simulated step for scale only.
REPORTED_TOKENS_PER_S_PER_GPU = 1e12 / (180e3 * 3600)
FP8_BYTES = 1  # §3.3.3: activations before the MoE up-projection dispatched in FP8 (E4M3)
SCALE_BYTES = 4  # one FP32 scale per 1x128 tile (§3.3.2 tiles; the reference kernels keep
# FP32 scales, NOTE: power-of-2 scales could travel as 1-byte exponents)
TILE = 128  # §3.3.2: 1 x 128 activation tiles
BF16_BYTES = 2  # §3.3.3: forward and backward combine stay in BF16
# FlashAttention-style core-attention backward: recompute S = QK^T and four more matmuls (dP, dV, dQ, dK)
# against two in the forward -> 2.5x the forward FLOPs. Assumption (the report does not describe its kernel).
ATTN_CORE_BWD_FACTOR = 2.5


@dataclass(frozen=True)
class Hardware:
    fp8_tflops: float = H800_FP8_DENSE_TFLOPS
    bf16_tflops: float = H800_BF16_DENSE_TFLOPS
    mfu: float = DEFAULT_MFU
    sms: int = H800_SMS
    comm_sms: int = COMM_SMS
    ib_gbps: float = IB_GBPS
    nvlink_gbps: float = NVLINK_GBPS

    def __post_init__(self):
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Hardware.mfu: must be in (0, 1], got {self.mfu!r}")
        if not 0 <= self.comm_sms < self.sms:
            raise ValueError(f"Hardware.comm_sms: must be in [0, sms={self.sms}), got {self.comm_sms!r}")
        for name in ("fp8_tflops", "bf16_tflops", "ib_gbps", "nvlink_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Hardware.{name}: must be > 0, got {getattr(self, name)!r}")

    def compute_ms(self, fp8_flops: float, bf16_flops: float) -> float:
        """GEMMs in FP8 (§3.3.1), attention core, router and the rest in BF16, on the computation SMs.
        NOTE: the same rate (112 of 132 SMs) serves the no-overlap baseline, which would not need to set 20 SMs
        aside; the baseline is therefore up to 132/112 slower in its computation than it could be."""
        share = self.mfu * (self.sms - self.comm_sms) / self.sms
        return 1e3 * (fp8_flops / (self.fp8_tflops * 1e12) + bf16_flops / (self.bf16_tflops * 1e12)) / share


def layer_flops(cfg: DSv3Config, tokens: int) -> dict[str, dict[str, float]]:
    """FLOPs of one MoE layer on one GPU for a micro-batch of one sequence of `tokens` tokens, per component
    and precision ({"fp8": ..., "bf16": ...}). Components: attention (norms excluded; MLA projections, causal
    core attention, router), mlp (routed + shared experts); their backward for input (`_b`) and for weights
    (`_w`). Balanced routing (§2.1.2's auxiliary-loss-free balancing): each GPU's experts receive as many
    token-expert pairs as its own tokens route out, so the routed-expert FLOPs per GPU are tokens x K_r experts.
    With `cfg.lora` the frozen base has no weight gradients: `_w` holds the adapters' alone.
    NOTE: norms, RoPE, SwiGLU and other element-wise ops are not counted (memory-bound, small next to GEMMs)."""
    m, e = cfg.model, cfg.moe
    T, h, H = tokens, m.hidden_size, m.num_attention_heads
    qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    q_lora = m.q_lora_rank
    q_proj = (h * q_lora + q_lora * H * qk) if q_lora else h * H * qk  # q_a + q_b (or plain q_proj)
    q_up = q_lora * H * qk if q_lora else 0
    kv_proj = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * H * (m.qk_nope_head_dim + v)
    kv_up = m.kv_lora_rank * H * (m.qk_nope_head_dim + v)
    o_proj = H * v * h
    attn_gemm = 2 * T * (q_proj + kv_proj + o_proj)  # 2 FLOPs per multiply-add
    # causal: query t attends to t+1 keys, (T+1)/2 on average; QK^T over qk dims, PV over v dims
    attn_core = 2 * T * H * (qk + v) * (T + 1) / 2
    router = 2 * T * h * e.n_routed_experts
    expert = 3 * h * e.intermediate_size  # SwiGLU: gate, up, down
    mlp_gemm = 2 * T * expert * (e.top_k + e.n_shared_experts)
    recompute = 2 * T * (q_up + kv_up)  # §3.2.3: MLA up-projections recomputed in backward
    if cfg.lora is not None:  # frozen base: no Wgrad (router included); adapters (BF16) add a pass to F, B and W
        ad = adapter_flops(cfg, True, T)
        return {
            "attention": {"fp8": attn_gemm, "bf16": attn_core + router + ad["attention"]},
            "mlp": {"fp8": mlp_gemm, "bf16": ad["mlp"]},
            "attention_b": {
                "fp8": attn_gemm + recompute,
                "bf16": ATTN_CORE_BWD_FACTOR * attn_core + router + ad["attention"],
            },
            "mlp_b": {"fp8": mlp_gemm, "bf16": ad["mlp"]},
            "attention_w": {"fp8": 0.0, "bf16": ad["attention"]},
            "mlp_w": {"fp8": 0.0, "bf16": ad["mlp"]},
        }
    return {
        "attention": {"fp8": attn_gemm, "bf16": attn_core + router},
        "mlp": {"fp8": mlp_gemm, "bf16": 0.0},
        # backward for input: dgrad of every GEMM, core-attention backward, the recompute
        "attention_b": {"fp8": attn_gemm + recompute, "bf16": ATTN_CORE_BWD_FACTOR * attn_core + router},
        "mlp_b": {"fp8": mlp_gemm, "bf16": 0.0},
        # backward for weights: wgrad of every GEMM (FP8 Wgrad, §3.3.1); the router gate stays BF16
        "attention_w": {"fp8": attn_gemm, "bf16": router},
        "mlp_w": {"fp8": mlp_gemm, "bf16": 0.0},
    }


def a2a_bytes(cfg: DSv3Config, tokens: int, ep: int, gpus_per_node: int) -> dict:
    """Bytes one GPU sends per all-to-all of a micro-batch, over IB and over NVLink.

    Node-limited routing (§3.2.2): a token goes to at most M = topk_group nodes and crosses IB once per
    target node (to the GPU with the same in-node index), then NVLink to the GPUs of its experts.
    NOTE: under balanced routing a target node is the token's own node with probability 1/nodes, and then no
    IB is used, so the expected IB copies per token are min(M, nodes) x (nodes - 1) / nodes (3.5 for V3).
    NVLink: at most K_r copies per token (one per expert GPU; an upper bound)."""
    e, h = cfg.moe, cfg.model.hidden_size
    nodes = max(1, ep // gpus_per_node)
    ib_copies = min(e.topk_group, nodes) * (nodes - 1) / nodes
    nvl_copies = e.top_k if ep > 1 else 0
    fp8_row = h * FP8_BYTES + -(-h // TILE) * SCALE_BYTES  # payload + one scale per 1x128 tile
    bf16_row = h * BF16_BYTES
    # forward dispatch and the backward of combine send rows to the experts in FP8 (§3.3.3: "activation
    # gradients before the MoE down-projection" too); forward combine and the backward of dispatch return rows
    # in BF16. NOTE: we read the report's "backward combine stays BF16" as the latter.
    rows = {"dispatch": fp8_row, "combine": bf16_row, "combine_b": fp8_row, "dispatch_b": bf16_row}
    return {
        "nodes": nodes,
        "ib_copies_per_token": ib_copies,
        "nvlink_copies_per_token": nvl_copies,
        "ib": {k: tokens * ib_copies * r for k, r in rows.items()},
        "nvlink": {k: tokens * nvl_copies * r for k, r in rows.items()},
        "pp": tokens * h * BF16_BYTES,
    }


def paper_setup(
    hw: Hardware | None = None,
    layers: int = LAYERS_PER_CHUNK,
    tokens: int = TOKENS_PER_MICRO_BATCH,
    cfg: DSv3Config | None = None,
) -> tuple[ChunkComponents, dict]:
    """Component times (ms) of one chunk of `layers` MoE layers in the report's setup, and how they were derived."""
    hw = hw or Hardware()
    cfg = cfg or DSv3Config.from_block({"preset": "v3-671b"})
    gpus_per_node = cfg.moe.ranks_per_node  # §3.1: 8 GPUs per node
    ep = cfg.parallel.ep  # §3.2: EP64 spanning 8 nodes
    fl = layer_flops(cfg, tokens)
    by = a2a_bytes(cfg, tokens, ep, gpus_per_node)
    t = {k: hw.compute_ms(v["fp8"], v["bf16"]) for k, v in fl.items()}
    for k in ("dispatch", "combine", "combine_b", "dispatch_b"):
        t[k] = max(1e3 * by["ib"][k] / (hw.ib_gbps * 1e9), 1e3 * by["nvlink"][k] / (hw.nvlink_gbps * 1e9))
    # NOTE: the PP neighbour is on another node (a stage's 64 EP ranks fill 8 whole nodes), so the activation
    # (or its gradient) crosses IB, on the same NIC as the all-to-all: it shares the communication lane.
    pp_ms = 1e3 * by["pp"] / (hw.ib_gbps * 1e9)
    comp = ChunkComponents(
        t["attention"],
        t["dispatch"],
        t["mlp"],
        t["combine"],
        t["combine_b"],
        t["mlp_b"],
        t["dispatch_b"],
        t["attention_b"],
        t["mlp_w"],
        t["attention_w"],
        layers=layers,
        pp=pp_ms,
    )
    details = {
        "units": "ms",
        "tokens_per_micro_batch": tokens,
        "layers_per_chunk": layers,
        "hardware": {
            "fp8_tflops": hw.fp8_tflops,
            "bf16_tflops": hw.bf16_tflops,
            "mfu": hw.mfu,
            "compute_sms": hw.sms - hw.comm_sms,
            "sms": hw.sms,
            "ib_gbps": hw.ib_gbps,
            "nvlink_gbps": hw.nvlink_gbps,
        },
        "layer_tflop": {k: (v["fp8"] + v["bf16"]) / 1e12 for k, v in fl.items()},
        "a2a_mb_per_gpu": {k: v / 1e6 for k, v in by["ib"].items()},
        "pp_mb": by["pp"] / 1e6,
        "ep": ep,
        "nodes": by["nodes"],
        "ib_copies_per_token": by["ib_copies_per_token"],
        "layer_ms": {
            k: t[k]
            for k in (
                "attention",
                "dispatch",
                "mlp",
                "combine",
                "combine_b",
                "mlp_b",
                "dispatch_b",
                "attention_b",
                "mlp_w",
                "attention_w",
            )
        },
        "pp_ms": pp_ms,
    }
    return comp, details


def break_even_mfu(
    hw: Hardware | None = None,
    layers: int = LAYERS_PER_CHUNK,
    tokens: int = TOKENS_PER_MICRO_BATCH,
    cfg: DSv3Config | None = None,
    with_pp: bool = True,
    tol_ms: float = 1e-9,
) -> float | None:
    """The largest MFU at which the two-lane F&B pair still hides all communication (computation gets shorter
    as MFU grows, communication does not), by bisection to 1e-4; None when nothing is exposed even at MFU 1.
    `with_pp=False` leaves the PP sends out (all-to-all only)."""
    hw = hw or Hardware()
    cfg = cfg or DSv3Config.from_block({"preset": "v3-671b"})

    def exposed(mfu: float) -> float:
        comp, _ = paper_setup(replace(hw, mfu=mfu), layers, tokens, cfg)
        return two_lane_pair(comp if with_pp else replace(comp, pp=0.0)).exposed_comm

    if exposed(1.0) <= tol_ms:
        return None
    lo, hi = 1e-3, 1.0
    if exposed(lo) > tol_ms:
        return 0.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exposed(mid) <= tol_ms else (lo, mid)
    return lo
