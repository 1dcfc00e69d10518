"""patches/megatron_recompute_no_te.py: Megatron's `CheckpointWithoutOutput` (selective recompute of norms and MLA
up-projections) without Transformer Engine. Without the patch its forward asks TE whether FP8 is on and fails with a
NameError; with it the recomputed output and gradient are those of running the function directly (the same ops)."""

import importlib

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: the patch is for 0.19.2")
mrandom = importlib.import_module("megatron.core.tensor_parallel.random")
patch = importlib.import_module("dsv3_plugin_patches.megatron_recompute_no_te")
megatron_cpu = importlib.import_module("dsv3_plugin_patches.megatron_cpu")
pytestmark = pytest.mark.skipif(mrandom.HAVE_TE, reason="Transformer Engine installed: nothing to patch")


def _norm_then_grad(x, w, ckpt):
    """RMS-norm-like function through `ckpt` (or directly), its output used by a later op, as TransformerLayer does
    (the checkpoint frees the output and recomputes it in backward)."""
    f = lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w  # noqa: E731
    y = ckpt.checkpoint(f, x) if ckpt is not None else f(x)
    out = (y @ torch.ones(y.shape[-1], 3)).sum()
    if ckpt is not None:
        ckpt.discard_output_and_register_recompute(out)
    out.backward()
    return out.detach(), x.grad.clone(), w.grad.clone()


def test_recompute_without_te_fails_unpatched_and_equals_the_direct_run_patched():
    applied_cpu = megatron_cpu.apply() if not torch.cuda.is_available() else False  # Megatron's RNG state on CPU
    try:
        torch.manual_seed(0)
        x0, w0 = torch.randn(4, 8), torch.randn(8)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with pytest.raises(NameError, match="FP8GlobalStateManager"):
            _norm_then_grad(x, w, mrandom.CheckpointWithoutOutput())
        assert patch.apply()
        try:
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            got = _norm_then_grad(x, w, mrandom.CheckpointWithoutOutput())
        finally:
            patch.revert()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        want = _norm_then_grad(x, w, None)
        for a, b in zip(got, want):
            assert torch.equal(a, b)  # the recompute runs the same ops on the same inputs
        assert not patch.is_applied() and mrandom.CheckpointWithoutOutput().fp8  # reverted: Megatron's own again
    finally:
        if applied_cpu:
            megatron_cpu.revert()
