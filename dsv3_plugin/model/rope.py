"""Decoupled RoPE for MLA with YaRN context extension (Peng et al. 2023, arXiv 2309.00071).

DeepSeek-V3 applies RoPE only to the `qk_rope_head_dim` part of queries and the single shared rope key
(paper eqs. 3 and 7). Released weights store that part *interleaved* (pairs (x0,x1), (x2,x3) rotate together);
`rope_interleave=True` handles it. YaRN blends interpolated and extrapolated frequencies with a linear ramp
between the `beta_fast`/`beta_slow` correction dimensions, and scales the softmax by mscale(factor)^2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv3_plugin.config import ModelConfig

__all__ = ["RotaryEmbedding", "apply_rope", "yarn_mscale", "softmax_scale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction 0.1·m·ln(s) + 1 (1 when no extension)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_h + d_h^R), times mscale_all_dim's correction squared when YaRN is on (V3 config)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs is not None and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def _yarn_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, base, rs = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    if rs is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(n_rot: float) -> float:  # dimension whose wavelength fits n_rot turns in the context
        return dim * math.log(rs.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1 = keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (rs.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    attn_factor = 1.0
    if rs.mscale and rs.mscale_all_dim:
        attn_factor = yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(rs.factor)
    return inv_freq, attn_factor


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) of shape [*positions.shape, d_R/2] for given positions ([T], or [B, T] for packed rows
    whose positions restart per document), in fp32, then cast to the activations' dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attn_factor = _yarn_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [..., 1] x [d_R/2]: the same element-wise products for [T] and [B, T] positions
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)  # [..., d_R/2]
        return (freqs.cos() * self.attn_factor).to(dtype), (freqs.sin() * self.attn_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate x [..., T, d_R] by (cos, sin) [T, d_R/2] (or [B, 1, T, d_R/2]: per-row positions, all heads).

    Interleaved input pairs (x0,x1),(x2,x3)… are returned de-interleaved ([rotated evens | rotated odds]); the
    same permutation hits queries and keys, so q·k is that of the complex-pair rotation in DeepSeek's reference.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
