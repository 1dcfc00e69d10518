"""`to_te_recipe` against Transformer Engine's REAL recipe classes (TE 2.3, the oldest with Float8BlockScaling,
and the current release), loaded without a GPU from the pinned wheels (tests/te_recipe_wheels.py).

TE declares `fp8_quant_fwd_inp` / `fp8_quant_fwd_weight` / `fp8_quant_bwd_grad` as un-annotated class attributes
of a pydantic dataclass: passed as constructor keywords they are dropped without an error, and the recipe keeps
TE's defaults (amax_epsilon 0.0, power_2_scale from an environment variable). TE's quantizers read them from
the recipe instance (`recipe.fp8_quant_fwd_inp.power_2_scale`, `.amax_epsilon`), which is what is checked here."""

import dataclasses

import pytest
from te_recipe_wheels import fake_te_package, pinned_versions

from dsv3_plugin.config import FP8Config
from dsv3_plugin.precision.fp8.linear import te_recipe_spec, to_te_recipe
from dsv3_plugin.precision.fp8.quant import AMAX_EPS

VERSIONS = pinned_versions()
QPARAMS = ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")


def test_pins_cover_oldest_supported_and_current():
    assert "2.3.0" in VERSIONS and len(VERSIONS) >= 2


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
@pytest.mark.parametrize("pow2", [False, True])
def test_to_te_recipe_holds_every_requested_value(monkeypatch, version, recipe, pow2):
    te = fake_te_package(monkeypatch, version)
    cfg = FP8Config(recipe=recipe, pow2_scales=pow2)
    name, spec = te_recipe_spec(cfg)
    cls = getattr(te, name)
    r = to_te_recipe(cfg)
    assert type(r) is cls
    assert r.fp8_format is te.Format.E4M3
    for k in QPARAMS:
        q = getattr(r, k)
        assert isinstance(q, te.QParams), k
        assert (q.power_2_scale, q.amax_epsilon) == (pow2, AMAX_EPS), f"TE {version} {name}.{k} = {q!r}"
        # the test can fail: TE's own default differs from what the bridge asked for
        assert getattr(cls, k).amax_epsilon == 0.0
    if recipe == "blockwise":
        assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    elif "use_power_2_scales" in {f.name for f in dataclasses.fields(cls)}:  # TE 2.20: quantizers' flag
        assert r.use_power_2_scales is pow2
    # set on the instance only: TE's class defaults and other recipes are untouched
    fresh = cls()
    assert all(getattr(fresh, k) == getattr(cls, k) for k in QPARAMS)
    assert fresh.fp8_quant_fwd_inp.amax_epsilon == 0.0


@pytest.mark.parametrize("version", VERSIONS)
def test_to_te_recipe_refuses_a_te_that_drops_a_value(monkeypatch, version):
    """A TE recipe class that ignores an assignment (as TE's constructor ignores the keywords) is an error
    naming the attribute, not a recipe that silently runs TE's defaults."""
    te = fake_te_package(monkeypatch, version)

    class Dropping(te.Float8BlockScaling):
        def __setattr__(self, k, v):
            if k != "fp8_quant_bwd_grad":
                super().__setattr__(k, v)

    monkeypatch.setattr(te, "Float8BlockScaling", Dropping)
    with pytest.raises(RuntimeError, match=r"Float8BlockScaling\.fp8_quant_bwd_grad is .*after setting"):
        to_te_recipe(FP8Config())


@pytest.mark.parametrize("version", VERSIONS)
def test_premise_quant_params_are_not_constructor_fields(monkeypatch, version):
    """Why the bridge assigns them: in these TE releases they are not dataclass fields (keywords are dropped)."""
    te = fake_te_package(monkeypatch, version)
    fields = {f.name for f in dataclasses.fields(te.Float8BlockScaling)}
    assert "x_block_scaling_dim" in fields and not fields & set(QPARAMS)
    r = te.Float8BlockScaling(fp8_quant_fwd_inp=te.QParams(power_2_scale=False, amax_epsilon=AMAX_EPS))
    assert r.fp8_quant_fwd_inp.amax_epsilon == 0.0
