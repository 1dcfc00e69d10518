"""Which GEMMs of a decoder layer train under `dsv3.lora`, and the work their W op keeps (zero-bubble B / W
split, Qi et al. 2023 §2; LoRA, Hu et al. 2021).

A frozen matrix needs no weight gradient, so in the W split it has no W op; only adapters defer theirs. An
adapter on a `d_out × d_in` matrix is A [r, d_in] and B [d_out, r]: r·(d_in + d_out) parameters, and on n rows
each of its passes (forward A x then B (A x); input gradient Bᵀ dy then Aᵀ (Bᵀ dy); weight gradients
(Bᵀ dy)ᵀ x and dyᵀ (A x)) costs 2·n·r·(d_in + d_out) FLOPs. Routed experts carry adapters only with
`lora.experts`; the MTP layer carries none (its `lora.mtp` modes train no MTP weight).
"""

from __future__ import annotations

from dsv3_plugin.config import DSv3Config, lora_targets

__all__ = ["layer_matrices", "is_adapted", "adapter_params", "adapter_flops"]


def layer_matrices(cfg: DSv3Config, moe: bool) -> list[tuple[str, str, int, int]]:
    """The matrices of one decoder layer's GEMMs (router excluded).

    Args:
        cfg: the config; moe: a MoE layer (else a dense-MLP layer).

    Returns:
        [(target name, group, d_out, d_in)]; group is attn, dense_mlp, shared or routed (routed: ONE expert's
        matrix, of `moe.n_routed_experts`; shared: the shared experts as one MLP of n_shared × I).
    """
    m, e = cfg.model, cfg.moe
    h, nh, dr = m.hidden_size, m.num_attention_heads, m.qk_rope_head_dim
    dqk = m.qk_nope_head_dim + dr
    if m.q_lora_rank is None:
        out = [("q_proj", "attn", nh * dqk, h)]
    else:
        out = [("q_a_proj", "attn", m.q_lora_rank, h), ("q_b_proj", "attn", nh * dqk, m.q_lora_rank)]
    out += [
        ("kv_a_proj_with_mqa", "attn", m.kv_lora_rank + dr, h),
        ("kv_b_proj", "attn", nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        ("o_proj", "attn", h, nh * m.v_head_dim),
    ]

    def mlp(group, inter):
        return [("gate_proj", group, inter, h), ("up_proj", group, inter, h), ("down_proj", group, h, inter)]

    if not moe:
        return out + mlp("dense_mlp", m.intermediate_size)
    if e.n_shared_experts:
        out += mlp("shared", e.intermediate_size * e.n_shared_experts)
    return out + mlp("routed", e.intermediate_size)


def is_adapted(cfg: DSv3Config, name: str, group: str, mtp: bool = False) -> bool:
    """Whether matrix `name` of `group` carries an adapter (never without `cfg.lora`, never in an MTP layer)."""
    if cfg.lora is None or mtp or name not in lora_targets(cfg):
        return False
    return group != "routed" or cfg.lora.experts


def adapter_params(cfg: DSv3Config, moe: bool, ep: int = 1) -> dict:
    """Adapter parameters of one decoder layer.

    Returns:
        {"dense": on attention, dense MLP and shared experts; "routed": on this EP rank's n_routed_experts / ep
        routed experts}, r·(d_in + d_out) per adapted matrix.
    """
    out = {"dense": 0, "routed": 0}
    for name, group, d_out, d_in in layer_matrices(cfg, moe):
        if is_adapted(cfg, name, group):
            n = cfg.lora.rank * (d_in + d_out)
            if group == "routed":
                out["routed"] += n * cfg.moe.n_routed_experts // ep
            else:
                out["dense"] += n
    return out


def adapter_flops(cfg: DSv3Config, moe: bool, tokens: int) -> dict:
    """FLOPs of ONE pass (forward, input gradient or weight gradient: each the same count) of one layer's
    adapters over `tokens` tokens, under balanced routing (top_k rows per token through the routed experts).

    Returns:
        {"attention": ..., "mlp": ...}; 0 where nothing is adapted (and without `cfg.lora`).
    """
    out = {"attention": 0.0, "mlp": 0.0}
    for name, group, d_out, d_in in layer_matrices(cfg, moe):
        if is_adapted(cfg, name, group):
            rows = tokens * cfg.moe.top_k if group == "routed" else tokens
            out["attention" if group == "attn" else "mlp"] += 2.0 * rows * cfg.lora.rank * (d_in + d_out)
    return out
