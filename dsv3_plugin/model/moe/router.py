"""DeepSeekMoE router: sigmoid affinities, selection-only bias, group (node)-limited top-k.

Paper eqs. 13-16 and §2.1.2 ("the bias term is only used for routing"), DeepSeek-V3 `inference/model.py`
`Gate.forward`. For tokens T and routed experts E:

1. s = sigmoid(u·e_i) in fp32 (eq. 15); biased = s + b (`e_score_correction_bias`, fp32, not trained by gradient)
2. group score = sum of the top-(K_r/M) biased scores per group; keep the best `topk_group` (M) groups and mask
   the others with **-inf** (NOTE: transformers 4.x masked with 0.0, which can pick a masked expert)
3. top-K_r of the masked biased scores -> indices
4. gates = the *unbiased* s at those indices, normalized over the selected K_r, × route_scale (eq. 16)
No capacity, no token dropping; the sequence-wise balance loss (eqs. 17-20) is in `balancing.py`.
Design notes: docs/design_notes.md#model-moe-router
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import MoEConfig

__all__ = ["Router", "RoutingResult", "group_limited_topk", "skip_counting", "counting_enabled", "fp32_linear"]

_state = threading.local()


@contextlib.contextmanager
def skip_counting():
    """Forward passes inside this context do not add to `tokens_per_expert` (activation recompute re-runs
    the forward in backward; counting it again would double the loads the bias update sees)."""
    prev = getattr(_state, "skip", False)
    _state.skip = True
    try:
        yield
    finally:
        _state.skip = prev


def counting_enabled() -> bool:
    return not getattr(_state, "skip", False)


class _Fp32Linear(torch.autograd.Function):
    """x·Wᵀ computed in FP32 from x and W in any precision, keeping x and W as given for backward (autograd over
    `F.linear(x.float(), W.float())` would keep FP32 copies: 4 bytes per element of the router's input instead
    of the activations' 2). The same GEMMs and casts as autograd's backward of that expression."""

    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        return F.linear(x_TH.float(), w_EH.float())

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        gx = g_TE.mm(w_EH.float()).to(x_TH.dtype) if ctx.needs_input_grad[0] else None
        gw = g_TE.t().mm(x_TH.float()).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def fp32_linear(x_TH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """F.linear(x.float(), w.float()) that keeps only x and w (in their own dtypes) for backward."""
    return _Fp32Linear.apply(x_TH, w_EH)


class RoutingResult:
    """What one routing call produced. Shapes: T tokens, E experts, K = top_k."""

    __slots__ = ("topk_idx_TK", "gates_TK", "scores_TE")

    def __init__(self, topk_idx_TK, gates_TK, scores_TE):
        self.topk_idx_TK = topk_idx_TK
        self.gates_TK = gates_TK
        self.scores_TE = scores_TE


def group_limited_topk(biased_TE: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """Indices [T, K] of the top-k biased scores restricted to the best `topk_group` groups.

    Group score = sum of the top-(top_k // topk_group) biased scores in the group (top-2 for V3: K_r/M = 8/4).

    NOTE: the paper's node score is the top-(K_r/M) sum, as here and in Megatron-Core; DeepSeek's reference
    code and transformers hard-code the top-2 sum. They agree whenever K_r/M = 2 (V3, V2, our presets).
    """
    T, E = biased_TE.shape
    if n_group > 1 and topk_group < n_group:
        per_group = E // n_group
        k_in_group = max(1, min(top_k // topk_group, per_group))
        grouped_TGe = biased_TE.view(T, n_group, per_group)
        group_score_TG = grouped_TGe.topk(k_in_group, dim=-1).values.sum(dim=-1)
        keep_TG = group_score_TG.topk(topk_group, dim=-1).indices
        mask_TG = torch.ones(T, n_group, dtype=torch.bool, device=biased_TE.device).scatter_(1, keep_TG, False)
        biased_TE = biased_TE.masked_fill(mask_TG.repeat_interleave(per_group, dim=1), float("-inf"))
    return biased_TE.topk(top_k, dim=-1).indices


def _fp32_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.float32)


class Router(nn.Module):
    """Released name: `mlp.gate` (`weight` [E, H], `e_score_correction_bias` [E])."""

    def __init__(self, hidden_size: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E = cfg.n_routed_experts
        # The router stays in fp32 (paper §3.3: gating is kept in original precision).
        self.weight = nn.Parameter(torch.empty(E, hidden_size, dtype=torch.float32))
        # b_i: fp32, persistent (it must survive checkpoints), updated once per optimizer step by
        # `balancing.update_expert_bias`, never by gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        # Loads counted in forward (training only), summed over micro-batches until the next update.
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        # False under a mixed-precision optimizer (DeepSpeed bf16): the weight is then a BF16 compute copy like every
        # other parameter (its FP32 master lives in the optimizer, whose flat buffers need one dtype per group);
        # the gating math stays FP32 either way (`scores`).
        self.keep_fp32_weight = True
        nn.init.normal_(self.weight, std=0.006)

    def _apply(self, fn, recurse=True):
        # Keep the router's state fp32 whatever `.to(dtype)` the model gets (Megatron-LM#1482: a bf16 bias
        # cannot represent 1e-3 steps around 1.0). The fp32 values are kept aside and only moved: casting back
        # after the model's cast would leave a loaded bias rounded to bf16 (1.001 -> 1.0).
        keep = {n: getattr(self, n) for n in ("e_score_correction_bias", "tokens_per_expert")}
        w = self.weight.data
        super()._apply(fn, recurse)
        if self.keep_fp32_weight and self.weight.dtype != torch.float32:
            self.weight.data = _fp32_on((w if w.dtype == torch.float32 else self.weight.data), self.weight.device)
        for name, old in keep.items():
            b = getattr(self, name)
            if b.dtype != torch.float32:
                setattr(self, name, _fp32_on(old if old.dtype == torch.float32 else b, b.device))
        return self

    def scores(self, x_TH: torch.Tensor) -> torch.Tensor:
        """s = sigmoid(x·W^T) in fp32, [T, E]."""
        return torch.sigmoid(fp32_linear(x_TH, self.weight))

    def forward(self, x_TH: torch.Tensor, token_mask_T: torch.Tensor | None = None) -> RoutingResult:
        """Route T tokens [T, H]. `token_mask_T` [T] bool: False at padding, which is routed like every token
        (static shapes) but not counted in `tokens_per_expert` (the loads the bias update and MaxVio read)."""
        cfg = self.cfg
        scores_TE = self.scores(x_TH)
        with torch.no_grad():  # selection is not differentiable; gates below are
            biased_TE = scores_TE + self.e_score_correction_bias
            topk_idx_TK = group_limited_topk(biased_TE, cfg.top_k, cfg.n_group, cfg.topk_group)
            if self.training and counting_enabled():
                E = cfg.n_routed_experts
                if token_mask_T is None:
                    self.tokens_per_expert += torch.bincount(topk_idx_TK.flatten(), minlength=E).float()
                else:
                    # weights 1 / 0 per (token, slot): integer counts in float32, no host sync (unlike a
                    # boolean index)
                    w_TK = token_mask_T.to(torch.float32)[:, None].expand(topk_idx_TK.shape)
                    self.tokens_per_expert += torch.bincount(
                        topk_idx_TK.flatten(), weights=w_TK.reshape(-1), minlength=E
                    ).float()
        gates_TK = scores_TE.gather(1, topk_idx_TK)
        if cfg.norm_topk_prob:
            gates_TK = gates_TK / (gates_TK.sum(dim=-1, keepdim=True) + 1e-20)
        gates_TK = gates_TK * cfg.route_scale
        return RoutingResult(topk_idx_TK, gates_TK, scores_TE)
