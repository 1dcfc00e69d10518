"""Multi-head Latent Attention (DeepSeek-V2/V3 paper §2.1.1, eqs. 1-11).

Queries go through an optional low-rank bottleneck (q_a_proj -> RMSNorm -> q_b_proj, d_c' = q_lora_rank);
keys and values share one compressed latent c_KV (kv_lora_rank) plus a single decoupled RoPE key k^R shared by
all heads (`kv_a_proj_with_mqa` produces both). kv_b_proj expands c_KV into per-head [k_nope | v].
Names follow the released checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import ModelConfig
from dsv3_plugin.model.norm import RMSNorm
from dsv3_plugin.model.rope import apply_rope, softmax_scale

__all__ = ["MLA"]


class MLA(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.n_heads = nh
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.d_qk = self.d_nope + self.d_rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * self.d_qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * self.d_qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + self.d_rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (self.d_nope + self.d_v), bias=False)
        self.o_proj = nn.Linear(nh * self.d_v, H, bias=False)
        self.scale = softmax_scale(cfg)

    # Split out so that recompute (memory.recompute = norm_and_mla_up) can wrap exactly the up-projections.
    def q_down(self, x_BTH: torch.Tensor) -> torch.Tensor:
        """The query latent c_Q (eq. 6, before its RMSNorm); the input itself without a query bottleneck."""
        return x_BTH if self.cfg.q_lora_rank is None else self.q_a_proj(x_BTH)

    def q_up(self, cq_BTC: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(cq_BTC)
        return self.q_b_proj(self.q_a_layernorm(cq_BTC))

    def kv_up(self, c_kv: torch.Tensor) -> torch.Tensor:
        return self.kv_b_proj(self.kv_a_layernorm(c_kv))

    def qkv(self, cq_BTC: torch.Tensor, ckv_BTC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Up-projections + RoPE (eqs. 2-9): the per-head q, k, v [B, nh, T, d] attention reads, from the
        latents c_Q and [c_KV | k^R]. v is zero-padded to d_qk on CPU, where PyTorch's flash kernel (which keeps
        only q, k, v, output and log-sum-exp for backward) needs equal head sizes; elsewhere SDPA takes d_v."""
        B, T, _ = ckv_BTC.shape
        nh = self.n_heads
        q = self.q_up(cq_BTC).view(B, T, nh, self.d_qk).transpose(1, 2)  # [B, nh, T, d_qk]
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        c_kv, k_rope = ckv_BTC.split([self.cfg.kv_lora_rank, self.d_rope], dim=-1)
        kv = self.kv_up(c_kv).view(B, T, nh, self.d_nope + self.d_v).transpose(1, 2)  # [B, nh, T, d_nope + d_v]
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)

        interleaved = self.cfg.rope_interleave
        q_rope = apply_rope(q_rope, cos, sin, interleaved)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin, interleaved)  # [B, 1, T, d_R], shared by all heads

        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, nh, T, self.d_rope)], dim=-1)
        if v.device.type == "cpu" and self.d_v < self.d_qk:
            v = F.pad(v, (0, self.d_qk - self.d_v))
        return q, k, v

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal softmax attention [B, nh, T, d_v-or-padded] (eq. 10). `attn_mask` [B, 1, T, T] bool (True = may
        attend; packed rows: causal inside each document, `model.packing.document_causal_mask`) replaces the plain
        causal mask when given."""
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)

    def attention(self, cq_BTC, ckv_BTC, cos, sin, attn_mask=None) -> torch.Tensor:
        """From the latents to the attention output [B, nh, T, d_v(+pad)] (recompute overrides this)."""
        return self.core(*self.qkv(cq_BTC, ckv_BTC, cos, sin), attn_mask)

    def forward(
        self, x_BTH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]. cos/sin: [T, d_R/2], or [B, 1, T, d_R/2] for per-row positions; attn_mask:
        see `core`."""
        B, T, _ = x_BTH.shape
        o = self.attention(self.q_down(x_BTH), self.kv_a_proj_with_mqa(x_BTH), cos, sin, attn_mask)[..., : self.d_v]
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.n_heads * self.d_v))
