"""Bad input to `dsv3 train` found by the self-spawned ranks (or before them) gives ONE `error:` line naming the
key / file / tensor, exit code 2 and no traceback (under torchrun and the deepspeed launcher:
test_train_launchers.py)."""

import json
import os

import pytest
import torch

from dsv3_plugin.deepspeed.run_config import default_ds_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
    }


def _config(tmp_path, **dsv3):
    d = default_ds_config()
    d["dsv3"]["train"]["seq_len"] = 16
    d["dsv3"].update(dsv3)
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    return str(path)


def _one_error(p, needle):
    out = p.stdout + p.stderr
    assert p.returncode == 2, (p.returncode, out[-4000:])
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, out[-4000:]
    assert needle in errors[0], errors[0]
    assert "Traceback" not in out, out[-4000:]


def _train(*args):
    from helpers import dsv3_cli

    return dsv3_cli("train", "--nproc", "2", "--steps", "1", "--no-progress", *args, env=_env())


@pytest.fixture(scope="module")
def truncated_checkpoint(tmp_path_factory):
    from helpers import make_truncated_checkpoint

    return make_truncated_checkpoint(str(tmp_path_factory.mktemp("trunc") / "hf"))


def test_truncated_shard_with_init_from(tmp_path, truncated_checkpoint):
    ck, shard = truncated_checkpoint
    _one_error(
        _train("--config", _config(tmp_path), "--out", str(tmp_path / "o"), "--init-from", ck),
        f"{shard}: data ends at byte",
    )


@pytest.mark.parametrize(
    "dsv3, needle",
    [
        ({"parallel": {"ep": 4}}, "dsv3.parallel.ep"),
        ({"parallel": {"pp": 3}}, "dsv3.parallel.pp"),
        ({"parallel": {"pp": 2, "schedule": "dualpipe"}}, "gradient_accumulation_steps"),  # 1 < 2·pp micro-batches
        pytest.param(
            {"fp8": {"enabled": True, "backend": "te"}},
            "dsv3.fp8.backend",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="TE may run on a GPU"),
        ),
    ],
)
def test_config_refused_by_the_ranks(tmp_path, dsv3, needle):
    _one_error(_train("--config", _config(tmp_path, **dsv3), "--out", str(tmp_path / "o")), needle)


def test_out_is_a_file_or_under_a_file(tmp_path):
    f = tmp_path / "afile"
    f.write_text("not a directory")
    _one_error(_train("--out", str(f)), f"--out {f}: is a file, not a directory")
    _one_error(_train("--out", str(f / "sub")), f"--out {f / 'sub'}: {f} is a file")
    assert f.read_text() == "not a directory"
