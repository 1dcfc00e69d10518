"""The DeepSpeed JSON split: "dsv3" block validated, ZeRO stage 1, explicit gradient clipping, and a model built
from a different "dsv3" block is refused (before DeepSpeed is imported)."""

import pytest

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.deepspeed import DEFAULT_GRADIENT_CLIPPING, initialize, split_ds_config
from dsv3_plugin.training.transforms import build_model


def test_split_sets_stage_1_and_clipping_explicitly():
    ds, cfg = split_ds_config({"train_micro_batch_size_per_gpu": 1, "dsv3": {"preset": "tiny"}})
    assert "dsv3" not in ds
    assert ds["zero_optimization"] == {"stage": 1}
    assert ds["gradient_clipping"] == DEFAULT_GRADIENT_CLIPPING
    assert cfg.model.hidden_size == 64
    ds, _ = split_ds_config(
        {
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 1, "reduce_bucket_size": 5},
            "train_batch_size": 4,
            "dsv3": {},
        }
    )
    assert ds["gradient_clipping"] == 0.0 and ds["zero_optimization"]["reduce_bucket_size"] == 5


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
        ({"zero_optimization": 1}, "zero_optimization:"),
        ({"gradient_clipping": "yes"}, "gradient_clipping"),
        ({"dsv3": {"moe": {"n_group": 3}}}, "dsv3.moe.n_group"),
    ],
)
def test_split_rejects(bad, needle):
    d = {"train_micro_batch_size_per_gpu": 1, "dsv3": {"preset": "tiny"}, **bad}
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        split_ds_config(d)


def test_model_must_match_the_block():
    model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    with pytest.raises(ConfigError, match=r"^dsv3\.moe\.seq_aux_alpha: the model was built with"):
        initialize(
            model, {"train_micro_batch_size_per_gpu": 1, "dsv3": {"preset": "tiny", "moe": {"seq_aux_alpha": 0.0}}}
        )
