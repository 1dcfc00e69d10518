"""Megatron-Core's MTP layer with the paper's hand-off between depths (paper §2.2, eqs. 21-23, Fig. 3).

Megatron's `MultiTokenPredictionBlock` passes depth k+1 the tensor depth k returned, which is already through
depth k's `final_layernorm` (the released `shared_head.norm`), and depth k+1 applies `hnorm` on top. In the paper
(and our `DSv3Model`) depth k+1 combines hnorm(h^k) with h^k the transformer block's output, the norm belonging
to the output head only. The two agree for depth 1 (h^0 is the main model's final-normed state in both), and
differ from depth 2 on.

`DSv3MTPLayer` returns the normed state as Megatron expects (the shared output head reads it) and attaches the
pre-norm h^k to it; the next `DSv3MTPLayer` picks that up instead. Gradients flow through both uses.
"""

from __future__ import annotations

from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

__all__ = ["DSv3MTPLayer"]

_ATTR = "_dsv3_mtp_pre_norm"


class DSv3MTPLayer(MultiTokenPredictionLayer):
    def _postprocess(self, hidden_states):
        out = super()._postprocess(hidden_states)  # final_layernorm: what the shared head reads
        setattr(out, _ATTR, hidden_states)  # h^k for the next depth (eq. 21)
        return out

    def forward(self, *args, **kwargs):
        if "hidden_states" in kwargs:
            pre = getattr(kwargs["hidden_states"], _ATTR, None)
            if pre is not None:
                kwargs["hidden_states"] = pre
        elif len(args) >= 3:
            pre = getattr(args[2], _ATTR, None)
            if pre is not None:
                args = args[:2] + (pre,) + args[3:]
        return super().forward(*args, **kwargs)
