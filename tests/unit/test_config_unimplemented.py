"""A released config.json that asks for arithmetic the model does not implement is refused by key, not loaded with
other numerics: `hidden_act` other than silu, `scoring_func` other than sigmoid, `topk_method` other than noaux_tc,
RoPE scaling other than YaRN (or none). Checked through `DSv3Config.from_hf` and `dsv3 generate` (exit 2)."""

import json

import pytest

from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, DSv3Config

BASE = DSv3Config.from_block({"preset": "tiny"}).to_hf()
CASES = {
    "gelu": ({"hidden_act": "gelu"}, r"hidden_act: \"gelu\" is not implemented"),
    "softmax": ({"scoring_func": "softmax"}, r"scoring_func: \"softmax\" is not implemented"),
    "greedy": ({"topk_method": "greedy"}, r"topk_method: \"greedy\" is not implemented"),
    "linear_rope": (
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        r"rope_scaling.type: \"linear\" is not implemented",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_unimplemented_config_values_are_refused(case):
    change, msg = CASES[case]
    with pytest.raises(ConfigError, match=r"^config.json: " + msg):
        DSv3Config.from_hf({**BASE, **change})


def test_implemented_values_load():
    assert DSv3Config.from_hf(BASE).model.rope_scaling is not None  # yarn
    plain = {**BASE, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert DSv3Config.from_hf(plain).model.rope_scaling is None
    assert DSv3Config.from_hf({**BASE, "rope_scaling": {"rope_theta": 10000.0}}).model.rope_scaling is None


def test_generate_refuses_a_gelu_checkpoint(tmp_path, capsys):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    d = write_tiny_release(tmp_path / "ck", fp8=False)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    assert main(["generate", "--model", d, "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    # the file is named once, by its path
    assert err.startswith(f'error: {d}/config.json: hidden_act: "gelu" is not implemented'), err
