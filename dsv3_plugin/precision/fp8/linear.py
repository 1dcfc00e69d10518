"""FP8 Linear layers for training (DeepSeek-V3 report §3.3, Fig. 6): Fprop, Dgrad and Wgrad all in FP8.

    Fprop  Y  = X · Wᵀ      X 1×128 tiles along K,      W 128×128 blocks        (contract K)
    Dgrad  dX = dY · W      dY 1×128 tiles along N,     W 128×128 blocks        (contract N)
    Wgrad  dW = dYᵀ · X     dYᵀ 1×128 tiles along M,    Xᵀ 1×128 tiles along M  (contract M)

`fp8_linear`, `Fp8Linear`, `Fp8LinearKernel`; GEMM backends `te`, `torch`, `emulate`, `hopper-emulated`
(`select_backend`, reported in `Fp8Report`); `to_te_recipe` / `te_recipe_spec` for Transformer Engine. Only the
FP8 copy of X for Wgrad is kept for backward; master weights, their gradients and the outputs stay in the input's
precision.

Design notes (tile orientation, backends, what is converted): docs/design_notes.md#precision-fp8-linear
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv3_plugin.config import ConfigError, FP8Config
from dsv3_plugin.model.kernels import KernelLinear, SplitKernel, apply_split, base_kernel
from dsv3_plugin.precision.fp8.hopper import HopperEmulatedBackend, mmaemu_status
from dsv3_plugin.precision.fp8.quant import (
    AMAX_EPS,
    FP8_DTYPE,
    TILE,
    fp8_gemm_emulated,
    quantize_blockwise,
    quantize_tensorwise,
    quantize_tilewise,
)

__all__ = [
    "Fp8Recipe",
    "EmulatedBackend",
    "TorchScaledMMBackend",
    "TEBackend",
    "AutoBackend",
    "select_backend",
    "torch_blockwise_available",
    "fp8_linear",
    "Fp8Linear",
    "Fp8LinearKernel",
    "te_recipe_spec",
    "to_te_recipe",
    "Fp8Report",
]


@dataclass(frozen=True)
class Fp8Recipe:
    """`blockwise` = DeepSeek-V3 (1×128 activations/gradients, 128×128 weights); `tensorwise` = one online
    scale per tensor (the comparison baseline)."""

    kind: str = "blockwise"
    pow2: bool = False

    @classmethod
    def from_config(cls, cfg: FP8Config) -> Fp8Recipe:
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
        out[: t.shape[0], : t.shape[1]] = t.view(torch.uint8)
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
            sa = _pad2(a_s.float(), Mp, Kc, 1.0).t().contiguous().t()  # [Mp, Kc], stride (1, Mp)
            if b_kind == "block":
                sb = _pad2(b_s.float(), _up(Np, TILE) // TILE, Kc, 1.0).contiguous().t()  # [Kc, Nc]
            else:
                sb = _pad2(b_s.float(), Np, Kc, 1.0).t().contiguous()  # [Kc, Np]
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

    def linear(self, owner, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """y = x · weightᵀ by a `te.pytorch.Linear` cached on `owner` (the calling kernel), or None when TE
        cannot run the shape."""
        import transformer_engine.pytorch as te

        M = x.numel() // x.shape[-1]
        out_features, in_features = weight.shape
        if M % 16 or in_features % 16 or out_features % 16:
            return None
        lin = getattr(owner, "_te", None)
        if lin is None or lin.weight is not weight:
            lin = te.Linear(in_features, out_features, bias=False, params_dtype=weight.dtype, device=weight.device)
            lin.weight = weight  # share the master weight: one parameter, one gradient
            owner._te = lin  # on the kernel, not the module: state_dict keys stay `weight`
        if hasattr(te, "autocast"):  # TE >= 2.8 name
            ctx = te.autocast(enabled=True, recipe=self.recipe)
        else:
            ctx = te.fp8_autocast(enabled=True, fp8_recipe=self.recipe)
        with ctx:
            return lin(x)


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
        for a, b in (
            (r.act(x), r.weight(w)),
            (r.act(dy), (lambda q, s, k: (q.t(), s.t(), k))(*r.weight(w))),
            (r.act(dy.t()), r.act(x.t())),
        ):
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
    if cfg.backend == "hopper-emulated":  # never chosen by `auto`: a numerics model, not a speed path
        ok, why = mmaemu_status()
        if not ok:
            raise ConfigError(f"dsv3.fp8.backend: 'hopper-emulated' cannot run here: {why}")
        return (
            HopperEmulatedBackend(cfg.promote_every),
            f"requested (dsv3.fp8.backend = hopper-emulated, promote_every = {cfg.promote_every}; {why})",
        )
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

    def __init__(self, cfg: FP8Config, report: Fp8Report | None = None):
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
# The FP8 linear kernel


def _resolved(backend, device: torch.device):
    return backend.resolve(device) if isinstance(backend, AutoBackend) else backend


_XT_LAST: list = [None]  # (weakref to the input, its version, recipe, its FP8 Xᵀ)


def _shared_xt(x: torch.Tensor, x2: torch.Tensor, r: Fp8Recipe):
    """The FP8 Xᵀ cache of input `x`, shared by consecutive FP8 Linears that read the same tensor (MLA's q_a and
    kv_a, an MLP's gate and up): one copy kept for backward instead of one per GEMM. Quantization is
    deterministic, so the shared copy is the very bytes each would have made."""
    last = _XT_LAST[0]
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == r:
        return last[3]
    xt = r.act(x2.t())

    def drop(ref):
        if _XT_LAST[0] is not None and _XT_LAST[0][0] is ref:
            _XT_LAST[0] = None

    _XT_LAST[0] = (weakref.ref(x, drop), x._version, r, xt)
    return xt


class Fp8LinearKernel(SplitKernel):
    """`kernels.LinearKernel` with Fprop, Dgrad and Wgrad in FP8 (tile orientations in the module docstring).

    Saved for backward: Xᵀ in FP8 (1×128 along M; only when the weight needs a gradient) and the weight: a
    parameter by reference (re-quantized in backward, no per-micro-batch copy), anything else as its FP8 copy.
    With a TE backend the layer runs as a `te.pytorch.Linear` (which does its own backward) unless the
    weight gradient is deferred. NOTE: TE's Linear cannot split its backward, so under deferral (pipeline
    B/W split) the GEMMs run on the TE backend's fallback (torch `_scaled_mm` or the emulation), same recipe."""

    def __init__(self, recipe: Fp8Recipe = Fp8Recipe(), backend=None):
        self.recipe = recipe
        self.backend = backend or EmulatedBackend()

    def call(self, via, x, weight, bias=None):
        be = _resolved(self.backend, x.device)
        if isinstance(be, TEBackend) and not via.defers_weight_grads:
            y = be.linear(self, x, weight)
            if y is not None:
                return y if bias is None else y + bias.to(y.dtype)
        return apply_split(via, be, x, weight, bias)

    def forward(self, backend, x, weights, need_w):
        weight, bias = weights
        r = self.recipe
        K, N = x.shape[-1], weight.shape[0]
        x2 = x.reshape(-1, K)  # [M, K]
        qx, sx, kx = r.act(x2)  # 1×128 along K
        qw, sw, kw = r.weight(weight)  # 128×128
        y = backend.gemm(qx, sx, kx, qw, sw, kw)  # Fprop [M, N] fp32
        xt = _shared_xt(x, x2, r) if need_w[0] else (None, None, None)  # Xᵀ 1×128 along M: the FP8 cache
        y = y.to(x.dtype).reshape(*x.shape[:-1], N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        meta = (backend, xt[2], kw, x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if weight.is_leaf:
            # a parameter does not change before backward: re-quantize it there (the same bytes) rather than
            # keep an FP8 copy of the weight per micro-batch in flight
            return y, (xt[0], xt[1], weight, None), meta
        return y, (xt[0], xt[1], qw, sw), meta

    def input_grad(self, saved, meta, dy, need):
        qxt, _, qw, sw = saved
        backend, _, kw, x_shape, x_dtype, _, _ = meta
        r = self.recipe
        if sw is None:
            qw, sw, _ = r.weight(qw)
        dy2 = dy.reshape(-1, dy.shape[-1])  # [M, N]
        dx = None
        if need[0]:
            qg, sg, kg = r.act(dy2)  # 1×128 along N
            sw_t = sw.t() if kw == "block" else sw  # blocks of Wᵀ [K, N]
            dx = backend.gemm(qg, sg, kg, qw.t(), sw_t, kw).to(x_dtype).reshape(x_shape)  # Dgrad
        # W's operand dYᵀ (1×128 along M) is quantized here: a deferred W then holds 1 byte per element
        dyt = r.act(dy2.t()) if need[1] and qxt is not None else None
        return dx, (dyt, dy if need[2] else None)

    def weight_grads(self, saved, meta, carry, need_w):
        qxt, sxt, _, _ = saved
        backend, kxt, _, _, _, w_dtype, b_dtype = meta
        dyt, dy = carry
        dw = db = None
        if dyt is not None:
            dw = backend.gemm(*dyt, qxt, sxt, kxt).to(w_dtype)  # Wgrad [N, K]
        if need_w[1]:
            db = dy.sum_to_size(dy.shape[-1:]).to(b_dtype)  # as autograd's broadcast add gives
        return dw, db

    def __repr__(self) -> str:
        return f"Fp8LinearKernel({self.recipe.kind}, pow2={self.recipe.pow2}, backend={self.backend.name})"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe = Fp8Recipe(), backend=None):
    """y = x · weightᵀ with all three GEMMs in FP8 (weight [N, K], x [..., K]); never through TE's Linear."""
    k = Fp8LinearKernel(recipe, backend)
    return apply_split(k, _resolved(k.backend, x.device), x, weight, None)


class Fp8Linear(KernelLinear):
    """Drop-in nn.Linear (same `weight`/`bias` names and parameters) whose GEMMs run in FP8: a `KernelLinear`
    whose kernel is an `Fp8LinearKernel` (possibly wrapped, e.g. by the weight-gradient deferral)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        recipe: Fp8Recipe = Fp8Recipe(),
        backend=None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias, Fp8LinearKernel(recipe, backend), device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, lin: nn.Linear, recipe: Fp8Recipe, backend) -> Fp8Linear:
        new = cls(lin.in_features, lin.out_features, lin.bias is not None, recipe, backend, device="meta")
        new.weight = lin.weight  # the same Parameter object: optimizer state and checkpoints keep working
        new.bias = lin.bias
        return new

    @property
    def recipe(self) -> Fp8Recipe:
        return base_kernel(self.kernel).recipe

    @property
    def backend(self):
        return base_kernel(self.kernel).backend

    def extra_repr(self) -> str:
        return (
            f"{nn.Linear.extra_repr(self)}, fp8={self.recipe.kind}, pow2={self.recipe.pow2}, "
            f"backend={self.backend.name}, kernel={self.kernel!r}"
        )


# --------------------------------------------------------------------------------------------------
# Transformer Engine recipe bridge


def te_recipe_spec(cfg: FP8Config) -> tuple[str, dict]:
    """Our config in TE's words: (recipe class name, {attribute: value}). QParams are given as dicts.

    These are the values the TE recipe object must hold, whether TE takes them as constructor fields or not
    (`to_te_recipe` sets and checks them). `use_power_2_scales` (tensorwise) is set only where TE has it."""
    q = {"power_2_scale": cfg.pow2_scales, "amax_epsilon": AMAX_EPS}
    fields = {
        "fp8_format": "E4M3",
        "fp8_quant_fwd_inp": dict(q),
        "fp8_quant_fwd_weight": dict(q),
        "fp8_quant_bwd_grad": dict(q),
    }
    if cfg.recipe == "blockwise":
        # x 1×128, w 128×128, grad 1×128 (App. B.2); split (FP32) accumulation is TE's fixed default here.
        fields.update(x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1)
        return "Float8BlockScaling", fields
    # recent TE (e.g. 2.20) builds current-scaling quantizers from this flag, then applies fp8_quant_* per tensor
    fields["use_power_2_scales"] = cfg.pow2_scales
    return "Float8CurrentScaling", fields


_TE_OPTIONAL = {"use_power_2_scales"}  # absent from some TE versions: nothing there reads it


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
                raise RuntimeError(
                    f"to_te_recipe: transformer_engine {ver} {name} has no attribute {k!r}; "
                    f"cannot apply it (supported: TE >= 2.3)"
                )
            setattr(recipe, k, v)
    for k, v in want.items():
        got = _te_view(getattr(recipe, k, "<missing>"), v)
        if got != v:
            raise RuntimeError(
                f"to_te_recipe: transformer_engine {ver} {name}.{k} is {got!r} after setting "
                f"{v!r}; TE would not run the requested dsv3.fp8 settings"
            )
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
    converted: list[str] = field(default_factory=list)  # nn.Linear -> Fp8Linear
    grouped: list[str] = field(default_factory=list)  # GroupedExperts on the FP8 path
    high_precision: list[str] = field(default_factory=list)  # GEMM-bearing modules deliberately kept

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
