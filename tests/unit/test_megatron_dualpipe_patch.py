"""patches/megatron_dualpipe.py: version guard, config-driven choice, exact revert."""
import pytest

from dsv3_plugin.config import ConfigError

import megatron.core.pipeline_parallel as pp_pkg
from megatron.core import package_info
from megatron.core.pipeline_parallel import schedules

from patches import megatron_dualpipe


def test_patch_selects_dualpipev_and_reverts_exactly():
    from dsv3_plugin.megatron.schedules import forward_backward_dualpipev
    original = schedules.get_forward_backward_func
    cfg = {"preset": "tiny", "parallel": {"pp": 2, "schedule": "dualpipev"}}
    assert megatron_dualpipe.apply(cfg) is True and megatron_dualpipe.is_applied()
    assert megatron_dualpipe.apply(cfg) is False                 # idempotent
    try:
        assert pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_dualpipev
        assert schedules.get_forward_backward_func(pp_size=2, vp_size=None) is forward_backward_dualpipev
        # pp = 1 keeps Megatron's own function
        assert pp_pkg.get_forward_backward_func(pp_size=1, vp_size=None) is schedules.forward_backward_no_pipelining
    finally:
        assert megatron_dualpipe.revert() is True
    assert schedules.get_forward_backward_func is original and pp_pkg.get_forward_backward_func is original
    assert megatron_dualpipe.revert() is False
    # a 1f1b config leaves Megatron's choice alone
    with megatron_dualpipe.dualpipe_schedule({"preset": "tiny", "parallel": {"pp": 2, "schedule": "1f1b"}}):
        assert (pp_pkg.get_forward_backward_func(pp_size=2, vp_size=None)
                is schedules.forward_backward_pipelining_without_interleaving)
    assert pp_pkg.get_forward_backward_func is original


def test_patch_refuses_untested_versions_and_dualpipe(monkeypatch):
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    with pytest.raises(RuntimeError, match="megatron-core 0.99.0 is untested"):
        megatron_dualpipe.apply({"preset": "tiny", "parallel": {"pp": 2, "schedule": "dualpipev"}})
    assert not megatron_dualpipe.is_applied()
    monkeypatch.setattr(package_info, "__version__", "0.16.1")
    with pytest.raises(ConfigError, match="parallel.schedule"):
        megatron_dualpipe.apply({"preset": "tiny", "parallel": {"pp": 2, "schedule": "dualpipe"}})
    assert not megatron_dualpipe.is_applied()
