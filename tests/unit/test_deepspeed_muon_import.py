"""patches/deepspeed_muon_import.py: an optimizer ZeRO already lists is accepted without importing DeepSpeed's Muon
module (and torch._inductor with it); any other type goes to DeepSpeed's own check; revert restores it."""

import importlib

import torch

from dsv3_plugin.deepspeed.backend import import_deepspeed

patch = importlib.import_module("dsv3_plugin_patches.deepspeed_muon_import")


def test_listed_optimizers_skip_the_muon_import_others_get_deepspeeds_check():
    import_deepspeed()  # applies the patch
    import deepspeed.runtime.engine as engine
    import deepspeed.runtime.zero.utils as zero_utils

    assert engine.is_zero_supported_optimizer.__wrapped__ is zero_utils.is_zero_supported_optimizer
    calls = []
    wrapped = patch._known_first(lambda opt: calls.append(type(opt).__name__) or False)
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert torch.optim.AdamW in zero_utils.ZERO_SUPPORTED_OPTIMIZERS
    assert wrapped(adamw) is True and calls == []  # DeepSpeed's check (and its Muon import) not run
    assert sgd.__class__ not in zero_utils.ZERO_SUPPORTED_OPTIMIZERS
    assert wrapped(sgd) is False and calls == ["SGD"]  # DeepSpeed's own answer


def test_apply_and_revert_restore_the_original():
    import_deepspeed()
    import deepspeed.runtime.engine as engine
    import deepspeed.runtime.zero.utils as zero_utils

    patch.revert()
    assert engine.is_zero_supported_optimizer is zero_utils.is_zero_supported_optimizer
    assert patch.apply() is True and patch.apply() is False  # idempotent
    assert engine.is_zero_supported_optimizer is not zero_utils.is_zero_supported_optimizer
