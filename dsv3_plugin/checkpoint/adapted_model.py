"""A released base with LoRA adapters applied, not merged, for decoding (`dsv3 generate --adapter`).

The adapters come from a PEFT adapter directory (`peft_adapter.read_peft_adapter`) or a `dsv3 train` LoRA run's
checkpoint (`run_checkpoint.run_lora`: base fingerprint checked, a trained routing bias taken over). The model is
the base's `DSv3Model` (`hf.load_pretrained`) with `training.lora.apply_lora`'s adapters, their values copied in:

    y = W x + s · B (A x)        (Hu et al. 2021), s = alpha / r (alpha / sqrt(r) with use_rslora)

which decodes as the merged checkpoint W' = W + s·B·A (`lora_merge`) does, up to the rounding of the merge.
"""

from __future__ import annotations

import os

import torch

from dsv3_plugin.checkpoint.hf import load_pretrained, pretrained_config
from dsv3_plugin.checkpoint.peft_adapter import ADAPTER_CONFIG, read_peft_adapter
from dsv3_plugin.checkpoint.run_checkpoint import find_run_checkpoint, run_config, run_lora
from dsv3_plugin.checkpoint.sources import lora_base
from dsv3_plugin.config import DSv3Config, LoRAConfig
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.training.lora import adapter_names, apply_lora

__all__ = ["read_adapters", "load_adapted"]


def read_adapters(
    adapter: str | os.PathLike, base: str | os.PathLike, cfg: DSv3Config
) -> tuple[dict[str, torch.Tensor], LoRAConfig, dict[str, torch.Tensor]]:
    """The adapters of `adapter` (a PEFT adapter directory or a LoRA run directory / its ckpt/ / a tag) for the
    released base `base` whose config is `cfg`.

    Returns:
        (adapters {native name: FP32 tensor} (`lora_names`), their LoRAConfig, trained routing biases
        {native name: FP32 tensor} (a run with `lora.bias_update`; else empty)).

    Raises:
        CheckpointError: neither kind; PEFT target names or shapes that are not the base's; a run trained on
            another base (its recorded fingerprint differs from `base`'s) or on another model shape.
    """
    src = os.path.abspath(os.fspath(adapter))
    if not os.path.isdir(src):
        raise CheckpointError(f"--adapter {src}: no such directory")
    if os.path.isfile(os.path.join(src, ADAPTER_CONFIG)):
        adapters, lora = read_peft_adapter(src, cfg)  # names, shapes and the LoRA config against the base's
        return adapters, lora, {}
    run = find_run_checkpoint(src)
    if run is None:
        raise CheckpointError(
            f"--adapter {src}: neither a PEFT adapter directory (no {ADAPTER_CONFIG}) nor a dsv3 train LoRA run"
        )
    run_cfg, sd0 = run_config(run)
    lo = run_lora(run, run_cfg, sd0)
    if lo is None:
        raise CheckpointError(f"--adapter {src}: a dsv3 train run without LoRA (its config has no dsv3.lora section)")
    if _shape(run_cfg) != _shape(cfg):
        raise CheckpointError(f"--adapter {src}: trained on another model shape than --model {base}")
    lora_base(lo, base, run.path, flag="--model")  # the fingerprint the run recorded must be --model's
    return lo.adapters, lo.lora, lo.router_bias


def _shape(cfg: DSv3Config) -> dict:
    """The model's shape (its released config.json's fields), what adapters must agree on; the MTP depth left out
    (adapters sit on the decoder layers; a LoRA run under `lora.mtp` "off" may record depth 0)."""
    skip = ("torch_dtype", "quantization_config", "num_nextn_predict_layers")
    return {k: v for k, v in cfg.to_hf().items() if k not in skip}


@torch.no_grad()
def load_adapted(
    base: str | os.PathLike,
    adapter: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    allow_non_finite: bool = False,
) -> DSv3Model:
    """The base's `DSv3Model` (`load_pretrained`, eval mode) with `adapter`'s LoRA adapters applied, unmerged.

    Args:
        base: a released-format directory (--model); adapter: as for `read_adapters`.
        dtype, device, allow_non_finite: as for `load_pretrained` (the adapters are cast to `dtype`).

    Returns:
        The model (frozen; `lora_report` set).

    Raises:
        CheckpointError: as `read_adapters`, or adapters that are not exactly the ones their config places.
    """
    # the adapters first (headers and small files): a wrong adapter is refused before the base is read
    adapters, lora, bias = read_adapters(adapter, base, pretrained_config(base))
    model = load_pretrained(base, dtype=dtype, device=device, allow_non_finite=allow_non_finite)
    # NOTE: decoding has no MTP loss: `lora.mtp` only decides whether training built MTP modules; the adapters sit
    # on the decoder layers either way, and the base's MTP module (kept for --speculative) stays frozen.
    d = model.cfg.to_dict()
    d["lora"] = {**lora.model_dump(), "mtp": "frozen", "dropout": 0.0}
    apply_lora(model, DSv3Config.from_block(d), dtype)
    have = set(adapter_names(model))
    if have != set(adapters):
        missing, extra = sorted(have - set(adapters)), sorted(set(adapters) - have)
        raise CheckpointError(f"--adapter {adapter}: adapters missing {missing[:3]}, not in the model {extra[:3]}")
    params = dict(model.named_parameters())
    for n, t in adapters.items():
        if tuple(params[n].shape) != tuple(t.shape):
            raise CheckpointError(f"--adapter {adapter}: {n} has shape {list(t.shape)}, the model's {params[n].shape}")
        params[n].copy_(t)
    buffers = dict(model.named_buffers())
    for n, t in bias.items():
        if n not in buffers or tuple(buffers[n].shape) != tuple(t.shape):
            raise CheckpointError(f"--adapter {adapter}: routing bias {n} does not fit the model")
        buffers[n].copy_(t)
    return model.eval()
