"""patches/megatron_training_cpu.py and patches/megatron_dataset_helpers.py: reversible (the exact original
objects come back), version-guarded, the CPU shims never applied with CUDA. They patch `megatron.training`,
which megatron-core's wheel ships from 0.19 on: on 0.16.1 these tests skip (the 0.19 environment runs them)."""

import importlib
import os

import pytest
import torch

pytest.importorskip("megatron.training", reason="megatron-core < 0.19: no megatron.training in the wheel")
training_cpu = importlib.import_module("dsv3_plugin_patches.megatron_training_cpu")
helpers = importlib.import_module("dsv3_plugin_patches.megatron_dataset_helpers")


def _state():
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    import megatron.training.initialize as init
    import megatron.training.training as tr

    return (
        fs_async.get_write_results_queue,
        tr.initialize_megatron,
        init._initialize_distributed,
        init._set_random_seed,
        init._compile_dependencies,
        torch.cuda.get_rng_state,
        torch.cuda.set_rng_state,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shims are never applied on CUDA machines")
def test_apply_and_revert_restore_the_exact_objects():
    before = _state()
    assert training_cpu.apply() is True and helpers.apply() is True
    try:
        assert _state() != before
        assert training_cpu.apply() is True  # idempotent
        state = torch.get_rng_state()
        assert torch.equal(torch.cuda.get_rng_state(), state)  # checkpoints store the CPU generator
    finally:
        training_cpu.revert()
        helpers.revert()
    assert _state() == before


def test_untested_version_is_refused(monkeypatch):
    import megatron.core.package_info as pi

    monkeypatch.setattr(pi, "__version__", "0.20.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _state()
    with pytest.raises(RuntimeError, match=r"megatron_training_cpu: megatron-core 0\.20\.0 is untested"):
        training_cpu.apply()
    with pytest.raises(RuntimeError, match=r"megatron_dataset_helpers: megatron-core 0\.20\.0 is untested"):
        helpers.apply()
    assert _state() == before


def test_cpu_shims_not_applied_when_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = _state()
    assert training_cpu.apply() is False
    assert _state() == before


def test_dataset_helpers_ship_compiled():
    """What makes the patch right: the wheel has helpers_cpp compiled, and no Makefile to rebuild it."""
    import megatron.core.datasets as d
    from megatron.core.datasets import helpers_cpp  # noqa: F401

    assert not os.path.exists(os.path.join(os.path.dirname(d.__file__), "Makefile"))
