"""LoRA (Hu et al. 2021; peft's conventions) on a frozen base, attached through the kernel seams:

    y = W x + s · B (A dropout(x)),   s = alpha / r   (alpha / √r with rsLoRA),   B = 0 at init

An adapted Linear `P` gets `P.lora_A` [r, d_in] and `P.lora_B` [d_out, r] and its kernel is wrapped in
`LoRALinearKernel` (the adapter branch is a second `SplitKernel` node run through the same wrapper chain, so
the W split defers exactly the adapters' weight gradients); routed experts get `w{1,3,2}_lora_{A,B}`
([E, r, K] / [E, O, r]) and `LoRAExpertKernel` (the SwiGLU with the adapters inside it). Everything else is
frozen (requires_grad False). A is Kaiming-uniform (a = √5, as peft), drawn per parameter name (and global
expert) from `train.seed`, so every rank and layout holds the same adapters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import ConfigError, DSv3Config, LoRAConfig, lora_targets
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.init import param_seed
from dsv3_plugin.model.kernels import (
    KernelLinear,
    KernelWrapper,
    PlainLinearKernel,
    SplitKernel,
    apply_split,
    expert_spans,
)
from dsv3_plugin.model.moe.layer import GroupedExperts, GroupedSwiGLUKernel
from dsv3_plugin.precision.fp8.frozen import FrozenFp8ExpertKernel, FrozenFp8Linear, expert_scales
from dsv3_plugin.precision.fp8.quant import fp8_combine_grad_qdq, fp8_dispatch_qdq

__all__ = [
    "EXPERT_ADAPTERS",
    "LoRALinearKernel",
    "LoRAExpertKernel",
    "LoRAReport",
    "apply_lora",
    "lora_scale",
    "adapter_names",
    "is_adapter",
    "lora_model_config",
    "bias_update_speed",
    "trainable_parameters",
    "lora_checkpoint_state",
    "check_lora_checkpoint",
]

# routed-expert weight (= its `lora.targets` name) -> adapter prefix: gate_proj = w1, up_proj = w3, down_proj = w2
EXPERT_ADAPTERS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def lora_scale(lo: LoRAConfig) -> float:
    """s = alpha / r, or alpha / √r with `use_rslora`."""
    return lo.alpha / (math.sqrt(lo.rank) if lo.use_rslora else lo.rank)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's (`*.lora_A`, `*.w1_lora_B`, ...)."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf.endswith("lora_A") or leaf.endswith("lora_B")


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the model's adapter parameters, in `named_parameters` order."""
    return [n for n, _ in model.named_parameters() if is_adapter(n)]


# --------------------------------------------------------------------------------------------------
# Linear layers


class _Adapter:
    """The `static` of an adapter node (tells `LoRALinearKernel`'s parts it is not the base's)."""

    __slots__ = ("scale",)

    def __init__(self, scale: float):
        self.scale = scale


class LoRALinearKernel(KernelWrapper):
    """Wraps a Linear module's kernel: y = inner(x, ...) + s · B (A d) with d = dropout(x), A and B read from
    `owner` (its `lora_A` [r, K], `lora_B` [O, r]). The adapter runs as its own `apply_split` node through the
    same `via` (outer wrappers, e.g. W deferral, apply to it); its parts here, the base's delegated inward.
    Saved: d, t = d·Aᵀ [M, r], A, B. I: dt = s·dz·B, dd = dt·A; W: dA = dtᵀ·d, dB = s·dzᵀ·t."""

    def __init__(self, inner: SplitKernel, owner: nn.Module, scale: float, dropout: float = 0.0):
        super().__init__(inner)
        self.owner, self.scale, self.dropout = owner, scale, dropout

    def call(self, via, x, *args, **kwargs):
        y = self.inner.call(via, x, *args, **kwargs)
        d = F.dropout(x, self.dropout, self.owner.training) if self.dropout else x
        z = apply_split(via, _Adapter(self.scale), d, self.owner.lora_A, self.owner.lora_B)
        return y + z

    def forward(self, static, x, weights, need_w):
        if not isinstance(static, _Adapter):
            return self.inner.forward(static, x, weights, need_w)
        A, B = (w.to(x.dtype) for w in weights)
        d2 = x.reshape(-1, x.shape[-1])  # [M, K]
        t = d2 @ A.t()  # [M, r]
        z = (t @ B.t()) * static.scale  # [M, O]
        meta = (static, x.shape, tuple(w.dtype for w in weights))
        return z.reshape(*x.shape[:-1], B.shape[0]), (d2, t, A, B), meta

    def input_grad(self, saved, meta, dy, need):
        if not (isinstance(meta, tuple) and meta and isinstance(meta[0], _Adapter)):
            return self.inner.input_grad(saved, meta, dy, need)
        _, t, A, B = saved
        dz = dy.reshape(-1, dy.shape[-1]).to(t.dtype)  # [M, O]
        dt = (dz @ B) * meta[0].scale  # [M, r]
        dd = (dt @ A).reshape(meta[1]) if need[0] else None
        return dd, (dz, dt)

    def weight_grads(self, saved, meta, carry, need_w):
        if not (isinstance(meta, tuple) and meta and isinstance(meta[0], _Adapter)):
            return self.inner.weight_grads(saved, meta, carry, need_w)
        d2, t, _, _ = saved
        dz, dt = carry
        dA = (dt.t() @ d2).to(meta[2][0]) if need_w[0] else None  # [r, K]
        dB = ((dz.t() @ t) * meta[0].scale).to(meta[2][1]) if need_w[1] else None  # [O, r]
        return dA, dB

    def __repr__(self) -> str:
        return f"LoRALinearKernel(s={self.scale:g}, dropout={self.dropout}, {self.inner!r})"


# --------------------------------------------------------------------------------------------------
# Routed experts


class _Fp8Base:
    """Base GEMMs of frozen FP8 experts (the stored blocks, `FrozenFp8Gemm`)."""

    def __init__(self, gemm, scales):
        self.gemm, self.scales = gemm, scales

    def fwd(self, x, w, k, e):
        return self.gemm.fwd(x, w[e], self.scales[k][e]).to(x.dtype)

    def dgrad(self, dy, w, k, e):
        return self.gemm.dgrad(dy, w[e], self.scales[k][e])


class _PlainBase:
    """Base GEMMs of high-precision frozen experts."""

    def fwd(self, x, w, k, e):
        return x @ w[e].to(x.dtype).t()

    def dgrad(self, dy, w, k, e):
        return dy @ w[e].to(dy.dtype)


def _drop_mask(x: torch.Tensor, p: float, training: bool) -> torch.Tensor | None:
    return (torch.rand_like(x, dtype=torch.float32) >= p) if p and training else None


def _dropped(x, mask, p):
    return x if mask is None else x * mask.to(x.dtype) / (1 - p)


class LoRAExpertKernel(SplitKernel):
    """`kernels.ExpertKernel` of frozen experts with adapters: per expert e on its rows X (d = dropout),
        g = W1 X + s B1 A1 d(X),  u = W3 X + s B3 A3 d(X),  h = r ⊙ silu(g) ⊙ u,  Y = W2 h + s B2 A2 d(h)
    (r: the routing weights). The base GEMMs are the frozen kernel's (FP8 blocks or high precision); A, B
    [E, r, K] / [E, O, r] are read from `owner` (`w1_lora_A`, ...; None where not adapted). I computes dX and dr;
    W only the adapters' gradients (experts without rows: zero)."""

    row_scale = True

    def __init__(self, base: SplitKernel, owner: GroupedExperts, scale: float, dropout: float, which: tuple[str, ...]):
        if not isinstance(base, (FrozenFp8ExpertKernel, GroupedSwiGLUKernel)):
            raise TypeError(f"LoRAExpertKernel: cannot adapt experts running {base!r} (frozen FP8 or plain only)")
        self.base, self.owner, self.scale, self.dropout, self.which = base, owner, scale, dropout, which

    def _adapters(self):
        # under DeepSpeed expert parallelism the adapters live per expert in `owner.lora_experts`
        # (`deepspeed.moe_layer.DeepSpeedExpertAdapters`), read back stacked; otherwise on `owner` itself
        per_expert = getattr(self.owner, "lora_experts", None)
        get = (lambda n: getattr(self.owner, n)) if per_expert is None else per_expert.stacked
        return tuple(get(f"{k}_lora_{ab}") if k in self.which else None for k in ("w1", "w3", "w2") for ab in "AB")

    def call(self, via, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N=None):
        if sum(counts) != x_NH.shape[0]:
            raise ValueError(f"LoRAExpertKernel: counts sum to {sum(counts)} but there are {x_NH.shape[0]} rows")
        for n, w in zip(EXPERT_ADAPTERS, (w1_EIH, w3_EIH, w2_EHI)):
            if w is not getattr(self.owner, n):  # the adapters are the owner's: its weights must be too
                raise RuntimeError(
                    f"LoRAExpertKernel: got a {tuple(w.shape)} weight that is not its experts' {n} (adapted experts "
                    "cannot be re-sliced or stacked: build them rank-locally)"
                )
        fp8 = isinstance(self.base, FrozenFp8ExpertKernel)
        ops = _Fp8Base(self.base.gemm, expert_scales(self.owner, w1_EIH, w3_EIH, w2_EHI)) if fp8 else _PlainBase()
        dispatch = fp8 and self.base.dispatch
        if dispatch:
            x_NH = fp8_dispatch_qdq(x_NH)
        ws = (w1_EIH, w3_EIH, w2_EHI, *self._adapters())
        y = apply_split(via, (list(counts), ops, self.owner.training), x_NH, *ws, scale=scale_N)
        return fp8_combine_grad_qdq(y) if dispatch else y

    def forward(self, static, x_NH, weights, need_w):
        counts, ops, training = static
        x_NH, r_N = x_NH if isinstance(x_NH, tuple) else (x_NH, None)
        w1, w3, w2, *ad = weights
        dt, s, p = x_NH.dtype, self.scale, self.dropout
        A1, B1, A3, B3, A2, B2 = (None if a is None else a.to(dt) for a in ad)
        N = x_NH.shape[0]
        spans = expert_spans(counts)
        g_NI = x_NH.new_empty(N, w1.shape[1])
        u_NI = torch.empty_like(g_NI)
        y_NH = x_NH.new_empty(N, w2.shape[1])
        m_x = _drop_mask(x_NH, p, training) if A1 is not None or A3 is not None else None
        xd = _dropped(x_NH, m_x, p)
        t1, t3 = (None if A is None else x_NH.new_empty(N, A.shape[1]) for A in (A1, A3))
        for e, a, b in spans:
            g_NI[a:b] = ops.fwd(x_NH[a:b], w1, 0, e)
            u_NI[a:b] = ops.fwd(x_NH[a:b], w3, 1, e)
            for t, A, B, out in ((t1, A1, B1, g_NI), (t3, A3, B3, u_NI)):
                if A is not None:
                    t[a:b] = xd[a:b] @ A[e].t()
                    out[a:b] += (t[a:b] @ B[e].t()) * s
        h_NI = F.silu(g_NI) * u_NI
        if r_N is not None:
            h_NI = h_NI * r_N[:, None].to(dt)  # the routing weight, before W2
        m_h = _drop_mask(h_NI, p, training) if A2 is not None else None
        hd = _dropped(h_NI, m_h, p)
        t2 = None if A2 is None else x_NH.new_empty(N, A2.shape[1])
        for e, a, b in spans:
            y_NH[a:b] = ops.fwd(h_NI[a:b], w2, 2, e)
            if A2 is not None:
                t2[a:b] = hd[a:b] @ A2[e].t()
                y_NH[a:b] += (t2[a:b] @ B2[e].t()) * s
        saved = (x_NH, g_NI, u_NI, r_N, m_x, m_h, t1, t3, t2, w1, w3, w2, A1, B1, A3, B3, A2, B2)
        return y_NH, saved, (spans, ops, tuple(None if a is None else (a.shape, a.dtype) for a in ad))

    def input_grad(self, saved, meta, dy_NH, need):
        x_NH, g_NI, u_NI, r_N, m_x, m_h, t1, t3, t2, w1, w3, w2, A1, B1, A3, B3, A2, B2 = saved
        spans, ops, _ = meta
        dt, s, p = x_NH.dtype, self.scale, self.dropout
        need_x, need_r = need[0] if r_N is not None else (need[0], False)
        dy_NH = dy_NH.to(dt)
        dh = torch.zeros_like(g_NI, dtype=torch.float32)  # dL/d(r·silu(g)·u)
        dt2 = None if A2 is None else dy_NH.new_empty(dy_NH.shape[0], A2.shape[1])
        for e, a, b in spans:
            dh[a:b] = ops.dgrad(dy_NH[a:b], w2, 2, e)
            if A2 is not None:
                dt2[a:b] = (dy_NH[a:b] @ B2[e]) * s
                dh[a:b] += _dropped(dt2[a:b] @ A2[e], None if m_h is None else m_h[a:b], p)
        g, u = g_NI.float(), u_NI.float()
        sig = torch.sigmoid(g)
        silu = g * sig
        dr = (dh * silu * u).sum(-1).to(r_N.dtype) if need_r else None  # dL/dr = <dh, silu(g)·u>
        if r_N is not None:
            dh = dh * r_N[:, None].float()
        dg32 = dh * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
        du32 = dh * silu
        dg, du = dg32.to(dt), du32.to(dt)  # the adapters' operands
        dx = torch.zeros_like(x_NH) if need_x else None
        dt1 = None if A1 is None else dg.new_empty(dg.shape[0], A1.shape[1])
        dt3 = None if A3 is None else dg.new_empty(dg.shape[0], A3.shape[1])
        for e, a, b in spans:
            for dtk, d, B in ((dt1, dg, B1), (dt3, du, B3)):
                if dtk is not None:
                    dtk[a:b] = (d[a:b] @ B[e]) * s
            if dx is not None:
                acc = ops.dgrad(dg32[a:b], w1, 0, e) + ops.dgrad(du32[a:b], w3, 1, e)
                lo = sum(dtk[a:b] @ A[e] for dtk, A in ((dt1, A1), (dt3, A3)) if dtk is not None)
                dx[a:b] = (acc + _dropped(lo, None if m_x is None else m_x[a:b], p)).to(dt)
        h = None
        if A2 is not None:  # W2's adapter operand: d(r·silu(g)·u), as in forward
            h = (F.silu(g_NI) * u_NI) if r_N is None else F.silu(g_NI) * u_NI * r_N[:, None].to(dt)
            h = _dropped(h, m_h, p)
        return (dx if r_N is None else (dx, dr)), (dy_NH, dg, du, dt1, dt3, dt2, h)

    def weight_grads(self, saved, meta, carry, need_w):
        x_NH, _, _, _, m_x, _, t1, t3, t2 = saved[:9]
        spans, _, ad_meta = meta
        dy, dg, du, dt1, dt3, dt2, hd = carry
        s, xd = self.scale, _dropped(x_NH, m_x, self.dropout)
        grads = [
            None if not n or m is None else torch.zeros(m[0], dtype=m[1], device=x_NH.device)
            for n, m in zip(need_w[3:], ad_meta)
        ]
        terms = ((dt1, xd, dg, t1), (dt3, xd, du, t3), (dt2, hd, dy, t2))  # (dt, A's input, dz, t) per weight
        for e, a, b in spans:
            for k, (dtk, inp, dz, t) in enumerate(terms):
                gA, gB = grads[2 * k], grads[2 * k + 1]
                if gA is not None:
                    gA[e] = (dtk[a:b].t() @ inp[a:b]).to(gA.dtype)  # [r, K]
                if gB is not None:
                    gB[e] = ((dz[a:b].t() @ t[a:b]) * s).to(gB.dtype)  # [O, r]
        return (None, None, None, *grads)

    def __repr__(self) -> str:
        return f"LoRAExpertKernel(s={self.scale:g}, dropout={self.dropout}, {'/'.join(self.which)}, {self.base!r})"


# --------------------------------------------------------------------------------------------------
# The transform


@dataclass
class LoRAReport:
    scale: float
    targets: tuple[str, ...]
    linear: list[str] = field(default_factory=list)  # adapted Linear modules
    experts: list[str] = field(default_factory=list)  # adapted GroupedExperts
    trainable: int = 0  # adapter elements this rank holds (not on meta)


@torch.no_grad()
def _new_adapter(shape, dtype, device, seed: int, name: str, zero: bool, expert_offset: int | None) -> nn.Parameter:
    t = torch.zeros(shape, dtype=torch.float32, device="meta" if device.type == "meta" else "cpu")
    if not zero and not t.is_meta:
        rows = [t] if expert_offset is None else list(t)
        for i, row in enumerate(rows):
            key = None if expert_offset is None else expert_offset + i
            g = torch.Generator().manual_seed(param_seed(seed, "lora/" + name, key))
            nn.init.kaiming_uniform_(row, a=math.sqrt(5), generator=g)  # peft's A; fan_in = K
    return nn.Parameter(t.to(device=device, dtype=dtype))


def _compute_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and p.dtype.itemsize > 1:
            return p.dtype
    return torch.float32


def lora_model_config(cfg: DSv3Config) -> DSv3Config:
    """The config a LoRA run builds its model (and rank layout) from: `lora.mtp = "off"` builds no MTP modules
    (mtp.depth 0: no MTP loss, no MTP memory, as transformers/peft's DeepseekV3); otherwise `cfg` itself."""
    if cfg.lora is None or cfg.lora.mtp != "off" or cfg.mtp.depth == 0:
        return cfg
    d = cfg.to_dict()
    d["mtp"]["depth"] = 0
    return DSv3Config.from_block(d)


def bias_update_speed(cfg: DSv3Config, tokens_seen: float) -> float:
    """γ of the aux-loss-free bias update after an optimizer step: `moe.gamma(tokens_seen)`, or 0 (the released
    bias stays; loads are still counted and reported) under LoRA with `lora.bias_update` false."""
    if cfg.lora is not None and not cfg.lora.bias_update:
        return 0.0
    return cfg.moe.gamma(tokens_seen)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters an optimizer (ZeRO-1's partitions) gets: those with requires_grad (the adapters)."""
    return [p for p in model.parameters() if p.requires_grad]


def lora_checkpoint_state(model: nn.Module) -> dict:
    """What a LoRA checkpoint records besides the adapters and their optimizer state: the base's fingerprint
    (`checkpoint.frozen_base.base_fingerprint`; None for a base not loaded from a release), the base's directory
    (`base_path`, absolute; None likewise: where `dsv3 export` finds the base), the adapter names and the scale."""
    rep = getattr(model, "lora_report", None)
    if rep is None:
        raise ValueError("lora_checkpoint_state: the model has no LoRA adapters (apply_lora was not run)")
    return {
        "base_fingerprint": getattr(model, "base_fingerprint", None),
        "base_path": getattr(model, "base_path", None),
        "adapters": adapter_names(model),
        "scale": rep.scale,
    }


def check_lora_checkpoint(model: nn.Module, state: dict | None, where: str) -> None:
    """Refuse to resume `model` from a checkpoint (`where`) whose LoRA record (`lora_checkpoint_state`) is missing
    or names another base, other adapters or another scale: CheckpointError naming what differs."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: no LoRA record in the checkpoint (not saved by a dsv3.lora run)")
    have = lora_checkpoint_state(model)
    if state.get("base_fingerprint") != have["base_fingerprint"]:
        raise CheckpointError(
            f"{where}: adapters trained on base {state.get('base_fingerprint')}, but this run's base is "
            f"{have['base_fingerprint']}"
        )
    if state.get("adapters") != have["adapters"]:
        missing = sorted(set(have["adapters"]) - set(state.get("adapters") or []))
        extra = sorted(set(state.get("adapters") or []) - set(have["adapters"]))
        raise CheckpointError(f"{where}: adapters differ from this run's (missing {missing[:3]}, extra {extra[:3]})")
    if state.get("scale") != have["scale"]:
        raise CheckpointError(f"{where}: adapters scaled by {state.get('scale')}, this run by {have['scale']}")


def apply_lora(model: nn.Module, cfg: DSv3Config, dtype: torch.dtype | None = None) -> LoRAReport:
    """Freeze `model` and attach `cfg.lora`'s adapters, in place (after FP8, before recompute / EP / W split).

    Args:
        model: a `DSv3Model` (full or rank-local; modules on `meta` get `meta` adapters).
        cfg: its config; `cfg.lora` must be set.
        dtype: the adapters' dtype (default: the model's first high-precision parameter's).

    Returns:
        The `LoRAReport` (also `model.lora_report`). Adapters on decoder layers only (`layers.*`: the MTP
        modules, embedding, head, norms and routers stay frozen).

    Raises:
        ConfigError: `lora.mtp` is "off" but the model has MTP modules (build it from `lora_model_config`).
    """
    lo = cfg.lora
    if lo is None:
        raise ValueError("apply_lora: the config has no dsv3.lora section")
    if getattr(model, "lora_report", None) is not None:
        raise ValueError("apply_lora: the model already has LoRA adapters")
    if lo.mtp == "off" and len(getattr(model, "mtp", ())):
        raise ConfigError(
            "dsv3.lora.mtp: 'off' trains without the MTP loss, but the model was built with MTP modules; build it "
            "from training.lora.lora_model_config(cfg) (mtp.depth 0)"
        )
    targets, s = lora_targets(cfg), lora_scale(lo)
    dtype = dtype or _compute_dtype(model)
    rep = LoRAReport(scale=s, targets=targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, mod in list(model.named_modules()):
        if not name.startswith("layers."):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, (nn.Linear, FrozenFp8Linear)) and leaf in targets:
            if type(mod) is nn.Linear:  # give it the kernel seam (as `split_weight_grads` does)
                mod.__class__ = KernelLinear
                mod.kernel = PlainLinearKernel()
            dev = mod.weight.device
            K, O = mod.in_features, mod.out_features
            mod.lora_A = _new_adapter((lo.rank, K), dtype, dev, cfg.train.seed, name + ".lora_A", False, None)
            mod.lora_B = _new_adapter((O, lo.rank), dtype, dev, cfg.train.seed, name + ".lora_B", True, None)
            mod.kernel = LoRALinearKernel(mod.kernel, mod, s, lo.dropout)
            rep.linear.append(name)
        elif isinstance(mod, GroupedExperts) and lo.experts:
            which = tuple(EXPERT_ADAPTERS[n] for n in EXPERT_ADAPTERS if n in targets)
            if not which:
                continue
            off = getattr(mod, "expert_range", range(0)).start
            for wname, k in EXPERT_ADAPTERS.items():
                if k not in which:
                    continue
                w = getattr(mod, wname)
                E, O, K = w.shape
                pa, pb = f"{name}.{k}_lora_A", f"{name}.{k}_lora_B"
                setattr(
                    mod, f"{k}_lora_A", _new_adapter((E, lo.rank, K), dtype, w.device, cfg.train.seed, pa, False, off)
                )
                setattr(
                    mod, f"{k}_lora_B", _new_adapter((E, O, lo.rank), dtype, w.device, cfg.train.seed, pb, True, off)
                )
            mod.kernel = LoRAExpertKernel(mod.kernel, mod, s, lo.dropout, which)
            rep.experts.append(name)
    rep.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad and not p.is_meta)
    model.lora_report = rep
    return rep
