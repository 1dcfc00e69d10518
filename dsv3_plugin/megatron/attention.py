"""Device-agnostic core attention for Megatron's MLA (`torch.nn.functional.scaled_dot_product_attention`).

Megatron-Core's MLA (`MLASelfAttention`) builds its core attention with `k_channels` (= qk_nope + qk_rope head
dims) and `v_channels` (= v_head_dim), which only Transformer Engine's attention accepts; the local
`DotProductAttention` rejects them. This module is the drop-in used by `dsv3_plugin.megatron.spec` when TE is
absent (CPU, or GPUs without TE): it takes Megatron's `[s, b, heads, dim]` q/k/v (q/k and v may have different
head dims, as MLA needs) and returns `[s, b, heads * v_dim]`, like the modules it replaces.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

__all__ = ["SDPACoreAttention"]


class SDPACoreAttention(MegatronModule):
    """Scaled dot-product attention with Megatron's core-attention constructor and forward signatures.

    Masking: Megatron's `attention_mask` is True where attention is *not* allowed. With a causal
    `attn_mask_type` the causal mask is always applied (combined with `attention_mask` if one is given).
    Dropout uses `config.attention_dropout` in training, under Megatron's model-parallel RNG fork.
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        **kwargs,
    ):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) > 1:
            raise ValueError("SDPACoreAttention: context_parallel_size > 1 is not supported (use TE attention)")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.k_channels**-0.5
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _is_causal(self, attn_mask_type) -> bool:
        t = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        return t in (AttnMaskType.causal, getattr(AttnMaskType, "padding_causal", AttnMaskType.causal))

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **kwargs,
    ):
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed sequences (thd) are not supported")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias is not supported")
        s_q, b, nh, _ = query.shape
        s_k = key.shape[0]
        q_BNSD = query.permute(1, 2, 0, 3)  # [b, heads, s_q, d_qk]
        k_BNSD = key.permute(1, 2, 0, 3)  # [b, heads, s_k, d_qk]
        v_BNSD = value.permute(1, 2, 0, 3)  # [b, heads, s_k, d_v]
        causal = self._is_causal(attn_mask_type)
        allowed = None
        if attention_mask is not None:
            allowed = ~attention_mask.to(torch.bool)  # broadcastable to [b, heads, s_q, s_k]
            if causal:
                tril = torch.ones(s_q, s_k, dtype=torch.bool, device=query.device).tril(s_k - s_q)
                allowed = allowed & tril
        p = self.dropout_p if self.training else 0.0
        ctx = tensor_parallel.get_cuda_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with ctx:
            o_BNSD = F.scaled_dot_product_attention(
                q_BNSD,
                k_BNSD,
                v_BNSD,
                attn_mask=allowed,
                dropout_p=p,
                is_causal=causal and allowed is None,
                scale=self.softmax_scale,
            )
        return o_BNSD.permute(2, 0, 1, 3).reshape(s_q, b, nh * o_BNSD.shape[-1])  # [s, b, heads * d_v]
