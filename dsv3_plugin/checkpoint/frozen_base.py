"""Load a released base for LoRA (`dsv3.lora`) rank-locally into its frozen storage, without dequantizing it.

With `fp8.enabled` the decoder layers' GEMM weights (MLA projections, dense / shared-expert MLPs, routed experts)
go straight from the release's E4M3 bytes and `weight_scale_inv` into `precision.fp8.frozen`'s buffers (a BF16
release's weights are quantized once, in the release's own 128×128 blocks); everything else (embedding, head,
norms, routers, MTP's `eh_proj`) is read as `load_pretrained` reads it, in the model dtype, and frozen. Without
`fp8.enabled` a BF16 release stays BF16; an FP8 release is refused (it would need a dequantized copy).

`base_fingerprint`: a cheap identity of a release (config.json, every safetensors header, every `weight_scale_inv`
in full and the first 4 KiB of every other tensor) that adapter checkpoints record so that a resume or an export can
check they sit on the same base (`check_resume_base`: before any rank starts).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import torch

from dsv3_plugin.checkpoint.hf import _config_of, _reader_plan, _state_shapes
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.precision.fp8.frozen import SCALE_SUFFIX, freeze_fp8
from dsv3_plugin.precision.fp8.quant import FP8_DTYPE, TILE, quantize_blockwise
from dsv3_plugin.safe_files import opened_path
from dsv3_plugin.training.lora import lora_model_config
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local
from dsv3_plugin.training.transforms import apply_transforms

__all__ = ["load_frozen_base", "base_fingerprint", "check_resume_base"]


# bytes of each tensor's data the fingerprint reads (scales: all of them); a fine-tune of the same architecture
# changes every tensor, so its first page differs; reading 4 KiB of each of the 671B release's ~92k tensors is ~0.4 GB
SAMPLE_BYTES = 4096


def base_fingerprint(path: str | os.PathLike) -> str:
    """ "sha256:<hex>" of a released directory's config.json (as parsed), every stored tensor's name, shard, dtype,
    shape and byte size, each shard's header metadata, and data: every `weight_scale_inv` whole and the first
    `SAMPLE_BYTES` of every other tensor (so another base of the same shapes, e.g. another fine-tune, differs).

    Raises:
        CheckpointError: the directory is not a valid released checkpoint (as `CheckpointReader`).
    """
    h = hashlib.sha256()
    with CheckpointReader(path) as r:
        h.update(json.dumps(r.config, sort_keys=True).encode())
        for name in sorted(r.stored):
            i = r.stored[name]
            h.update(json.dumps([name, os.path.basename(i.file), i.dtype, list(i.shape), i.nbytes]).encode())
            data_U8 = r.raw(name).reshape(-1).view(torch.uint8)  # mapped: only the pages sliced are read
            h.update((data_U8 if name.endswith(SCALE_SUFFIX) else data_U8[:SAMPLE_BYTES]).numpy().tobytes())
        for f in sorted(r.metadata):
            h.update(json.dumps([os.path.basename(f), r.metadata[f]], sort_keys=True, default=str).encode())
    return "sha256:" + h.hexdigest()


def check_resume_base(tag_dir: str | os.PathLike, init_from: str | os.PathLike) -> None:
    """Refuse to resume a LoRA checkpoint (`tag_dir`, one DeepSpeed tag) on another base than the one its adapters
    were trained on: the base fingerprint its first model-states file records (`client_state["dsv3"]["lora"]`)
    against `base_fingerprint(init_from)`. Loaded with `torch.load(weights_only=True)`.

    Raises:
        CheckpointError: no model-states file or no LoRA record, or another base (both fingerprints named).
    """
    tag_dir = os.fspath(tag_dir)
    files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt")) if os.path.isdir(tag_dir) else []
    if not files:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model-states file")
    path = os.path.join(tag_dir, files[0])
    with opened_path(path, CheckpointError, tag_dir, "torch checkpoint file") as fd_path:
        try:
            states = torch.load(fd_path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:  # refused or torn: named
            raise CheckpointError(f"{path}: not a readable torch checkpoint file ({str(e).splitlines()[0]})") from None
    record = (states.get("dsv3") or {}).get("lora") if isinstance(states, dict) else None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}: no LoRA record in the checkpoint (not saved by a dsv3.lora run)")
    have = base_fingerprint(init_from)
    if record.get("base_fingerprint") != have:
        raise CheckpointError(
            f"{path}: adapters trained on base {record.get('base_fingerprint')}, but this run's base "
            f"(--init-from {os.fspath(init_from)}) is {have}"
        )


def _load_tensor(reader: CheckpointReader, name: str, dst: torch.Tensor, sdst: torch.Tensor | None, pow2: bool) -> None:
    where = f"{name} in {os.path.basename(reader.info(name).file)}"
    if sdst is None:  # high-precision frozen tensor: as `load_pretrained` reads it
        dst.copy_(reader.get(name, torch.float32 if reader.is_fp8(name) else None).to(dst.dtype))
        return
    if reader.is_fp8(name):
        q, s = reader.get_fp8(name)  # the released bytes and block scales, as they are
    else:  # a BF16 / FP32 release under fp8.enabled: quantized once, as the FP8 path would each call
        q, s = quantize_blockwise(reader.get(name, torch.float32), TILE, pow2)
    if q.shape != dst.shape or s.shape != sdst.shape:
        raise CheckpointError(
            f"{where}: FP8 weight {list(q.shape)} with scales {list(s.shape)} does not fit the frozen "
            f"{list(dst.shape)} / {list(sdst.shape)}"
        )
    dst.copy_(q)
    sdst.copy_(s)


@torch.no_grad()
def load_frozen_base(
    path: str | os.PathLike,
    layout: RankLayout | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_non_finite: bool = False,
    **config_overrides,
) -> DSv3Model:
    """This rank's `DSv3Model` for LoRA from a released directory: the frozen base read into its storage (above),
    then the transforms (`apply_transforms`: LoRA adapters, recompute).

    Args:
        path: a released-format checkpoint directory.
        layout: the rank's `RankLayout` (default: the whole model) of `training.lora.lora_model_config(cfg)`
            (no MTP modules under `lora.mtp` "off"); only its tensors are read.
        dtype: dtype of the high-precision parameters (and of the adapters).
        device: where the model's tensors go.
        allow_non_finite: load NaN/Inf weights or scales instead of refusing them.
        **config_overrides: "dsv3" sections over config.json's (must include `lora`).

    Returns:
        The model, with `base_fingerprint`, `base_path` and `checkpoint_bytes_read` set.

    Raises:
        CheckpointError: a tensor is missing, unexpected or mis-shaped for the config, an FP8 weight's block size
            is not 128x128, or a scale is invalid (the message names the tensor).
        ConfigError: no `lora` section, or an FP8 release without `fp8.enabled`.
    """
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as reader:
        cfg = _config_of(reader, config_overrides)
        if cfg.lora is None:
            raise ConfigError("dsv3.lora: load_frozen_base loads a base for LoRA; the config has no lora section")
        run = lora_model_config(cfg)  # lora.mtp "off": no MTP modules, the release's MTP layer is not read
        L = cfg.model.num_hidden_layers
        shape = cfg
        if cfg.lora.mtp == "off":  # nothing of MTP is built: check the release's MTP tensors against its own depth
            d = cfg.to_dict()
            d["mtp"]["depth"] = _config_of(reader, {}).mtp.depth
            shape = DSv3Config.from_block(d)
        plan, _ = _reader_plan(reader, _state_shapes(shape), L)  # names and shapes against the config, headers only
        if reader.is_quantized() and not cfg.fp8.enabled:
            raise ConfigError(
                f"dsv3.fp8.enabled: {reader.path} is an FP8 release; LoRA keeps its base in FP8 and computes with "
                "FP8 GEMMs, so set fp8.enabled = true (or convert the release to BF16 first)"
            )
        if cfg.fp8.enabled and reader.is_quantized() and reader.block != (TILE, TILE):
            raise CheckpointError(
                f"{reader.config_path}: quantization_config.weight_block_size {list(reader.block)}: the frozen FP8 "
                f"base needs the release's {TILE}x{TILE} blocks"
            )
        layout = layout or RankLayout.of(run, pp=1, ep=1)

        def prepare(model):
            if cfg.fp8.enabled:
                freeze_fp8(model, cfg.fp8, device)

        model = build_rank_local(run, layout, dtype, device, init=False, transforms=False, prepare=prepare)
        # the frozen FP8 buffers are not persistent (not in state_dict): look tensors up by name
        state = dict(model.named_buffers(remove_duplicate=False))
        state.update(model.named_parameters(remove_duplicate=False))
        er = layout.expert_range if layout.ep > 1 else None
        for name, native, expert in plan:
            if run.mtp.depth == 0 and native.startswith("mtp."):
                continue  # checked against the config above, not built
            dst = state[native]
            if dst.is_meta:
                continue  # another rank's tensor: never read
            sdst = state.get(native + SCALE_SUFFIX) if dst.dtype == FP8_DTYPE else None
            if expert is not None:
                if er is not None and expert not in er:
                    continue  # another EP rank's expert
                row = expert - (er.start if er is not None else 0)
                dst, sdst = dst[row], None if sdst is None else sdst[row]
            _load_tensor(reader, name, dst, sdst, cfg.fp8.pow2_scales)
        bytes_read = reader.bytes_read
    apply_transforms(model, run, device=device)  # frozen FP8 storage kept as loaded; LoRA; recompute
    model.base_fingerprint = base_fingerprint(path)
    model.base_path = os.path.abspath(os.fspath(path))  # recorded with the adapters (export finds the base)
    model.checkpoint_bytes_read = bytes_read
    return model
