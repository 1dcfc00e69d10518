"""`dsv3 check-config FILE --nproc N` and `dsv3 train --config FILE --nproc N` run the same validation,
`RunConfig.load`, before any rank is spawned (smoke test: the agreement is structural): both call it with the
same arguments, get the same `RunConfig`, which is what the spawned ranks receive, and refuse a bad file with the
same one-line message."""

import json

import pytest

import dsv3_plugin.cli.train as cli_train
from dsv3_plugin.cli import main
from dsv3_plugin.deepspeed.run_config import RunConfig

BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10**9,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "dsv3": {"preset": "tiny", "train": {"seq_len": 16}},
}


@pytest.fixture
def loads(monkeypatch):
    """Every `RunConfig.load` call: (config, target, world_size, ranks_on_host, memory checked) -> its result."""
    calls = []
    real = RunConfig.load.__func__

    def spy(cls, config=None, **kw):
        run = real(cls, config, **kw)
        key = (
            str(config),
            kw.get("target"),
            kw.get("world_size"),
            kw.get("ranks_on_host"),
            bool(kw.get("host_memory")),
        )
        calls.append((key, run))
        return run

    monkeypatch.setattr(RunConfig, "load", classmethod(spy))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_check_config_and_train_run_the_same_validation(tmp_path, monkeypatch, loads):
    spawned = []
    monkeypatch.setattr(cli_train, "spawn", lambda fn, nproc, request, **kw: spawned.append((nproc, request)))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(BASE))
    assert main(["check-config", str(path), "--nproc", "2"]) == 0
    assert main(["train", "--config", str(path), "--nproc", "2", "--out", str(tmp_path / "out")]) == 0
    (checked_key, checked), (trained_key, trained) = loads
    assert checked_key == trained_key == (str(path), "train", 2, 2, True)
    assert (checked.ds, checked.cfg) == (trained.ds, trained.cfg)
    ((nproc, request),) = spawned
    assert nproc == 2 and request.config is trained  # the ranks get the launcher's RunConfig, not the file


@pytest.mark.parametrize(
    "text, key",
    [
        (json.dumps({**BASE, "dsv3": {"preset": "tiny", "moe": {"top_k": 17}}}), "dsv3.moe.top_k"),
        (json.dumps({**BASE, "dsv3": {"preset": "tiny", "parallel": {"ep": 4}}}), "dsv3.parallel.ep"),
        ("{", "FILE"),
    ],
    ids=["schema", "world-size", "not-json"],
)
def test_refused_with_the_same_message(tmp_path, capsys, monkeypatch, loads, text, key):
    monkeypatch.setattr(cli_train, "spawn", lambda *a, **k: pytest.fail("dsv3 train spawned ranks"))
    path = tmp_path / "c.json"
    path.write_text(text)
    assert main(["check-config", str(path), "--nproc", "2"]) == 2
    checked = capsys.readouterr().err
    assert main(["train", "--config", str(path), "--nproc", "2", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == checked
    assert checked.startswith(f"error: {path if key == 'FILE' else key}") and checked.count("\n") == 1, checked
