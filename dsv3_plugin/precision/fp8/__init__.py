"""FP8 training the DeepSeek-V3 way (report §3.3): E4M3 everywhere, 1×128 activation tiles, 128×128 weight
blocks, FP32 promotion every 128 elements of K.

    quant     tile/block quantization, exact emulated GEMM, FP8 dispatch payloads      (§3.3.2, Fig. 7)
    linear    Fp8Linear (Fprop/Dgrad/Wgrad), GEMM backends: emulate / torch / TE / hopper-emulated
    experts   the routed experts' FP8 kernel (grouped SwiGLU GEMMs in FP8)
    hopper    Hopper tensor-core accumulation modelled bit-exactly (mmaemu, optional)

Putting a model on FP8 is a transform: `dsv3_plugin.training.transforms.convert_to_fp8`.
"""

from dsv3_plugin.precision.fp8.experts import Fp8ExpertKernel, Fp8GroupedSwiGLU, fp8_expert_swiglu
from dsv3_plugin.precision.fp8.linear import (
    AutoBackend,
    EmulatedBackend,
    Fp8Linear,
    Fp8LinearKernel,
    Fp8Recipe,
    Fp8Report,
    TEBackend,
    TorchScaledMMBackend,
    fp8_linear,
    select_backend,
    te_recipe_spec,
    to_te_recipe,
)
from dsv3_plugin.precision.fp8.quant import *  # noqa: F401,F403  (its __all__: the quantization primitives)
from dsv3_plugin.precision.fp8.quant import __all__ as _QUANT_API

__all__ = [
    *_QUANT_API,
    "Fp8Recipe",
    "Fp8Linear",
    "Fp8LinearKernel",
    "fp8_linear",
    "select_backend",
    "to_te_recipe",
    "te_recipe_spec",
    "Fp8Report",
    "AutoBackend",
    "EmulatedBackend",
    "TEBackend",
    "TorchScaledMMBackend",
    "Fp8ExpertKernel",
    "Fp8GroupedSwiGLU",
    "fp8_expert_swiglu",
]
