"""FP8 Linear layers for training (DeepSeek-V3 report §3.3, Fig. 6): Fprop, Dgrad and Wgrad all in FP8.

Tile orientation per GEMM (Y = X Wᵀ, X [M, K] tokens × in, W [N, K] out × in):

    Fprop  Y  = X · Wᵀ      X 1×128 tiles along K,      W 128×128 blocks        (contract K)
    Dgrad  dX = dY · W      dY 1×128 tiles along N,     W 128×128 blocks        (contract N)
    Wgrad  dW = dYᵀ · X     dYᵀ 1×128 tiles along M,    Xᵀ 1×128 tiles along M  (contract M)

so activations and activation gradients are always 1×128 in the direction being contracted (128×1 in their
stored layout for Wgrad) — never 128×128 for gradients (App. B.2 saw divergence). As TE does, both
orientations of X are quantized from the high-precision tensor; only the FP8 copy for Wgrad (1 byte per
element + scales) is kept for backward, which is the report's "activations cached in FP8".
Master weights, their gradients and the outputs stay in the input's precision (FP32 or BF16).

Backends (`select_backend`, reported in `Fp8Report`):
  * `te`: Transformer Engine `Float8BlockScaling` (TE >= 2.3, SM90, CUDA >= 12.9) — `to_te_recipe`;
  * `torch`: `torch._scaled_mm` with 1×128 / 128×128 scales (cuBLAS, SM90, CUDA >= 12.9), probed against the
    emulation before it is used;
  * `emulate`: `fp8.fp8_gemm_emulated`, exact FP8 quantization and per-128 FP32 promotion on any device.
  * `hopper-emulated`: `fp8_hopper.HopperEmulatedBackend`, Hopper's limited-precision tensor-core accumulation
    (mmaemu) with FP32 promotion every `fp8.promote_every` elements, on any device (a numerics model: slow).

`convert_to_fp8(model, cfg.fp8)` swaps the decoder layers' nn.Linear GEMMs for `Fp8Linear` and installs the
FP8 grouped-expert path; embedding, output head, router (`gate`), norms, MTP's eh_proj and the attention
core stay in high precision (§3.3.1).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConfigError, FP8Config
from .fp8 import (FP8_DTYPE, TILE, fp8_combine_grad_qdq, fp8_dispatch_qdq, fp8_gemm_emulated,
                  quantize_blockwise, quantize_tensorwise, quantize_tilewise)

__all__ = ["Fp8Recipe", "EmulatedBackend", "TorchScaledMMBackend", "TEBackend", "AutoBackend", "select_backend",
           "torch_blockwise_available",
           "fp8_linear", "Fp8Linear", "Fp8GroupedSwiGLU", "te_recipe_spec", "to_te_recipe", "Fp8Report",
           "convert_to_fp8"]


@dataclass(frozen=True)
class Fp8Recipe:
    """`blockwise` = DeepSeek-V3 (1×128 activations/gradients, 128×128 weights); `tensorwise` = one online
    scale per tensor (the comparison baseline)."""

    kind: str = "blockwise"
    pow2: bool = False

    @classmethod
    def from_config(cls, cfg: FP8Config) -> "Fp8Recipe":
        return cls(kind=cfg.recipe, pow2=cfg.pow2_scales)

    def act(self, x2: torch.Tensor):
        """Quantize a 2-D operand along its last (contraction) dim -> (q, s, kind)."""
        if self.kind == "blockwise":
            return (*quantize_tilewise(x2, TILE, self.pow2), "tile")
        return (*quantize_tensorwise(x2, self.pow2), "tensor")

    def weight(self, w: torch.Tensor):
        if self.kind == "blockwise":
            return (*quantize_blockwise(w, TILE, self.pow2), "block")
        return (*quantize_tensorwise(w, self.pow2), "tensor")


# --------------------------------------------------------------------------------------------------
# GEMM backends: out[M, N] (fp32) = A[M, K] · B[N, K]ᵀ with A, B given as (fp8, scale, kind)

class EmulatedBackend:
    name = "emulate"

    def gemm(self, a_q, a_s, a_kind, b_q, b_s, b_kind):
        return fp8_gemm_emulated(a_q, a_s, b_q, b_s, a_kind, b_kind)


def _pad2(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    if t.dtype == FP8_DTYPE:  # F.pad has no float8 kernel; zero bytes are +0.0 in E4M3
        out = torch.zeros(rows, cols, dtype=torch.uint8, device=t.device)
        out[:t.shape[0], :t.shape[1]] = t.view(torch.uint8)
        return out.view(FP8_DTYPE)
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]), value=value)


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


class TorchScaledMMBackend:
    """cuBLAS blockwise FP8 via `torch._scaled_mm` (scale shapes: A 1×128 [M, K/128] outer-dim-major;
    B 128×128 [K/128, N/128]; B 1×128 [K/128, N]). Operands are zero-padded to K % 512 == 0 and M, N % 16 == 0
    (cuBLAS wants 4-aligned block-scale columns); padded scales are 1."""

    name = "torch"

    def gemm(self, a_q, a_s, a_kind, b_q, b_s, b_kind):
        M, K = a_q.shape
        N = b_q.shape[0]
        Mp, Np = _up(M, 16), _up(N, 16)
        Kp = _up(K, 4 * TILE) if a_kind == "tile" else _up(K, 16)
        A = _pad2(a_q.contiguous(), Mp, Kp)
        B = _pad2(b_q.contiguous(), Np, Kp)
        if a_kind == "tensor":
            sa, sb = a_s.reshape(()).float(), b_s.reshape(()).float()
        else:
            Kc = Kp // TILE
            sa = _pad2(a_s.float(), Mp, Kc, 1.0).t().contiguous().t()             # [Mp, Kc], stride (1, Mp)
            if b_kind == "block":
                sb = _pad2(b_s.float(), _up(Np, TILE) // TILE, Kc, 1.0).contiguous().t()  # [Kc, Nc]
            else:
                sb = _pad2(b_s.float(), Np, Kc, 1.0).t().contiguous()              # [Kc, Np]
        out = torch._scaled_mm(A, B.t(), scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=False)
        return out[:M, :N]


class TEBackend:
    """Transformer Engine: a `te.pytorch.Linear` per module that *borrows* our FP32 master weight, run under
    `fp8_autocast(recipe=to_te_recipe(cfg))`. Shapes TE cannot run in FP8 (dims not multiples of 16) and the
    grouped experts use `fallback` (the torch or emulated GEMM)."""

    name = "te"

    def __init__(self, cfg: FP8Config, fallback):
        self.recipe = to_te_recipe(cfg)
        self.fallback = fallback

    def gemm(self, *args):
        return self.fallback.gemm(*args)

    def linear(self, mod: "Fp8Linear", x: torch.Tensor) -> Optional[torch.Tensor]:
        import transformer_engine.pytorch as te
        M = x.numel() // x.shape[-1]
        if M % 16 or mod.in_features % 16 or mod.out_features % 16:
            return None
        if getattr(mod, "_te", None) is None:
            lin = te.Linear(mod.in_features, mod.out_features, bias=False, params_dtype=mod.weight.dtype,
                            device=mod.weight.device)
            lin.weight = mod.weight  # share the master weight: one parameter, one gradient
            object.__setattr__(mod, "_te", lin)  # not a submodule: state_dict keys stay `weight`
        if hasattr(te, "autocast"):          # TE >= 2.8 name
            ctx = te.autocast(enabled=True, recipe=self.recipe)
        else:
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)
        with ctx:
            return mod._te(x)


def torch_blockwise_available(device: torch.device) -> tuple[bool, str]:
    """(usable, why) for `TorchScaledMMBackend` on `device`: SM90 and a passing probe against the emulation."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return False, f"cuBLAS blockwise FP8 needs SM90 (got sm{cap[0]}{cap[1]})"
    try:  # probe against the emulation on a ragged problem (all three GEMM kinds)
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(40, 200, generator=g).to(device)
        w = torch.randn(136, 200, generator=g).to(device)
        dy = torch.randn(40, 136, generator=g).to(device)
        r, emu, ours = Fp8Recipe(), EmulatedBackend(), TorchScaledMMBackend()
        for a, b in ((r.act(x), r.weight(w)), (r.act(dy), (lambda q, s, k: (q.t(), s.t(), k))(*r.weight(w))),
                     (r.act(dy.t()), r.act(x.t()))):
            ref = emu.gemm(*a, *b)
            got = ours.gemm(*a, *b)
            err = ((got - ref).norm() / ref.norm()).item()
            if not err < 1e-3:
                return False, f"torch._scaled_mm blockwise probe disagrees with the emulation (rel. err {err:.2e})"
    except Exception as e:  # noqa: BLE001 — an unsupported build raises various errors; report, do not crash
        return False, f"torch._scaled_mm blockwise unavailable ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return True, "torch._scaled_mm blockwise (cuBLAS) on SM90"


def _te_ok(device: torch.device, cfg: FP8Config) -> tuple[bool, str]:
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001
        return False, "transformer_engine not importable"
    ver = getattr(transformer_engine, "__version__", "0")
    try:
        major, minor = (int(p) for p in ver.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if cfg.recipe == "blockwise" and (major, minor) < (2, 3):
        return False, f"Float8BlockScaling needs TE >= 2.3 (found {ver})"
    if device.type != "cuda":
        return False, "TE needs a CUDA device"
    if cfg.recipe == "blockwise":
        try:
            from transformer_engine.pytorch.fp8 import check_fp8_block_scaling_support
            ok, why = check_fp8_block_scaling_support()
        except ImportError:
            cap = torch.cuda.get_device_capability(device)
            ok, why = cap[0] == 9, f"sm{cap[0]}{cap[1]}"
        if not ok:
            return False, f"TE Float8BlockScaling unsupported here: {why}"
    return True, f"Transformer Engine {ver}"


def select_backend(cfg: FP8Config, device: torch.device | str = "cpu"):
    """-> (backend, reason). `auto`: TE, else torch blockwise scaled_mm, else emulation. An explicitly
    requested backend that cannot run is a ConfigError naming `dsv3.fp8.backend`."""
    device = torch.device(device)
    if cfg.backend == "emulate":
        return EmulatedBackend(), "requested (dsv3.fp8.backend = emulate)"
    if cfg.backend == "hopper-emulated":   # never chosen by `auto`: a numerics model, not a speed path
        from .fp8_hopper import HopperEmulatedBackend, mmaemu_status
        ok, why = mmaemu_status()
        if not ok:
            raise ConfigError(f"dsv3.fp8.backend: 'hopper-emulated' cannot run here: {why}")
        return (HopperEmulatedBackend(cfg.promote_every),
                f"requested (dsv3.fp8.backend = hopper-emulated, promote_every = {cfg.promote_every}; {why})")
    reasons = []
    if cfg.backend in ("auto", "te"):
        ok, why = _te_ok(device, cfg)
        if ok:
            fb_ok, _ = torch_blockwise_available(device)
            return TEBackend(cfg, TorchScaledMMBackend() if fb_ok else EmulatedBackend()), why
        if cfg.backend == "te":
            raise ConfigError(f"dsv3.fp8.backend: 'te' cannot run here: {why}")
        reasons.append(f"te: {why}")
    ok, why = torch_blockwise_available(device)
    if ok:
        return TorchScaledMMBackend(), why
    if cfg.backend == "torch":
        raise ConfigError(f"dsv3.fp8.backend: 'torch' cannot run here: {why}")
    reasons.append(f"torch: {why}")
    return EmulatedBackend(), "emulation (" + "; ".join(reasons) + ")"


class AutoBackend:
    """`select_backend` resolved from the operands' device at the first GEMM (and again if it changes):
    models are usually built on CPU and moved to their GPU afterwards. Updates `report` when it resolves."""

    def __init__(self, cfg: FP8Config, report: "Optional[Fp8Report]" = None):
        self.cfg, self.report = cfg, report
        self.impl, self.device = None, None

    @property
    def name(self) -> str:
        return self.impl.name if self.impl is not None else "auto"

    def resolve(self, device: torch.device):
        if self.impl is None or self.device != device:
            self.impl, why = select_backend(self.cfg, device)
            self.device = device
            if self.report is not None:
                self.report.backend, self.report.reason = self.impl.name, why
        return self.impl

    def gemm(self, a_q, *args):
        return self.resolve(a_q.device).gemm(a_q, *args)


# --------------------------------------------------------------------------------------------------
# The autograd function

class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, backend, need_wgrad: bool = True):
        K, N = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, K)                                            # [M, K]
        qx, sx, kx = recipe.act(x2)                                      # 1×128 along K
        qw, sw, kw = recipe.weight(weight)                               # 128×128
        y = backend.gemm(qx, sx, kx, qw, sw, kw)                         # Fprop [M, N] fp32
        xt = recipe.act(x2.t()) if need_wgrad else (None, None, None)   # Xᵀ 1×128 along M: the FP8 cache
        ctx.save_for_backward(xt[0], xt[1], qw, sw)
        ctx.meta = (recipe, backend, xt[2], kw, x.shape, x.dtype, weight.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy):
        qxt, sxt, qw, sw = ctx.saved_tensors
        recipe, backend, kxt, kw, x_shape, x_dtype, w_dtype = ctx.meta
        N = dy.shape[-1]
        dy2 = dy.reshape(-1, N)                                          # [M, N]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qg, sg, kg = recipe.act(dy2)                                 # 1×128 along N
            sw_t = sw.t() if kw == "block" else sw                       # blocks of Wᵀ [K, N]
            dx = backend.gemm(qg, sg, kg, qw.t(), sw_t, kw).to(x_dtype).reshape(x_shape)   # Dgrad
        if ctx.needs_input_grad[1] and qxt is not None:
            qgt, sgt, kgt = recipe.act(dy2.t())                          # dYᵀ [N, M] 1×128 along M
            dw = backend.gemm(qgt, sgt, kgt, qxt, sxt, kxt).to(w_dtype)  # Wgrad [N, K]
        return dx, dw, None, None, None


def _wgrad_needed(weight: torch.Tensor) -> bool:
    # decided outside the Function (grad mode is off inside its forward): no FP8 cache in eval / no_grad
    return torch.is_grad_enabled() and weight.requires_grad


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe = Fp8Recipe(), backend=None):
    """y = x · weightᵀ with all three GEMMs in FP8 (weight [N, K], x [..., K])."""
    return _Fp8LinearFn.apply(x, weight, recipe, backend or EmulatedBackend(), _wgrad_needed(weight))


class Fp8Linear(nn.Linear):
    """Drop-in nn.Linear (same `weight`/`bias` names and parameters) whose GEMMs run in FP8."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: Fp8Recipe = Fp8Recipe(),
                 backend=None, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.backend = backend or EmulatedBackend()

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: Fp8Recipe, backend) -> "Fp8Linear":
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, recipe, backend, device="meta")
        new.weight = lin.weight  # the same Parameter object: optimizer state and checkpoints keep working
        new.bias = lin.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        be = self.backend.resolve(x.device) if isinstance(self.backend, AutoBackend) else self.backend
        y = be.linear(self, x) if isinstance(be, TEBackend) else None
        if y is None:
            y = _Fp8LinearFn.apply(x, self.weight, self.recipe, be, _wgrad_needed(self.weight))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8={self.recipe.kind}, pow2={self.recipe.pow2}, "
                f"backend={self.backend.name}")


class Fp8GroupedSwiGLU:
    """FP8 replacement for `moe.grouped_swiglu` (installed as `GroupedExperts.swiglu_fn`): each expert's SwiGLU
    runs as `fp8_experts.fp8_expert_swiglu` on its slice of the stacked [E, I, H] / [E, H, I] master weights
    (all GEMMs in FP8; SwiGLU inputs cached in FP8 and the output recomputed in backward).
    With `dispatch` (config `fp8.dispatch`) the expert inputs carry the FP8 all-to-all's numerics (pow2 1×128
    quantize-dequantize) and the gradients of the expert outputs are quantized the same way in backward;
    the forward combine and the backward of the dispatch stay high precision (report §3.3.4). A real EP
    all-to-all (`pack_dispatch`) applied on top changes nothing: pow2 re-quantization is exact."""

    def __init__(self, recipe: Fp8Recipe, backend, dispatch: bool = False):
        self.recipe, self.backend, self.dispatch = recipe, backend, dispatch

    def __call__(self, x_NH, counts, w1_EIH, w3_EIH, w2_EHI):
        if self.dispatch:
            return fp8_combine_grad_qdq(self._experts(fp8_dispatch_qdq(x_NH), counts, w1_EIH, w3_EIH, w2_EHI))
        return self._experts(x_NH, counts, w1_EIH, w3_EIH, w2_EHI)

    def _experts(self, x_NH, counts, w1_EIH, w3_EIH, w2_EHI):
        from .fp8_experts import fp8_expert_swiglu   # FP8-cached SwiGLU inputs, output recomputed (§3.3.3)
        outs = []
        for e, x_e in enumerate(torch.split(x_NH, counts)):
            if counts[e] == 0:
                continue
            outs.append(fp8_expert_swiglu(x_e, w1_EIH[e], w3_EIH[e], w2_EHI[e], self.recipe, self.backend))
        if not outs:
            return x_NH.new_zeros(0, w2_EHI.shape[1])
        return torch.cat(outs)


# --------------------------------------------------------------------------------------------------
# Transformer Engine recipe bridge

def te_recipe_spec(cfg: FP8Config) -> tuple[str, dict]:
    """Our config in TE's words: (recipe class name, {attribute: value}). QParams are given as dicts.

    These are the values the TE recipe object must hold, whether TE takes them as constructor fields or not
    (`to_te_recipe` sets and checks them). `use_power_2_scales` (tensorwise) is set only where TE has it."""
    from .fp8 import AMAX_EPS
    q = {"power_2_scale": cfg.pow2_scales, "amax_epsilon": AMAX_EPS}
    fields = {"fp8_format": "E4M3", "fp8_quant_fwd_inp": dict(q), "fp8_quant_fwd_weight": dict(q),
              "fp8_quant_bwd_grad": dict(q)}
    if cfg.recipe == "blockwise":
        # x 1×128, w 128×128, grad 1×128 (App. B.2); split (FP32) accumulation is TE's fixed default here.
        fields.update(x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1)
        return "Float8BlockScaling", fields
    # recent TE (e.g. 2.20) builds current-scaling quantizers from this flag, then applies fp8_quant_* per tensor
    fields["use_power_2_scales"] = cfg.pow2_scales
    return "Float8CurrentScaling", fields


_TE_OPTIONAL = {"use_power_2_scales"}   # absent from some TE versions: nothing there reads it


def _te_view(got, want):
    """What `got` holds of `want` (QParams: only the fields we set, not TE's other defaults)."""
    if isinstance(want, dict):
        return {k: getattr(got, k, "<missing>") for k in want}
    return got


def to_te_recipe(cfg: FP8Config):
    """Build the TE recipe object (needs transformer_engine >= 2.3 for blockwise) holding every value of
    `te_recipe_spec`, and check that it does.

    NOTE: TE declares `fp8_quant_fwd_inp` / `fp8_quant_fwd_weight` / `fp8_quant_bwd_grad` as un-annotated
    class attributes of a pydantic dataclass, so they are not constructor fields: a keyword argument is
    silently dropped. Constructor fields go to the constructor (its `__post_init__` validates them); every
    other value is assigned on the instance, which is where TE's quantizers read them. Each value is read
    back, and a TE that drops or rewrites one is a RuntimeError naming the attribute.
    """
    try:
        import transformer_engine
        from transformer_engine.common import recipe as te_recipe
    except ImportError as e:
        raise RuntimeError("to_te_recipe: transformer_engine is not installed") from e
    ver = getattr(transformer_engine, "__version__", "?")
    name, spec = te_recipe_spec(cfg)
    cls = getattr(te_recipe, name, None)
    if cls is None:
        raise RuntimeError(f"to_te_recipe: transformer_engine {ver} has no {name} (blockwise needs TE >= 2.3)")
    want = dict(spec)
    want["fp8_format"] = getattr(te_recipe.Format, spec["fp8_format"])
    for k in _TE_OPTIONAL & set(want):
        if not hasattr(cls, k):
            del want[k]
    init_fields = {f.name for f in dataclasses.fields(cls) if f.init}
    build = {k: (te_recipe.QParams(**v) if isinstance(v, dict) else v) for k, v in want.items()}
    recipe = cls(**{k: v for k, v in build.items() if k in init_fields})
    for k, v in build.items():
        if k not in init_fields:
            if not hasattr(cls, k):
                raise RuntimeError(f"to_te_recipe: transformer_engine {ver} {name} has no attribute {k!r}; "
                                   f"cannot apply it (supported: TE >= 2.3)")
            setattr(recipe, k, v)
    for k, v in want.items():
        got = _te_view(getattr(recipe, k, "<missing>"), v)
        if got != v:
            raise RuntimeError(f"to_te_recipe: transformer_engine {ver} {name}.{k} is {got!r} after setting "
                               f"{v!r}; TE would not run the requested dsv3.fp8 settings")
    return recipe


# --------------------------------------------------------------------------------------------------
# Model conversion

@dataclass
class Fp8Report:
    backend: str
    reason: str
    recipe: str
    pow2_scales: bool
    dispatch: bool = False
    converted: list[str] = field(default_factory=list)       # nn.Linear -> Fp8Linear
    grouped: list[str] = field(default_factory=list)         # GroupedExperts on the FP8 path
    high_precision: list[str] = field(default_factory=list)  # GEMM-bearing modules deliberately kept

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def convert_to_fp8(model: nn.Module, cfg: FP8Config, device: torch.device | str | None = None) -> Fp8Report:
    """Swap the decoder layers' Linear GEMMs (MLA projections, dense/shared-expert MLPs) for `Fp8Linear`
    and put the routed experts on the FP8 path, in place. Returns (and stores as `model.fp8_report`) what
    was converted, what was kept in high precision and which backend runs the GEMMs."""
    from .model import DecoderLayer
    from .moe import GroupedExperts

    recipe = Fp8Recipe.from_config(cfg)
    rep = Fp8Report(backend="auto", reason="", recipe=recipe.kind, pow2_scales=recipe.pow2, dispatch=cfg.dispatch)
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    backend = AutoBackend(cfg, rep)   # one shared instance: re-resolves if the model moves to another device
    backend.resolve(torch.device(device))
    layer_prefixes = [n for n, m in model.named_modules() if isinstance(m, DecoderLayer)]
    for name, mod in list(model.named_modules()):
        inside = any(name == p or name.startswith(p + ".") for p in layer_prefixes)
        if type(mod) is nn.Linear:
            if not inside:
                rep.high_precision.append(name)   # lm_head, MTP eh_proj
                continue
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, Fp8Linear.from_linear(mod, recipe, backend))
            rep.converted.append(name)
        elif isinstance(mod, GroupedExperts) and inside:
            mod.swiglu_fn = Fp8GroupedSwiGLU(recipe, backend, dispatch=cfg.dispatch)
            rep.grouped.append(name)
        elif isinstance(mod, nn.Embedding) or name.endswith(".gate"):
            rep.high_precision.append(name)
    model.fp8_report = rep
    return rep
