"""A frozen base kept in FP8: weights stored as released (E4M3 [O, K] + fp32 `weight_scale_inv`
[ceil(O/128), ceil(K/128)]), never as a high-precision copy, computed with the FP8 GEMMs of report §3.3:

    Fprop  Y  = X · Wᵀ      X 1×128 tiles along K (quantized per call), W the stored 128×128 blocks
    Dgrad  dX = dY · W      dY 1×128 tiles along O,                       Wᵀ the stored blocks, transposed

A frozen weight has no Wgrad: its kernel's W op does nothing (`kernels.SplitKernel`, need_w all False).
`FrozenFp8Linear` (decoder-layer Linears) and `FrozenFp8Experts` (routed experts, [E, O, K] plus
[E, ceil(O/128), ceil(K/128)] scales) hold the bytes as non-persistent buffers (checkpoints hold adapters, not
the base) that `.to(dtype)` never converts; `freeze_fp8` converts a model's decoder layers (a high-precision weight
quantized once; a released FP8 weight is loaded as it is: `checkpoint.frozen_base`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import ConfigError, FP8Config
from dsv3_plugin.model.kernels import SplitKernel, UsesKernel, apply_split, expert_spans
from dsv3_plugin.model.moe.layer import DenseMLP, GroupedExperts
from dsv3_plugin.model.transformer import DecoderLayer
from dsv3_plugin.precision.fp8.experts import Fp8SwiGLUAct
from dsv3_plugin.precision.fp8.linear import AutoBackend, EmulatedBackend, Fp8Recipe, Fp8Report
from dsv3_plugin.precision.fp8.quant import (
    FP8_DTYPE,
    TILE,
    fp8_combine_grad_qdq,
    fp8_dispatch_qdq,
    fp8_grouped_gemm_emulated,
    quantize_blockwise,
    widen_fp8,
)

__all__ = [
    "SCALE_SUFFIX",
    "EXPERT_WEIGHTS",
    "FrozenFp8Gemm",
    "FrozenFp8LinearKernel",
    "FrozenFp8Linear",
    "FrozenFp8ExpertKernel",
    "FrozenFp8Experts",
    "freeze_fp8",
    "scale_grid",
    "expert_scales",
]

SCALE_SUFFIX = "_scale_inv"
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # w1 [E, I, H], w3 [E, I, H], w2 [E, H, I]


def scale_grid(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the 128×128 block scales of a [rows, cols] weight."""
    return math.ceil(rows / TILE), math.ceil(cols / TILE)


class FrozenFp8Gemm:
    """The two GEMMs of a frozen FP8 weight (q E4M3 [O, K], s fp32 [ceil(O/128), ceil(K/128)]), FP32 out.
    Activations are quantized 1×128 (power-of-2 scales with `recipe.pow2`); the weight is used as stored.
    NOTE: a backend that needs a contiguous Wᵀ (torch `_scaled_mm`) makes a temporary copy of one matrix."""

    def __init__(self, recipe: Fp8Recipe, backend):
        if recipe.kind != "blockwise":
            raise ConfigError(
                "dsv3.fp8.recipe: a frozen FP8 base is stored in 128x128 blocks and needs the 'blockwise' recipe "
                f"(got {recipe.kind!r})"
            )
        self.recipe, self.backend = recipe, backend

    def resolved(self, device: torch.device):
        return self.backend.resolve(device) if isinstance(self.backend, AutoBackend) else self.backend

    def quant(self, x_MK: torch.Tensor) -> tuple:
        """x's 1×128 tiles (q, s, kind), for GEMMs over row slices of x (`rows`): tiles lie within a row, so a
        slice of them is, byte for byte, the quantization of that slice. For the emulation q comes widened to FP32
        (`widen_fp8`, the same values), so that it is converted once, not once per slice."""
        q, s, kind = self.recipe.act(x_MK)
        if type(self.resolved(x_MK.device)) is EmulatedBackend:
            q = widen_fp8(q)
        return q, s, kind

    @staticmethod
    def rows(xq: tuple, a: int, b: int) -> tuple:
        """Rows a:b of a `quant` result."""
        return xq[0][a:b], xq[1][a:b], xq[2]

    def fwd_q(self, xq: tuple, q_OK: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x · Wᵀ: [M, O] fp32, x given as `quant(x)` (or `rows` of one)."""
        return self.resolved(xq[0].device).gemm(*xq, q_OK, s, "block")

    def dgrad_q(self, dyq: tuple, q_OK: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """dy · W: [M, K] fp32, dy given as `quant(dy)` (or `rows` of one)."""
        return self.resolved(dyq[0].device).gemm(*dyq, q_OK.t(), s.t(), "block")

    def grouped(self, xq: tuple, spans, q_EOK: torch.Tensor, s_E: torch.Tensor, dgrad: bool = False) -> torch.Tensor:
        """Per expert e over its rows (`spans`, covering every row): x · W_eᵀ, or with `dgrad` dy · W_e; [N, ·]
        fp32, x / dy given as `quant` of all rows. The emulation runs `fp8_grouped_gemm_emulated` (the same bits
        as one GEMM per expert); other backends one GEMM per expert."""
        if type(self.resolved(xq[0].device)) is EmulatedBackend:
            return fp8_grouped_gemm_emulated(xq[0], xq[1], spans, q_EOK, s_E, transpose=dgrad)
        gemm = self.dgrad_q if dgrad else self.fwd_q
        out = xq[0].new_zeros(xq[0].shape[0], q_EOK.shape[2 if dgrad else 1], dtype=torch.float32)
        for e, a, b in spans:
            out[a:b] = gemm(self.rows(xq, a, b), q_EOK[e], s_E[e])
        return out

    def fwd(self, x_MK: torch.Tensor, q_OK: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x · Wᵀ: [M, O] fp32."""
        return self.fwd_q(self.quant(x_MK), q_OK, s)

    def dgrad(self, dy_MO: torch.Tensor, q_OK: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """dy · W: [M, K] fp32."""
        return self.dgrad_q(self.quant(dy_MO), q_OK, s)

    @property
    def name(self) -> str:
        return getattr(self.backend, "name", type(self.backend).__name__)


def _refuse_grads(need_w, what: str) -> None:
    if any(need_w):
        raise RuntimeError(f"{what}: a frozen FP8 weight cannot take a gradient (its buffers require none)")


class FrozenFp8LinearKernel(SplitKernel):
    """`kernels.LinearKernel` over a frozen FP8 weight: kernel(x, weight_q, bias=None, scale_inv) -> x · Wᵀ.
    Saves the stored weight by reference (no copy); input_grad runs Dgrad; weight_grads has nothing to do."""

    def __init__(self, gemm: FrozenFp8Gemm):
        self.gemm = gemm

    def call(self, via, x, weight, bias=None, scale_inv=None):
        if weight.dtype != FP8_DTYPE or scale_inv is None:
            raise TypeError(f"FrozenFp8LinearKernel: needs an E4M3 weight and its scale_inv (got {weight.dtype})")
        return apply_split(via, self.gemm, x, weight, scale_inv, bias)

    def forward(self, gemm, x, weights, need_w):
        _refuse_grads(need_w, "FrozenFp8LinearKernel")
        q, s, bias = weights
        y = gemm.fwd(x.reshape(-1, x.shape[-1]), q, s).to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y, (q, s), (x.shape, x.dtype)

    def input_grad(self, saved, meta, dy, need):
        q, s = saved
        x_shape, x_dtype = meta
        if not need[0]:
            return None, None
        return self.gemm.dgrad(dy.reshape(-1, dy.shape[-1]), q, s).to(x_dtype).reshape(x_shape), None

    def weight_grads(self, saved, meta, carry, need_w):
        _refuse_grads(need_w, "FrozenFp8LinearKernel")
        return (None,) * len(need_w)

    def __repr__(self) -> str:
        return f"FrozenFp8LinearKernel(pow2={self.gemm.recipe.pow2}, backend={self.gemm.name})"


def _keep_fp8_apply(module: nn.Module, names: tuple[str, ...], fn, recurse: bool, parent_apply) -> nn.Module:
    """`Module._apply` that moves the frozen buffers `names` between devices but never changes their dtype
    (`.bfloat16()` would otherwise turn E4M3 bytes into a high-precision copy)."""
    kept = {n: module._buffers.pop(n) for n in names if module._buffers.get(n) is not None}
    try:
        parent_apply(fn, recurse)
    finally:
        for n, t in kept.items():
            probe = fn(t.new_empty(0))  # where and as what `fn` would put it, without converting the data
            module._buffers[n] = fn(t) if probe.dtype == t.dtype else t.to(probe.device)
    return module


class FrozenFp8Linear(UsesKernel, nn.Module):
    """A Linear whose weight is a frozen FP8 buffer: state_dict `weight` (E4M3 [O, K]) and `weight_scale_inv`
    (fp32 blocks), no parameter (bias None). Its kernel is a `FrozenFp8LinearKernel` (wrappers allowed)."""

    def __init__(self, in_features: int, out_features: int, gemm: FrozenFp8Gemm, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # not persistent: a checkpoint of the run holds the adapters, not the base (`base_fingerprint` names it)
        self.register_buffer(
            "weight", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), persistent=False
        )
        s = torch.empty(scale_grid(out_features, in_features), dtype=torch.float32, device=device)
        self.register_buffer("weight_scale_inv", s, persistent=False)
        self.register_parameter("bias", None)
        self.kernel = FrozenFp8LinearKernel(gemm)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, lin: nn.Linear, gemm: FrozenFp8Gemm) -> FrozenFp8Linear:
        """`lin`'s weight quantized in 128×128 blocks as the FP8 training path quantizes a weight (`recipe.pow2`
        scales or not: the bytes `Fp8LinearKernel` would make each call); meta stays meta. A bias is refused."""
        if lin.bias is not None:
            raise ValueError("FrozenFp8Linear: a Linear with a bias cannot be frozen to FP8 (DeepSeek-V3 has none)")
        new = cls(lin.in_features, lin.out_features, gemm, device=lin.weight.device)
        if not lin.weight.is_meta:
            new.weight, new.weight_scale_inv = quantize_blockwise(lin.weight.detach(), TILE, gemm.recipe.pow2)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.weight, self.bias, self.weight_scale_inv)

    def _apply(self, fn, recurse=True):
        return _keep_fp8_apply(self, ("weight", "weight_scale_inv"), fn, recurse, super()._apply)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, frozen fp8, kernel={self.kernel!r}"


def expert_scales(owner: GroupedExperts, w1, w3, w2) -> tuple[torch.Tensor, ...]:
    """The scales of the weights `owner` passes its kernel; refuses weights that are not its buffers."""
    for n, w in zip(EXPERT_WEIGHTS, (w1, w3, w2)):
        if w is not getattr(owner, n):
            raise RuntimeError(
                f"FrozenFp8ExpertKernel: got a {tuple(w.shape)} weight that is not its experts' {n} buffer "
                "(frozen FP8 experts cannot be re-sliced or stacked: build them rank-locally)"
            )
    return tuple(getattr(owner, n + SCALE_SUFFIX) for n in EXPERT_WEIGHTS)


class FrozenFp8ExpertKernel(SplitKernel):
    """`kernels.ExpertKernel` of frozen FP8 experts: per expert e on its rows X,
    g = X W1ᵀ, u = X W3ᵀ, h = s ⊙ silu(g) ⊙ u, Y = h W2ᵀ (`FrozenFp8Gemm`), the scales read from `owner`
    (its `<name>_scale_inv` buffers). Saves g and u (forward dtype) and the weights by reference; I runs the
    three Dgrads and the routing weights' gradient; there is no W. `dispatch`: the FP8 all-to-all's numerics
    (`fp8.dispatch`, as `Fp8ExpertKernel`)."""

    row_scale = True

    def __init__(self, owner: GroupedExperts, gemm: FrozenFp8Gemm, dispatch: bool = False):
        self.owner, self.gemm, self.dispatch = owner, gemm, dispatch

    def call(self, via, x_NH, counts, w1_EIH, w3_EIH, w2_EHI, scale_N=None):
        if sum(counts) != x_NH.shape[0]:
            raise ValueError(f"FrozenFp8ExpertKernel: counts sum to {sum(counts)} but there are {x_NH.shape[0]} rows")
        scales = expert_scales(self.owner, w1_EIH, w3_EIH, w2_EHI)
        if self.dispatch:
            x_NH = fp8_dispatch_qdq(x_NH)
        y = apply_split(via, (list(counts), scales), x_NH, w1_EIH, w3_EIH, w2_EHI, scale=scale_N)
        return fp8_combine_grad_qdq(y) if self.dispatch else y

    def forward(self, static, x_NH, weights, need_w):
        _refuse_grads(need_w, "FrozenFp8ExpertKernel")
        counts, (s1, s3, s2) = static
        x_NH, s_N = x_NH if isinstance(x_NH, tuple) else (x_NH, None)
        w1, w3, w2 = weights
        dt, gemm = x_NH.dtype, self.gemm
        spans = expert_spans(counts)
        xq = gemm.quant(x_NH)  # once for all experts' rows, W1's and W3's
        g_NI = gemm.grouped(xq, spans, w1, s1).to(dt)
        u_NI = gemm.grouped(xq, spans, w3, s3).to(dt)
        h_NI = F.silu(g_NI) * u_NI
        if s_N is not None:
            h_NI = h_NI * s_N[:, None].to(dt)  # the routing weight, before W2
        y_NH = gemm.grouped(gemm.quant(h_NI), spans, w2, s2).to(dt)
        return y_NH, (g_NI, u_NI, s_N, w1, w3, w2), (spans, (s1, s3, s2), dt)

    def input_grad(self, saved, meta, dy_NH, need):
        g_NI, u_NI, s_N, w1, w3, w2 = saved
        spans, (s1, s3, s2), dt = meta
        need_x, need_s = need[0] if s_N is not None else (need[0], False)
        gemm = self.gemm
        dh_NI = gemm.grouped(gemm.quant(dy_NH), spans, w2, s2, dgrad=True)  # dL/d(s·h)
        g, u = g_NI.float(), u_NI.float()
        sig = torch.sigmoid(g)
        silu = g * sig
        ds_N = (dh_NI * silu * u).sum(-1).to(s_N.dtype) if need_s else None  # dL/ds = <dy·W2, h>
        if s_N is not None:
            dh_NI = dh_NI * s_N[:, None].float()
        dx_NH = None
        if need_x:
            dg = dh_NI * u * (sig * (1 + g * (1 - sig)))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
            du = dh_NI * silu
            dx_NH = gemm.grouped(gemm.quant(dg), spans, w1, s1, dgrad=True)
            dx_NH = dx_NH.add_(gemm.grouped(gemm.quant(du), spans, w3, s3, dgrad=True)).to(dt)
        return (dx_NH if s_N is None else (dx_NH, ds_N)), None

    def weight_grads(self, saved, meta, carry, need_w):
        _refuse_grads(need_w, "FrozenFp8ExpertKernel")
        return (None,) * len(need_w)

    def __repr__(self) -> str:
        return (
            f"FrozenFp8ExpertKernel(pow2={self.gemm.recipe.pow2}, backend={self.gemm.name}, dispatch={self.dispatch})"
        )


class FrozenFp8Experts(GroupedExperts):
    """`GroupedExperts` whose gate_proj / up_proj / down_proj are frozen FP8 buffers ([E, I, H] / [E, H, I]
    E4M3) with `<name>_scale_inv` ([E, ceil(O/128), ceil(K/128)] fp32). Made by `freeze` (class swap: the
    routing and the kernel seam are GroupedExperts')."""

    def _apply(self, fn, recurse=True):
        names = EXPERT_WEIGHTS + tuple(n + SCALE_SUFFIX for n in EXPERT_WEIGHTS)
        return _keep_fp8_apply(self, names, fn, recurse, super()._apply)

    @classmethod
    @torch.no_grad()
    def freeze(cls, mod: GroupedExperts, gemm: FrozenFp8Gemm, dispatch: bool = False) -> FrozenFp8Experts:
        """`mod` in place: each expert's weights quantized in 128×128 blocks (`recipe.pow2` as `from_linear`)."""
        for n in EXPERT_WEIGHTS:
            w = getattr(mod, n)
            E, O, K = w.shape
            q = torch.empty(E, O, K, dtype=FP8_DTYPE, device=w.device)
            s = torch.empty(E, *scale_grid(O, K), dtype=torch.float32, device=w.device)
            if not w.is_meta:
                for e in range(E):
                    q[e], s[e] = quantize_blockwise(w[e].detach(), TILE, gemm.recipe.pow2)
            del mod._parameters[n]
            mod.register_buffer(n, q, persistent=False)  # as FrozenFp8Linear's: not in checkpoints
            mod.register_buffer(n + SCALE_SUFFIX, s, persistent=False)
        mod.__class__ = cls
        mod.kernel = FrozenFp8ExpertKernel(mod, gemm, dispatch)
        return mod


def freeze_fp8(
    model: nn.Module, cfg: FP8Config, device: torch.device | str | None = None, layer_types=(DecoderLayer,)
) -> Fp8Report:
    """Put the decoder layers' Linear GEMMs and routed experts on frozen FP8 storage, in place (modules already
    frozen are kept; parameters elsewhere are untouched). Dense / shared-expert SwiGLUs cache their inputs in FP8
    (`Fp8SwiGLUAct`), as `convert_to_fp8` does.

    Returns:
        The `Fp8Report` (also `model.fp8_report`): `converted` the `FrozenFp8Linear`s, `grouped` the frozen
        experts, `high_precision` the GEMM modules outside the decoder layers, and the backend running the GEMMs.
    """
    recipe = Fp8Recipe.from_config(cfg)
    rep = Fp8Report(backend="auto", reason="", recipe=recipe.kind, pow2_scales=recipe.pow2, dispatch=cfg.dispatch)
    if device is None:
        p = next((t for t in model.parameters() if not t.is_meta), None)
        device = p.device if p is not None else torch.device("cpu")
    backend = AutoBackend(cfg, rep)
    backend.resolve(torch.device(device))
    gemm = FrozenFp8Gemm(recipe, backend)
    prefixes = [n for n, m in model.named_modules() if isinstance(m, layer_types)]
    for name, mod in list(model.named_modules()):
        if not any(name.startswith(p + ".") for p in prefixes):
            if isinstance(mod, (nn.Linear, nn.Embedding)) or name.endswith(".gate"):
                rep.high_precision.append(name)  # embedding, lm_head, MTP eh_proj, routers
            continue
        if isinstance(mod, FrozenFp8Linear):
            rep.converted.append(name)
        elif isinstance(mod, nn.Linear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, FrozenFp8Linear.from_linear(mod, gemm))
            rep.converted.append(name)
        elif isinstance(mod, FrozenFp8Experts):
            rep.grouped.append(name)
        elif isinstance(mod, GroupedExperts):
            FrozenFp8Experts.freeze(mod, gemm, cfg.dispatch)
            rep.grouped.append(name)
        elif isinstance(mod, DenseMLP):
            mod.act = Fp8SwiGLUAct(recipe)
        elif name.endswith(".gate"):
            rep.high_precision.append(name)
    model.fp8_report = rep
    return rep
