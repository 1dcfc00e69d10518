"""Bad released-format directories give a CheckpointError naming the tensor and file."""

import json

import pytest
import torch
from helpers import make_tiny_hf_checkpoint
from safetensors.torch import load_file, save_file

from dsv3_plugin import load_pretrained
from dsv3_plugin.config import DSv3Config
from dsv3_plugin.errors import CheckpointError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    make_tiny_hf_checkpoint(d, DSv3Config.from_block({"preset": "tiny"}), seed=1)
    return d


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_mtp_file(d, fn):
    path = d / "model-mtp.safetensors"
    sd = load_file(path)
    fn(sd)
    save_file(sd, path, metadata={"format": "pt"})
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != "model-mtp.safetensors"}
    idx["weight_map"].update({k: "model-mtp.safetensors" for k in sd})
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


def test_loads_mtp_layer(ckpt):
    m = load_pretrained(ckpt)
    assert len(m.mtp) == 1 and m.mtp[0].eh_proj.weight.abs().sum() > 0


def test_missing_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_mtp_file(d, lambda sd: sd.pop("model.layers.3.eh_proj.weight"))
    with pytest.raises(CheckpointError, match=r"^model\.layers\.3\.eh_proj\.weight: missing"):
        load_pretrained(d)


def test_wrong_shape(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_mtp_file(d, lambda sd: sd.update({"model.layers.3.hnorm.weight": torch.ones(3)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.hnorm\.weight in model-mtp\.safetensors: shape"):
        load_pretrained(d)


def test_unexpected_tensor(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_mtp_file(d, lambda sd: sd.update({"model.layers.3.mlp.experts.99.up_proj.weight": torch.ones(32, 64)}))
    with pytest.raises(CheckpointError, match=r"experts\.99\.up_proj\.weight in model-mtp\.safetensors"):
        load_pretrained(d)


def test_mtp_head_copy_must_equal_main_head(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    _edit_mtp_file(d, lambda sd: sd["model.layers.3.shared_head.head.weight"].add_(1.0))
    with pytest.raises(CheckpointError, match=r"shared_head\.head\.weight in model-mtp\.safetensors: differs"):
        load_pretrained(d)


def test_index_points_to_missing_file(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path / "c")
    (d / "model-mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-mtp.safetensors"):
        load_pretrained(d)
