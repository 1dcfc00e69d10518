"""`dsv3 generate` checks memory before it loads (issue 27): the bytes the model takes, from config.json alone, against
the memory available; a checkpoint larger than the machine is one line and exit 2 before the index, a shard or a
tensor is read, instead of an allocator failure."""

import json
import time

import pytest
import torch

import dsv3_plugin.cli.generate as gen_cli
from dsv3_plugin.checkpoint.hf import pretrained_config
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.training.memory_estimate import available_memory_bytes, format_bytes, load_bytes, model_param_count
from dsv3_plugin.training.transforms import build_model

ARGS = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2"]


def test_a_checkpoint_larger_than_this_machine_is_refused_from_config_json_alone(tmp_path, capsys):
    """V3's config.json with no weights beside it: 2.5 TiB to build in FP32 is more than this machine has, and that
    is what the one line says (not that the shards are missing: nothing but config.json is read)."""
    v3 = DSv3Config.from_block({"preset": "v3-671b"})
    need = 4 * model_param_count(v3)
    assert need > available_memory_bytes()  # the premise: no test machine holds V3 in FP32
    (tmp_path / "config.json").write_text(json.dumps(v3.to_hf()))
    t0 = time.perf_counter()
    assert main(["generate", "--model", str(tmp_path), *ARGS, "--dtype", "bf16", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --model {tmp_path}: loading needs at least "), err
    assert f"{format_bytes(need)} of host memory ({model_param_count(v3):,} parameters" in err, err
    assert "is available on this host" in err, err
    assert time.perf_counter() - t0 < 30


def test_the_check_is_at_the_boundary_of_what_the_load_takes(tmp_path, capsys, monkeypatch):
    """A tiny checkpoint: refused when the memory available is one byte short of its FP32 build, generated from when
    it is exactly enough."""
    d = write_tiny_release(tmp_path / "ck", fp8=False)
    cfg = pretrained_config(d)
    need = load_bytes(cfg, 4, on_host=True)["host"]
    monkeypatch.setattr(gen_cli, "available_memory_bytes", lambda: need - 1)
    assert main(["generate", "--model", d, *ARGS, "--device", "cpu"]) == 2
    assert "loading needs at least" in capsys.readouterr().err
    monkeypatch.setattr(gen_cli, "available_memory_bytes", lambda: need)
    assert main(["generate", "--model", d, *ARGS, "--device", "cpu"]) == 0
    assert "tokens:" in capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_the_bound_is_the_fp32_model_that_load_builds(preset):
    """The host bytes are exactly the FP32 parameters `build_model` allocates (what `load_pretrained` builds first)."""
    cfg = DSv3Config.from_block({"preset": preset})
    model = build_model(cfg)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert load_bytes(cfg, 2, on_host=True) == {"params": built // 4, "host": built, "device": 0}
    assert load_bytes(cfg, 2, on_host=False)["device"] == built // 2


def test_the_accelerator_is_checked_for_the_cast_model(monkeypatch):
    """On a CUDA device the model in the compute dtype must fit the device's free memory (--device named)."""
    cfg = DSv3Config.from_block({"preset": "tiny"})
    dev_need = load_bytes(cfg, 2, on_host=False)["device"]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (dev_need - 1, 2 * dev_need))
    with pytest.raises(ConfigError, match=r"^--device cuda: the model needs at least .* but only .* of it is free"):
        gen_cli.check_load_memory(cfg, "ck", 2, "cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (dev_need, 2 * dev_need))
    gen_cli.check_load_memory(cfg, "ck", 2, "cuda")
    with pytest.raises(ConfigError, match=r"^--device nonsense: not a torch device"):
        gen_cli.check_load_memory(cfg, "ck", 2, "nonsense")
