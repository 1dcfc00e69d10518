"""`dsv3.lora` in the one validation (`RunConfig.load`, what `dsv3 check-config` and `dsv3 train` run before any rank
starts): what LoRA needs is refused in one line (exit 2) naming the key or the flag, and the key is never accepted
and ignored (`dsv3 train` on synthetic data without --init-from, the Megatron path's --dsv3-config)."""

import json

import pytest

import dsv3_plugin.cli.train as cli_train
from dsv3_plugin.cli import main
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.deepspeed.run_config import RunConfig, RunOverrides

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {"preset": "tiny", "train": {"seq_len": 16}, "fp8": {"enabled": True}, "lora": {"rank": 4}},
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    from dsv3_plugin.checkpoint.tiny_release import write_tiny_release

    tmp = tmp_path_factory.mktemp("lora_rc")
    return {"fp8": write_tiny_release(tmp / "fp8", fp8=True), "bf16": write_tiny_release(tmp / "bf16", fp8=False)}


def _file(tmp_path, **dsv3):
    d = json.loads(json.dumps(DS))
    for sec, v in dsv3.items():
        if v is None:
            d["dsv3"].pop(sec, None)
        else:
            d["dsv3"][sec] = {**d["dsv3"].get(sec, {}), **v}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_lora_config_is_accepted_with_a_release(tmp_path, releases, capsys):
    path = _file(tmp_path)
    assert main(["check-config", path, "--nproc", "2", "--init-from", releases["fp8"]]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    run = RunConfig.load(path, overrides=RunOverrides(init_from=releases["fp8"]), world_size=2)
    assert run.cfg.lora.rank == 4
    assert run.cfg.mtp.depth == 0  # lora.mtp "off" (the default): built without MTP, parsed once here
    frozen = RunConfig.load(
        _file(tmp_path, lora={"mtp": "frozen"}), overrides=RunOverrides(init_from=releases["fp8"]), world_size=2
    )
    assert frozen.cfg.mtp.depth == DSv3Config.from_block({"preset": "tiny"}).mtp.depth > 0
    piped = json.loads(open(_file(tmp_path, parallel={"pp": 2, "schedule": "dualpipev"})).read())
    piped["gradient_accumulation_steps"] = 4  # DualPipeV: >= 2·pp micro-batches a step
    pp = RunConfig.load(piped, overrides=RunOverrides(init_from=releases["fp8"]), world_size=2)
    assert pp.cfg.lora is not None and pp.cfg.parallel.pp == 2  # the pipelined engine trains adapters too
    experts = _file(tmp_path, lora={"experts": True}, parallel={"ep": 2})  # expert adapters sharded with them
    assert main(["check-config", experts, "--nproc", "2", "--init-from", releases["fp8"]]) == 0


REFUSED = [
    # (dsv3 sections over DS, release, nproc, the one line)
    ({}, None, 2, "error: dsv3.lora: LoRA trains adapters on a released base: pass --init-from DIR\n"),
    ({"fp8": None}, "fp8", 2, "error: dsv3.fp8.enabled: --init-from "),
    ({"fp8": {"recipe": "tensorwise"}}, "fp8", 2, "error: dsv3.fp8.recipe: 'tensorwise' with dsv3.lora"),
    ({"lora": {"mtp": "frozen"}, "mtp": {"depth": 0}}, "fp8", 2, "error: dsv3.lora.mtp: 'frozen' trains through"),
]


@pytest.mark.parametrize("sections, release, nproc, line", REFUSED)
def test_lora_refusals_name_the_key(tmp_path, releases, capsys, sections, release, nproc, line):
    argv = ["check-config", _file(tmp_path, **sections), "--nproc", str(nproc)]
    argv += ["--init-from", releases[release]] if release else []
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_bf16_release_without_fp8_is_accepted(tmp_path, releases):
    run = RunConfig.load(_file(tmp_path, fp8=None), overrides=RunOverrides(init_from=releases["bf16"]))
    assert run.cfg.lora is not None and not run.cfg.fp8.enabled  # a BF16 release stays BF16


def test_train_refuses_lora_without_init_from_before_any_rank(tmp_path, monkeypatch, capsys):
    """Synthetic data (no --init-from) would train the whole random model: refused before the spawn."""
    spawned = []
    monkeypatch.setattr(cli_train, "spawn", lambda *a, **kw: spawned.append(a))
    path = _file(tmp_path)
    assert main(["train", "--config", path, "--nproc", "2", "--out", str(tmp_path / "out")]) == 2
    assert not spawned
    assert capsys.readouterr().err.endswith("error: dsv3.lora: LoRA trains adapters on a released base: pass "
                                            "--init-from DIR\n")  # fmt: skip


def test_initialize_refuses_a_lora_block_for_a_model_without_adapters():
    """The Python API: `dsv3_plugin.deepspeed.initialize` with a lora block and a plain model (not built by
    `load_frozen_base`) would train the whole model: refused before DeepSpeed is called."""
    from dsv3_plugin.deepspeed import initialize
    from dsv3_plugin.training.transforms import build_model

    model = build_model(DSv3Config.from_block({"preset": "tiny"}))
    ds = json.loads(json.dumps(DS))
    ds["dsv3"] = {"lora": {"rank": 4}}
    with pytest.raises(ConfigError, match=r"^dsv3.lora: the config asks for LoRA but the model has no adapters"):
        initialize(model, ds)
