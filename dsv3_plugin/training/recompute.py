"""Selective activation recompute (DeepSeek-V3 report §3.2.3, "Recomputation of RMSNorm and MLA
Up-Projection"): the outputs of all RMSNorms and of the MLA up-projections are not kept for backward but
recomputed from their inputs there, trading a little compute for activation memory.

`memory.recompute`: ``none``, ``norm_and_mla_up`` (the paper's setting), ``full`` (each decoder layer).
`apply_recompute` / `remove_recompute` swap module classes (names, `state_dict`, `deepcopy` unchanged); losses
and gradients are bit-identical; `saved_activation_bytes` measures what autograd keeps. Details:
docs/design_notes.md (#training-recompute).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dsv3_plugin.config import ConfigError
from dsv3_plugin.model.mla import MLA
from dsv3_plugin.model.moe.router import skip_counting
from dsv3_plugin.model.norm import RMSNorm
from dsv3_plugin.model.transformer import DecoderLayer

__all__ = [
    "MODES",
    "apply_recompute",
    "remove_recompute",
    "saved_activation_bytes",
    "RecomputedRMSNorm",
    "RecomputedMLA",
    "RecomputedNormsDecoderLayer",
    "RecomputedDecoderLayer",
]

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


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device, cuda


@contextlib.contextmanager
def _rng_restored(state):
    """Run with the generators as they were at `_rng_state` (as torch.utils.checkpoint's preserve_rng_state), then
    put them back: a recompute draws the random numbers its forward drew, and nothing else sees it."""
    cpu, device, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else [], device_type=device.type):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


class _QKVRecompute(torch.autograd.Function):
    """q, k, v = fn(c_Q, [c_KV | k^R]) computed without a graph; only the two latents are saved. The outputs'
    storages are freed by `_QKVHolder.discard` after the attention kernel has saved them and refilled by
    `_QKVHolder.refill` (a pre-hook of the attention's backward node), which keeps the recomputed graph for
    this Function's backward to run through (the up-projections' gradients, their weights' included)."""

    @staticmethod
    def forward(ctx, holder, *latents):
        ctx.holder = holder
        ctx.save_for_backward(*latents)  # what the saved-tensor hooks (and the memory plan) see
        holder.latents = latents
        holder.rng = _rng_state(latents[0].device)  # the recompute draws what the forward drew (LoRA's dropout)
        with torch.no_grad():
            return holder.fn(*latents)

    @staticmethod
    def backward(ctx, *grads):
        holder = ctx.holder
        if holder.recomputed is None:  # the attention backward did not run its pre-hook (no refill)
            holder.refill()
        latents, outs = holder.recomputed
        holder.recomputed = None
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, *(t.grad if t.requires_grad else None for t in latents))


class _QKVHolder:
    # Holds the outputs' storages, not the outputs (an output references this Function's node, which references
    # the holder: a cycle autograd cannot collect); the latents are inputs and reference only upstream nodes.
    def __init__(self, fn):
        self.fn, self.latents, self.recomputed, self.storages, self.rng = fn, (), None, [], None

    def discard(self, outs) -> None:
        """Free every distinct storage behind `outs` (v may be a view of the kv up-projection's output)."""
        seen = {}
        for i, t in enumerate(outs):
            seen.setdefault(t.untyped_storage().data_ptr(), i)
        self.storages = [(outs[i].untyped_storage(), outs[i].untyped_storage().nbytes(), i) for i in seen.values()]
        for st, _, _ in self.storages:
            st.resize_(0)

    def refill(self, *_):
        if self.recomputed is not None:
            return
        latents = [t.detach().requires_grad_(t.requires_grad) for t in self.latents]
        with _rng_restored(self.rng), torch.enable_grad(), skip_counting():
            outs = self.fn(*latents)
        for st, n, i in self.storages:
            # the same ops on the same inputs: the same layout, so the bytes go back where they were
            st.resize_(n)
            st.copy_(outs[i].untyped_storage())
        self.recomputed = (latents, outs)


class RecomputedMLA(MLA):
    def attention(self, cq_BTC, ckv_BTC, cos, sin, attn_mask=None):
        if not torch.is_grad_enabled():
            return super().attention(cq_BTC, ckv_BTC, cos, sin, attn_mask)
        holder = _QKVHolder(lambda cq, ckv: MLA.qkv(self, cq, ckv, cos, sin))
        q, k, v = _QKVRecompute.apply(holder, cq_BTC, ckv_BTC)
        o = self.core(q, k, v, attn_mask)
        if o.grad_fn is None:
            return o
        holder.discard((q, k, v))
        o.grad_fn.register_prehook(holder.refill)
        return o


def _discard_until_backward(out: torch.Tensor, block_out: torch.Tensor, remake) -> None:
    """Free `out`'s storage now that the block reading it has run, and refill it (`remake()`, the same ops on
    the same input: the same bytes) when the backward reaches `block_out`, before any of the block's nodes
    that saved `out` runs. Its consumers keep references to the storage, which is what gets refilled."""
    if block_out.grad_fn is None or out.untyped_storage().nbytes() == 0:
        return
    st, n = out.untyped_storage(), out.untyped_storage().nbytes()
    st.resize_(0)

    def refill(*_):
        if st.nbytes() == 0:
            with torch.no_grad():
                new = remake()
            st.resize_(n)
            st.copy_(new.untyped_storage())

    block_out.grad_fn.register_prehook(refill)


class RecomputedNormsDecoderLayer(DecoderLayer):
    """norm_and_mla_up: the RMSNorm outputs are not kept either by the GEMMs that read them (the router, the
    Linears of high-precision layers): freed after the attention / FFN block ran, recomputed from the kept
    layer input when the backward enters that block (the normalized values, bit for bit)."""

    def forward(self, x_BTH, cos, sin, attn_mask=None, token_mask=None):
        if not torch.is_grad_enabled():
            return super().forward(x_BTH, cos, sin, attn_mask, token_mask)
        h = self.input_layernorm(x_BTH)
        a = self.self_attn(h, cos, sin, attn_mask)
        _discard_until_backward(h, a, lambda x=x_BTH: RMSNorm.forward(self.input_layernorm, x))
        x_BTH = x_BTH + a
        h = self.post_attention_layernorm(x_BTH)
        y = self.ffn(h, token_mask)
        _discard_until_backward(h, y, lambda x=x_BTH: RMSNorm.forward(self.post_attention_layernorm, x))
        return x_BTH + y


class RecomputedDecoderLayer(DecoderLayer):
    def forward(self, x_BTH, cos, sin, attn_mask=None, token_mask=None):
        return _ckpt(super().forward, x_BTH, cos, sin, attn_mask, token_mask)


_SWAPS = {
    "norm_and_mla_up": {RMSNorm: RecomputedRMSNorm, MLA: RecomputedMLA, DecoderLayer: RecomputedNormsDecoderLayer},
    "full": {DecoderLayer: RecomputedDecoderLayer},
}
_BASE = {
    RecomputedRMSNorm: RMSNorm,
    RecomputedMLA: MLA,
    RecomputedDecoderLayer: DecoderLayer,
    RecomputedNormsDecoderLayer: DecoderLayer,
}


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
    seen: dict[int, torch.UntypedStorage] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_storages and st.device.type != "meta":
            seen.setdefault(st._cdata, st)  # one entry per storage; holding it keeps its identity unique
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    # sized after the forward: storages freed before backward (recompute's discarded q, k, v) count zero
    total = sum(st.nbytes() for st in seen.values())
    del out
    return total
