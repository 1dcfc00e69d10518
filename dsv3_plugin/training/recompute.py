"""Selective activation recompute (DeepSeek-V3 report §3.2.3, "Recomputation of RMSNorm and MLA
Up-Projection"): the outputs of all RMSNorms and of the MLA up-projections are not kept for backward but
recomputed from their inputs there, trading a little compute for activation memory.

`memory.recompute`:
  * ``none``            — keep everything;
  * ``norm_and_mla_up`` — the paper's setting: every RMSNorm outside MLA, and MLA's query path
                          (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, i.e. `MLA.q_up`) and key/value
                          up-projection (`kv_a_layernorm` -> `kv_b_proj`, `MLA.kv_up`);
  * ``full``            — each decoder layer (main and MTP) as a whole.

Implemented with `torch.utils.checkpoint` (non-reentrant), applied by swapping a module's class for a
subclass that checkpoints the wrapped method — parameter names, `state_dict` and `deepcopy` are unchanged,
and `remove_recompute` swaps back. Recomputation is the same arithmetic on the same inputs, so losses and
gradients are bit-identical; the router's expert counts are not incremented again during recompute
(`router.skip_counting`). `saved_activation_bytes` measures what autograd keeps (saved-tensor hooks).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv3_plugin.config import ConfigError
from dsv3_plugin.model.mla import MLA
from dsv3_plugin.model.transformer import DecoderLayer
from dsv3_plugin.model.norm import RMSNorm
from dsv3_plugin.model.moe.router import skip_counting

__all__ = ["MODES", "apply_recompute", "remove_recompute", "saved_activation_bytes",
           "RecomputedRMSNorm", "RecomputedMLA", "RecomputedDecoderLayer"]

MODES = ("none", "norm_and_mla_up", "full")


def _contexts():
    # forward runs normally; the backward-time re-run must not count expert loads a second time
    return contextlib.nullcontext(), skip_counting()


def _ckpt(fn, *args):
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)


class RecomputedRMSNorm(RMSNorm):
    def forward(self, x):
        return _ckpt(super().forward, x)


class RecomputedMLA(MLA):
    def q_up(self, x_BTH):
        return _ckpt(super().q_up, x_BTH)

    def kv_up(self, c_kv):
        return _ckpt(super().kv_up, c_kv)


class RecomputedDecoderLayer(DecoderLayer):
    def forward(self, x_BTH, cos, sin):
        return _ckpt(super().forward, x_BTH, cos, sin)


_SWAPS = {"norm_and_mla_up": {RMSNorm: RecomputedRMSNorm, MLA: RecomputedMLA},
          "full": {DecoderLayer: RecomputedDecoderLayer}}
_BASE = {RecomputedRMSNorm: RMSNorm, RecomputedMLA: MLA, RecomputedDecoderLayer: DecoderLayer}


def remove_recompute(model: nn.Module) -> None:
    for mod in model.modules():
        if type(mod) in _BASE:
            mod.__class__ = _BASE[type(mod)]


def apply_recompute(model: nn.Module, mode: str) -> list[str]:
    """Enable `mode` on `model` in place (replacing any previous mode); returns the wrapped module names."""
    if mode not in MODES:
        raise ConfigError(f"dsv3.memory.recompute: must be one of {', '.join(MODES)} (got {mode!r})")
    remove_recompute(model)
    if mode == "none":
        return []
    swaps = _SWAPS[mode]
    mla_names = [n for n, m in model.named_modules() if isinstance(m, MLA)]
    done = []
    for name, mod in model.named_modules():
        new_cls = swaps.get(type(mod))
        if new_cls is None:
            continue
        # norms inside MLA are already inside the recomputed q_up / kv_up (no nested checkpoints)
        if new_cls is RecomputedRMSNorm and any(name.startswith(p + ".") for p in mla_names):
            continue
        mod.__class__ = new_cls
        done.append(name)
    return done


def saved_activation_bytes(model: nn.Module, fn) -> int:
    """Bytes of distinct tensor storages autograd keeps for backward while `fn()` runs (parameters excluded):
    the activation memory a backward pass needs. Returns the count; `fn`'s result is discarded."""
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_storages and st.device.type != "meta":
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())
