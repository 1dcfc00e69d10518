"""DeepSpeed's checkpoint loads go through torch.load(weights_only=True) once the adapter imported DeepSpeed: a
crafted file cannot run code, and what our checkpoints hold still loads."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from dsv3_plugin.deepspeed.backend import import_deepspeed
from dsv3_plugin.errors import CheckpointError


class _Payload:
    """Unpickling this calls os.system: what a crafted checkpoint file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def engine():
    import_deepspeed()
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from dsv3_plugin_patches import deepspeed_safe_load

    assert TorchCheckpointEngine.load is deepspeed_safe_load._safe_load  # applied by the adapter's import
    return TorchCheckpointEngine()


@pytest.mark.parametrize("zipfile", [True, False])
def test_a_crafted_checkpoint_is_refused_and_runs_nothing(engine, tmp_path, zipfile):
    marker = tmp_path / "pwned"
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "x": _Payload(str(marker))}, path,
               _use_new_zipfile_serialization=zipfile)  # fmt: skip
    with pytest.raises(
        CheckpointError, match=r"mp_rank_00_model_states\.pt: refused to unpickle \(.*GLOBAL (posix|os)\.system"
    ):
        engine.load(str(path))
    assert not marker.exists()
    raw = tmp_path / "raw.pt"  # a bare pickle stream, not a torch file at all
    raw.write_bytes(pickle.dumps(_Payload(str(marker)), protocol=2))
    with pytest.raises(CheckpointError, match=r"raw\.pt: "):
        engine.load(str(raw))
    assert not marker.exists()


def test_what_a_zero1_checkpoint_holds_loads(engine, tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {
        "optimizer_state_dict": {"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum.optimizer_states},
        "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
        "ds_version": "0.19.8",
        "rng": (3, tuple(range(5)), None),
        "w": torch.arange(4.0),
    }
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save(state, path)
    got = engine.load(str(path))
    assert torch.equal(got["w"], state["w"]) and got["rng"] == state["rng"]
    assert got["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.optimizer_states
    assert got["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0
    assert got["param_slice_mappings"][0]["w"].numel == 4
