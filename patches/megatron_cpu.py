"""Runtime shims that let the parts of Megatron-Core used by `dsv3_plugin.megatron` run on CPU with gloo.

For CI and laptop debugging only: `apply()` does nothing (returns False) when CUDA is available, so the same
driver code runs unpatched on GPUs. Importing this module changes nothing; `apply()` / `revert()` (or the
`cpu_shims()` context manager) switch the shims on and off, restoring the exact original objects. Patched
(megatron-core 0.16.1 and 0.19.2): `torch.cuda.current_device`, the CUDA RNG tracker and RNG state, the
optimizer's literal `device='cuda'` allocations and CUDA-only grad clipping, `multi_latent_attention.HAVE_TE`,
CUDA streams, and (0.16.1 without TE) the unbound `moe_utils.te_general_gemm` of Megatron's own MoE router;
torch.compile's stance is `force_eager` (Megatron's `jit_fuser` functions run as written, not compiled). An
untested Megatron-Core version is refused with an error naming it (`force=True` tries anyway).

What each shim does and why: docs/design_notes.md#patches-megatron-cpu
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging

import torch

__all__ = [
    "TESTED_VERSIONS",
    "CPURNGStatesTracker",  # noqa: F822 (made on first access by the module __getattr__ below)
    "apply",
    "revert",
    "is_applied",
    "cpu_shims",
    "megatron_core_version",
    "check_version",
]

TESTED_VERSIONS = ("0.16.1", "0.19.2")

_saved: dict | None = None  # originals while applied


def megatron_core_version() -> str:
    from megatron.core.package_info import __version__

    # NOTE: megatron-core appends "+<git hash>" when its install lies inside a git checkout (a venv in this repo).
    return __version__.split("+")[0]


def check_version(what: str, force: bool = False) -> str:
    """Raise RuntimeError unless the installed megatron-core is one this patch was tested with."""
    v = megatron_core_version()
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"{what}: megatron-core {v} is untested (tested: {', '.join(TESTED_VERSIONS)}); refusing to patch it. "
            "Check the patched attributes against that version and add it to TESTED_VERSIONS, or pass force=True."
        )
    return v


def _version_tuple(v: str) -> tuple[int, int]:
    major, minor = v.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _is_cuda(dev) -> bool:
    return (isinstance(dev, str) and dev.startswith("cuda")) or (isinstance(dev, torch.device) and dev.type == "cuda")


class _CudaLiteralsOnCPU(torch.overrides.TorchFunctionMode):
    """Inside this mode `device='cuda'` arguments become CPU and `Tensor.cuda()` is the identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _CudaLiteralsOnCPU():
            return fn(*args, **kwargs)

    wrapper.__wrapped_by_megatron_cpu__ = True
    return wrapper


# (module, attribute path) of Megatron functions with literal 'cuda' allocations that the optimizer path runs.
_CUDA_LITERAL_SITES = (
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "MixedPrecisionOptimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "count_zeros_fp32"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.clip_grads", "count_zeros_fp32"),
    ("megatron.core.optimizer.grad_scaler", "MegatronGradScaler.__init__"),
    ("megatron.core.optimizer.grad_scaler", "DynamicGradScaler.__init__"),
    # 0.19: flag tensor all-reduced to find which ranks hold a grad-norm group
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.has_grad_norm_group", (0, 19)),
)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's in-place fp32 grad clipping without its CUDA-type assertion and CUDA overflow buffer."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


class _CPUStream:
    """Stands in for `torch.cuda.Stream` on CPU: every wait/record is a no-op (CPU kernels run in program order)."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _CPUStream()


def _cpu_current_stream(device=None) -> _CPUStream:
    return _CURRENT_STREAM


@contextlib.contextmanager
def _cpu_stream_context(stream=None):
    yield stream


def _cpu_synchronize(device=None) -> None:
    pass


# torch.cuda attributes replaced while the shims are on (name -> CPU replacement).
_TORCH_CUDA_SITES = {
    "current_device": _cpu_current_device,
    "current_stream": _cpu_current_stream,
    "Stream": _CPUStream,
    "stream": _cpu_stream_context,
    "synchronize": _cpu_synchronize,
}


def _get_device_rng_state_cpu(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_device_rng_state_cpu(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


# (module, attribute, replacement) replaced outright on CPU.
_REPLACED_SITES = (
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu),
    # Activation recompute saves/restores the "CUDA" RNG state around the re-run forward: the CPU one here.
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _get_device_rng_state_cpu),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_device_rng_state_cpu),
)


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    *owners, attr = path.split(".")
    for o in owners:
        obj = getattr(obj, o)
    return obj, attr


_TRACKER_CLS = None


def _tracker_class():
    global _TRACKER_CLS
    if _TRACKER_CLS is not None:
        return _TRACKER_CLS
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    class CPURNGStatesTracker(CudaRNGStatesTracker):
        """Megatron's named RNG states, kept for the CPU generator instead of the CUDA one."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            outer = self._current_state_name
            if outer != "default-rng":
                self.states_[outer] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(self.states_[outer] if outer != "default-rng" else orig)
                self._current_state_name = outer

    _TRACKER_CLS = CPURNGStatesTracker
    return _TRACKER_CLS


def __getattr__(name):  # the tracker class needs Megatron; build it lazily (importing us stays side-effect free)
    if name == "CPURNGStatesTracker":
        return _tracker_class()
    raise AttributeError(name)


def _compile_stance():
    """torch.compile's current stance (`set_stance` returns none): what `revert()` puts back."""
    import torch._dynamo.eval_frame as eval_frame

    return eval_frame._stance


def is_applied() -> bool:
    return _saved is not None


def apply(force: bool = False) -> bool:
    """Install the CPU shims. Returns True if installed now or already, False when CUDA is available
    (nothing is patched then). Raises RuntimeError on an untested megatron-core version."""
    global _saved
    if torch.cuda.is_available():
        logging.getLogger(__name__).info("megatron_cpu: CUDA is available, CPU shims not applied")
        return False
    if _saved is not None:
        return True
    check_version("dsv3_plugin_patches.megatron_cpu", force)
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.multi_latent_attention as mla

    _saved = {
        "torch_cuda": {name: getattr(torch.cuda, name) for name in _TORCH_CUDA_SITES},
        "tracker": mrandom._CUDA_RNG_STATE_TRACKER,
        "tracker_init": mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        "mla_have_te": mla.HAVE_TE,
        "sites": [],
        "compile_stance": _compile_stance(),
    }
    for module, path, *since in _CUDA_LITERAL_SITES:
        if since and _version_tuple(megatron_core_version()) < since[0]:
            continue
        owner, attr = _resolve(module, path)
        orig = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        _saved["sites"].append((owner, attr, orig))
        setattr(owner, attr, _on_cpu(orig))
    for module, path, replacement in _REPLACED_SITES:
        owner, attr = _resolve(module, path)
        _saved["sites"].append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, replacement)
    for name, replacement in _TORCH_CUDA_SITES.items():
        setattr(torch.cuda, name, replacement)
    mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mla.HAVE_TE = False
    # Megatron's `jit_fuser` is torch.compile: on CPU inductor generates and loads C++ for a few element-wise
    # functions in every process (~8 s of CPU a rank, measured; the losses are equal bit for bit without it)
    torch.compiler.set_stance("force_eager")
    # 0.16.1 without TE never binds `te_general_gemm` in moe_utils (0.19 binds it to None), so Megatron's own MoE
    # router raises NameError on its first GEMM; None is what its `is not None` check expects when TE is absent
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _saved["moe_te_gemm_added"] = moe_utils
    return True


def revert() -> None:
    """Restore every patched attribute to the object it held before `apply()`."""
    global _saved
    if _saved is None:
        return
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.multi_latent_attention as mla

    for name, orig in _saved["torch_cuda"].items():
        setattr(torch.cuda, name, orig)
    mrandom._CUDA_RNG_STATE_TRACKER = _saved["tracker"]
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = _saved["tracker_init"]
    mla.HAVE_TE = _saved["mla_have_te"]
    stance = _saved["compile_stance"]
    torch.compiler.set_stance(stance.stance, skip_guard_eval_unsafe=stance.skip_guard_eval_unsafe,
                              force_backend=stance.backend)  # fmt: skip
    for owner, attr, orig in reversed(_saved["sites"]):
        setattr(owner, attr, orig)
    if "moe_te_gemm_added" in _saved:
        del _saved["moe_te_gemm_added"].te_general_gemm
    _saved = None


@contextlib.contextmanager
def cpu_shims(force: bool = False):
    """`with cpu_shims(): ...` applies the shims (on CPU-only machines) and reverts them on exit."""
    applied_here = not is_applied() and apply(force)
    try:
        yield
    finally:
        if applied_here:
            revert()
