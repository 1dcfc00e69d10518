"""Megatron-Core's own `MoELayer` holding the weights of one of our `DeepSeekMoE` layers: the baseline `make gpu-check`
times our MoE layer (BF16 and FP8) against at DeepSeek-V3 shapes.

The same function on both sides, configured as Megatron-Core users configure DeepSeek-V3: sigmoid scores, the
auxiliary-loss-free expert bias for the selection only, group-limited top-k, gates normalised to sum 1 times the
scaling factor, SwiGLU experts (`linear_fc1` = [gate; up]) and the shared experts. Experts: TE's grouped GEMM on
CUDA, else `SequentialMLP` under the plugin's Megatron CPU shims (a `--dry-run` catches a wrong weight mapping).
`ensure_parallel_state` sets up one rank unless the caller has. A private module (leading underscore): the runner
(`python -m benchmarks`) does not register it as a bench of its own.

Design notes (router options, experts and dispatchers): docs/design_notes.md#bench-megatron-moe
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv3_plugin.parallel.distributed import init_distributed

__all__ = ["available", "ensure_parallel_state", "build", "forward"]


def available() -> tuple[bool, str]:
    """(True, megatron-core version) when Megatron-Core imports, else (False, why)."""
    try:
        from megatron.core.package_info import __version__
        from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: F401
    except Exception as e:  # noqa: BLE001 — an optional peer; report why it is absent
        return False, f"megatron-core not importable ({type(e).__name__}: {str(e)[:160]})"
    return True, f"megatron-core {__version__}"


def ensure_parallel_state(device: torch.device) -> None:
    """One rank of Megatron-Core's parallel state (TP = PP = EP = 1) on `device`'s backend; idempotent."""
    from megatron.core import parallel_state as ps

    init_distributed("nccl" if device.type == "cuda" else "gloo")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)


def _te_grouped() -> tuple[bool, str]:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 — TE raises RuntimeError without its CUDA library
        return False, f"Transformer Engine not importable ({type(e).__name__})"
    return True, "Transformer Engine"


def build(ours, dtype: torch.dtype, device: torch.device, fp8: bool = False):
    """Megatron-Core's MoELayer with `ours`'s weights (copied), in `dtype` on `device`.

    Args:
        ours: a `DeepSeekMoE` (its router, routed experts [E, I, H] / [E, H, I] and shared experts).
        dtype: parameter and compute dtype (torch.bfloat16 on GPU; float32 for the CPU check).
        device: where to build it; `ensure_parallel_state(device)` must have run.
        fp8: Megatron-Core's own FP8 (`fp8="e4m3"`, `fp8_recipe="blockwise"`: TE's Float8BlockScaling, DeepSeek-V3's
            1×128 / 128×128 tiles), applied by `forward` through Megatron's `get_fp8_context`; needs TE on CUDA.

    Returns:
        (layer, info): the MoELayer (train mode) and {"experts": class name, "dispatcher", "why"}.
    """
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = ours.cfg
    H = ours.gate.weight.shape[1]
    E, I = cfg.n_routed_experts, cfg.intermediate_size
    grouped, why = _te_grouped() if device.type == "cuda" else (False, "not CUDA")
    if fp8 and not grouped:
        raise ValueError(f"megatron_moe: Megatron-Core's FP8 MoE layer needs Transformer Engine on CUDA ({why})")
    groups = cfg.n_group if cfg.n_group > 1 else None
    mcfg = TransformerConfig(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=max(1, H // 128),  # required by the config; unused by an MoE layer
        ffn_hidden_size=4 * H,
        num_moe_experts=E,
        moe_ffn_hidden_size=I,
        moe_shared_expert_intermediate_size=I * cfg.n_shared_experts if cfg.n_shared_experts else None,
        moe_router_topk=cfg.top_k,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=cfg.route_scale,
        moe_router_num_groups=groups,
        moe_router_group_topk=cfg.topk_group if groups else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall" if grouped else "allgather",
        moe_grouped_gemm=grouped,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        add_bias_linear=False,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        fp8="e4m3" if fp8 else None,
        fp8_recipe="blockwise" if fp8 else None,
        use_cpu_initialization=device.type != "cuda",
        perform_initialization=False,  # every weight is copied from `ours` below
    )
    if not cfg.norm_topk_prob:
        raise ValueError("megatron_moe: Megatron-Core's sigmoid router always normalises the top-k scores")
    spec = get_moe_module_spec(use_te=grouped, num_experts=E, moe_grouped_gemm=grouped)
    # 0.16 returns a ModuleSpec of MoELayer, 0.19 a builder (functools.partial of MoELayer with its submodules)
    layer = (MoELayer(mcfg, spec.submodules) if hasattr(spec, "submodules") else spec(config=mcfg)).to(device)
    _copy_weights(layer, ours, grouped)
    layer.train()
    info = {
        "experts": type(layer.experts).__name__,
        "dispatcher": mcfg.moe_token_dispatcher_type,
        "why": f"grouped GEMM through {why}" if grouped else f"SequentialMLP ({why})",
    }
    return layer, info


@torch.no_grad()
def _copy_weights(layer, ours, grouped: bool) -> None:
    def put(dst: torch.Tensor, src: torch.Tensor, name: str):
        if dst.shape != src.shape:
            raise ValueError(f"megatron_moe: {name} is {tuple(dst.shape)} in Megatron-Core, ours {tuple(src.shape)}")
        dst.copy_(src.to(dst.dtype))

    put(layer.router.weight, ours.gate.weight, "router.weight")
    put(layer.router.expert_bias, ours.gate.e_score_correction_bias, "router.expert_bias")
    ex = ours.experts
    for e in range(ex.n_experts):
        fc1 = torch.cat([ex.gate_proj[e], ex.up_proj[e]], dim=0)  # [2I, H]: [gate; up]
        if grouped:  # TEGroupedMLP: one weight per expert on each GroupedLinear
            w1, w2 = getattr(layer.experts.linear_fc1, f"weight{e}"), getattr(layer.experts.linear_fc2, f"weight{e}")
        else:
            local = layer.experts.local_experts[e]
            w1, w2 = local.linear_fc1.weight, local.linear_fc2.weight
        put(w1, fc1, f"experts[{e}].linear_fc1")
        put(w2, ex.down_proj[e], f"experts[{e}].linear_fc2")
    if ours.shared_experts is not None:
        sh = ours.shared_experts
        put(
            layer.shared_experts.linear_fc1.weight,
            torch.cat([sh.gate_proj.weight, sh.up_proj.weight], dim=0),
            "shared_experts.linear_fc1",
        )
        put(layer.shared_experts.linear_fc2.weight, sh.down_proj.weight, "shared_experts.linear_fc2")


def forward(layer, x_BTH: torch.Tensor) -> torch.Tensor:
    """The layer on [B, T, H] (Megatron's layout is [T, B, H]), inside Megatron's FP8 context when built with
    `fp8`; its output bias is None (no bias Linear)."""
    if layer.config.fp8:
        from megatron.core.fp8_utils import get_fp8_context

        with get_fp8_context(layer.config):
            y_TBH, bias = layer(x_BTH.transpose(0, 1).contiguous())
    else:
        y_TBH, bias = layer(x_BTH.transpose(0, 1).contiguous())
    if bias is not None:
        y_TBH = y_TBH + bias
    return y_TBH.transpose(0, 1)
