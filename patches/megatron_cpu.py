"""Runtime shims that let the parts of Megatron-Core used by `dsv3_plugin.megatron` run on CPU with gloo.

For CI and laptop debugging only: `apply()` does nothing (returns False) when CUDA is available, so the same
driver code runs unpatched on GPUs. Importing this module changes nothing; `apply()` / `revert()` (or the
`cpu_shims()` context manager) switch the shims on and off, restoring the exact original objects.

What is patched, and why (megatron-core 0.16.1, the only version tested):

1. `torch.cuda.current_device` -> the CPU device. Megatron allocates with `device=torch.cuda.current_device()`
   in many places (YaRN RoPE buffers, the global memory buffer, MTP roll, DDP grad buffers).
2. The CUDA RNG tracker (`megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER`) -> `CPURNGStatesTracker`,
   the same named-state fork semantics on the CPU generator (weight init and dropout fork it).
3. `megatron.core.transformer.multi_latent_attention.HAVE_TE` -> False. Without Transformer Engine Megatron's
   import fallbacks leave `HAVE_TE = True` with `TELinear` a MagicMock, and `MLASelfAttention.__init__` then fails
   at `isinstance(self.linear_proj, TELinear)`.

Each patch refuses an untested Megatron-Core version with an error naming the version (pass `force=True` to
try anyway).
"""
from __future__ import annotations

import contextlib
import logging

import torch

__all__ = ["TESTED_VERSIONS", "CPURNGStatesTracker", "apply", "revert", "is_applied", "cpu_shims",
           "megatron_core_version", "check_version"]

TESTED_VERSIONS = ("0.16.1",)

_saved: dict | None = None  # originals while applied


def megatron_core_version() -> str:
    from megatron.core.package_info import __version__
    return __version__


def check_version(what: str, force: bool = False) -> str:
    """Raise RuntimeError unless the installed megatron-core is one this patch was tested with."""
    v = megatron_core_version()
    if v not in TESTED_VERSIONS and not force:
        raise RuntimeError(
            f"{what}: megatron-core {v} is untested (tested: {', '.join(TESTED_VERSIONS)}); refusing to patch it. "
            "Check the patched attributes against that version and add it to TESTED_VERSIONS, or pass force=True.")
    return v


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


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
    check_version("patches.megatron_cpu", force)
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.multi_latent_attention as mla

    _saved = {
        "current_device": torch.cuda.current_device,
        "tracker": mrandom._CUDA_RNG_STATE_TRACKER,
        "tracker_init": mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
        "mla_have_te": mla.HAVE_TE,
    }
    torch.cuda.current_device = _cpu_current_device
    mrandom._CUDA_RNG_STATE_TRACKER = _tracker_class()()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mla.HAVE_TE = False
    return True


def revert() -> None:
    """Restore every patched attribute to the object it held before `apply()`."""
    global _saved
    if _saved is None:
        return
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.multi_latent_attention as mla

    torch.cuda.current_device = _saved["current_device"]
    mrandom._CUDA_RNG_STATE_TRACKER = _saved["tracker"]
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = _saved["tracker_init"]
    mla.HAVE_TE = _saved["mla_have_te"]
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
