"""Model transforms, applied in one place and in one order: FP8 → LoRA → recompute → expert parallelism → W-split.

`DSv3Model(cfg)` builds the plain model (report §2); what changes *how* it computes is applied here, in place:
  1. FP8 (report §3.3): decoder-layer Linears `Fp8Linear`, routed experts `Fp8ExpertKernel`, SwiGLUs
     `Fp8SwiGLUAct`; with `dsv3.lora` the frozen base is stored in FP8 instead (`precision.fp8.frozen`);
  2. LoRA (`dsv3.lora`, `training.lora`): everything frozen, adapters attached through the kernel seams;
  3. recompute (report §3.2.3): RMSNorm and MLA up-projections recomputed in backward (`training.recompute`);
  4. expert parallelism (report §3.2.2): done by the caller owning the process groups (`parallel.expert_parallel`);
  5. weight-gradient split (report §3.2.1): every kernel seam wrapped in `DeferredWeightGrads` (frozen GEMMs have
     no W; LoRA's adapters do). State_dict keys of the base never change, so checkpoints load before or after.
FP8 replaces the innermost kernel, LoRA wraps it and the W split wraps whatever is there (see `model.kernels`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv3_plugin.config import DSv3Config, FP8Config
from dsv3_plugin.model.kernels import KernelLinear, base_kernel, rebase
from dsv3_plugin.model.moe.layer import DenseMLP, GroupedExperts
from dsv3_plugin.model.transformer import DecoderLayer, DSv3Model
from dsv3_plugin.parallel.pipeline.weight_grad import split_weight_grads
from dsv3_plugin.precision.fp8.experts import Fp8ExpertKernel, Fp8SwiGLUAct
from dsv3_plugin.precision.fp8.frozen import freeze_fp8
from dsv3_plugin.precision.fp8.linear import AutoBackend, Fp8Linear, Fp8LinearKernel, Fp8Recipe, Fp8Report
from dsv3_plugin.training.lora import apply_lora, lora_model_config
from dsv3_plugin.training.recompute import apply_recompute

__all__ = ["build_model", "apply_transforms", "convert_to_fp8"]


def build_model(cfg: DSv3Config) -> DSv3Model:
    """`DSv3Model(cfg)` with the transforms its config asks for (`fp8.enabled`, `memory.recompute`).

    Args:
        cfg: the validated config (`DSv3Config.from_block`, `load_config`, `DSv3Config.from_hf`).

    Returns:
        The model (FP32 parameters, initialised from the config's seed), transformed in place: with FP8 its
        decoder-layer Linears are `Fp8Linear` and its routed experts run `Fp8ExpertKernel`; with recompute its
        norms / MLA up-projections (or whole layers) are recomputed in backward. Parameter names are unchanged.
        With `lora`: the frozen base (FP8 storage with `fp8.enabled`) with adapters, built from
        `lora_model_config(cfg)` (no MTP modules under `lora.mtp` "off").
    """
    cfg = lora_model_config(cfg)  # lora.mtp "off": no MTP modules
    return apply_transforms(DSv3Model(cfg), cfg)


def apply_transforms(
    model: nn.Module, cfg: DSv3Config, *, split_w: bool = False, device: torch.device | str | None = None
) -> nn.Module:
    """Apply, in place and in order, FP8 (`cfg.fp8.enabled`; with `cfg.lora` the frozen FP8 base), LoRA
    (`cfg.lora`), recompute (`cfg.memory.recompute`) and, with
    `split_w`, the weight-gradient split. Expert parallelism needs process groups and is applied by the
    framework adapter between recompute and the W split (see the module docstring). `device`: where the GEMMs
    will run (default: the first parameter's; a rank-local model's first parameter may be on `meta`)."""
    if cfg.fp8.enabled and cfg.lora is not None:
        freeze_fp8(model, cfg.fp8, device)  # the frozen base stored in FP8, computed in FP8
    elif cfg.fp8.enabled:
        convert_to_fp8(model, cfg.fp8, device)
    if cfg.lora is not None:
        apply_lora(model, cfg)
    if cfg.memory.recompute != "none":
        apply_recompute(model, cfg.memory.recompute)
    if split_w:
        split_weight_grads(model)
    return model


def convert_to_fp8(
    model: nn.Module,
    cfg: FP8Config,
    device: torch.device | str | None = None,
    *,
    layer_types: tuple[type, ...] = (DecoderLayer,),
    framework_module=None,
) -> Fp8Report:
    """Swap the decoder layers' Linear GEMMs (MLA projections, dense/shared-expert MLPs) for `Fp8Linear`
    and put the routed experts on the FP8 path, in place. The one conversion of every entry point: `dsv3 train`
    calls it on `DSv3Model`, the Megatron adapter on a `GPTModel` chunk (`megatron.fp8.install_fp8`).

    Args:
        model: the model (or one pipeline chunk of it).
        cfg: the FP8 settings (`dsv3.fp8`).
        device: where the GEMMs will run (default: the first parameter's device) — picks the `auto` backend.
        layer_types: the modules that are "decoder layers": GEMMs inside them go to FP8, GEMMs outside (head,
            MTP's `eh_proj`) stay in high precision. Megatron passes its `TransformerLayer`.
        framework_module: optional `(name, module, inside, recipe, backend, report) -> bool` for a framework's
            own GEMM modules (Megatron's parallel linears, its embedding): it converts or records `module` and
            returns True, or returns False to leave it to the walk below.

    Returns:
        The `Fp8Report` (also stored as `model.fp8_report`): what was converted, what was kept in high precision
        and which backend runs the GEMMs.
    """

    recipe = Fp8Recipe.from_config(cfg)
    rep = Fp8Report(backend="auto", reason="", recipe=recipe.kind, pow2_scales=recipe.pow2, dispatch=cfg.dispatch)
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
    backend = AutoBackend(cfg, rep)  # one shared instance: re-resolves if the model moves to another device
    backend.resolve(torch.device(device))
    layer_prefixes = [n for n, m in model.named_modules() if isinstance(m, layer_types)]
    for name, mod in list(model.named_modules()):
        inside = any(name == p or name.startswith(p + ".") for p in layer_prefixes)
        if framework_module is not None and framework_module(name, mod, inside, recipe, backend, rep):
            continue
        if isinstance(mod, nn.Linear) and not inside:
            rep.high_precision.append(name)  # lm_head, MTP eh_proj
        elif type(mod) is nn.Linear:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, Fp8Linear.from_linear(mod, recipe, backend))
            rep.converted.append(name)
        elif isinstance(mod, KernelLinear):  # a seam already installed (e.g. by the W split): keep wrappers
            if not isinstance(base_kernel(mod.kernel), Fp8LinearKernel):
                mod.kernel = rebase(mod.kernel, Fp8LinearKernel(recipe, backend))
            rep.converted.append(name)
        elif isinstance(mod, nn.Linear):
            raise TypeError(
                f"convert_to_fp8: {name} is a {type(mod).__name__} (an nn.Linear subclass without a "
                "kernel seam): it cannot be put on the FP8 path"
            )
        elif isinstance(mod, DenseMLP) and inside:  # its Linears follow in this walk
            mod.act = Fp8SwiGLUAct(recipe)
        elif isinstance(mod, GroupedExperts) and inside:
            mod.kernel = rebase(mod.kernel, Fp8ExpertKernel(recipe, backend, dispatch=cfg.dispatch))
            rep.grouped.append(name)
        elif isinstance(mod, nn.Embedding) or name.endswith(".gate"):
            rep.high_precision.append(name)
    model.fp8_report = rep
    return rep
