"""The plugin's FP8 (DeepSeek-V3 report §3.3: E4M3, 1×128 activation tiles, 128×128 weight blocks, FP32 promotion
every 128) in a `pretrain_gpt` run, experts included.

Two steps, both called by `pretrain_gpt`: `resolve_fp8_args(args, ...)` reconciles Megatron's `--fp8-format` /
`--fp8-recipe` with the dsv3 block's `fp8` section into one `FP8Config` before any rank builds the model (recipes
the plugin's layers cannot run are refused naming the flag); `install_fp8(chunk, args, fp8)` applies the one conversion
of `dsv3 train` (`training.transforms.convert_to_fp8`) to every model chunk after its weights are built or loaded:
MLA projections, dense and shared MLPs and routed experts go to FP8; embedding, head, MTP's `eh_proj`, routers and
norms stay in high precision. Megatron's parallel linears get the kernel seam of `model.kernels` through their own
`_forward_impl` hook, keeping their class's behaviour, parameters and `sharded_state_dict`.

Design notes: docs/design_notes.md#megatron-fp8
"""

from __future__ import annotations

import os

import torch

from dsv3_plugin.config import ConfigError, DSv3Config, FP8Config
from dsv3_plugin.megatron.flags import flag_name, flag_setting
from dsv3_plugin.model.kernels import PlainLinearKernel, UsesKernel, base_kernel, rebase
from dsv3_plugin.parallel.dispatch import FP8Codec
from dsv3_plugin.parallel.expert_parallel import ExpertParallelMoE
from dsv3_plugin.precision.fp8.linear import Fp8LinearKernel, Fp8Report, select_backend
from dsv3_plugin.training.transforms import convert_to_fp8

__all__ = [
    "resolve_fp8_args",
    "install_fp8",
    "convert_chunk_to_fp8",
    "fp8_summary",
    "MegatronLinearSeam",
    "seam_parallel_linears",
    "MEGATRON_RECIPES",
]

# Megatron's --fp8-recipe -> the plugin's `dsv3.fp8.recipe` (None: refused, with the reason)
MEGATRON_RECIPES = {
    "blockwise": ("blockwise", None),
    "tensorwise": ("tensorwise", None),
    "delayed": (None, "delayed scaling (per-tensor scales from an amax history) is not the plugin's recipe"),
    "mxfp8": (None, "MXFP8 (32-element blocks, E8M0 scales, Blackwell) is not the plugin's recipe"),
    "custom": (None, "a custom TE recipe factory cannot drive the plugin's layers"),
}
_HOW = "use --fp8-format e4m3 --fp8-recipe blockwise (DeepSeek-V3's recipe) or tensorwise"


def _block_sets_fp8(cfg: DSv3Config) -> bool:
    return "fp8" in cfg.model_fields_set and "enabled" in cfg.fp8.model_fields_set


def resolve_fp8_args(
    args, parser, explicit: set[str], cfg: DSv3Config, where: str, on_cpu: bool
) -> tuple[list[str], FP8Config]:
    """Reconcile Megatron's FP8 flags with the dsv3 block's `fp8`; set `args.dsv3_fp8` (the `FP8Config` the plugin's
    layers run as plain values, or None) and `args.dsv3_fp8_te` (the TE layers run Megatron's own TE FP8). Call
    after `adapt_to_cpu` (which settles `--transformer-impl`) and before Megatron's `validate_args`.

    Args:
        args: Megatron-LM's parsed arguments.
        parser: the parser (for flag names in messages).
        explicit: the argument dests the command line set.
        cfg: the dsv3 config of the run.
        where: where the block came from (for messages).
        on_cpu: no CUDA on this machine.

    Returns:
        (notes to print (a mapped recipe; empty when nothing was mapped), the `FP8Config` the plugin's layers run:
        `enabled` False when FP8 is off).

    Raises:
        ConfigError: a contradiction between the flags and the block (naming both), a recipe or format the
            plugin's layers cannot run, TP > 1 with FP8, a backend that cannot run here.
    """
    args.dsv3_fp8, args.dsv3_fp8_te = None, False
    fmt = getattr(args, "fp8", None)
    recipe_flag = getattr(args, "fp8_recipe", None)
    recipe_explicit = "fp8_recipe" in explicit
    block_on = cfg.fp8.enabled
    if fmt is None and not block_on:
        return [], cfg.fp8  # FP8 off on both sides (a lone --fp8-recipe does nothing in Megatron either)
    notes = []
    fp8 = cfg.fp8
    if fmt is not None:
        fmt_flag = flag_setting(parser, "fp8", fmt)
        if fmt != "e4m3":
            raise ConfigError(
                f"{fmt_flag}: the plugin's FP8 is E4M3 in forward and backward (DeepSeek-V3 §3.3; 'hybrid' puts "
                f"gradients in E5M2); {_HOW}"
            )
        if _block_sets_fp8(cfg) and not block_on:
            raise ConfigError(
                f"{fmt_flag}: contradicts {where} dsv3.fp8.enabled = False; drop the flag or enable FP8 in the block"
            )
        rflag = flag_setting(parser, "fp8_recipe", recipe_flag)
        ours, why = MEGATRON_RECIPES.get(recipe_flag, (None, f"unknown recipe {recipe_flag!r}"))
        if ours is None:
            said = rflag if recipe_explicit else f"{fmt_flag} without {flag_name(parser, 'fp8_recipe')} ({rflag})"
            raise ConfigError(f"{said}: {why}; {_HOW}")
        if block_on and "recipe" in fp8.model_fields_set and fp8.recipe != ours:
            raise ConfigError(
                f"{rflag}: contradicts {where} dsv3.fp8.recipe = {fp8.recipe!r}; drop the flag or change the block"
            )
        if ours == "tensorwise":
            notes.append(
                f"{fmt_flag} {rflag}: the plugin's layers run dsv3.fp8.recipe = 'tensorwise' (one current scale per "
                "tensor, E4M3) — not DeepSeek-V3's 1x128 / 128x128 recipe"
            )
        fp8 = fp8.model_copy(update={"enabled": True, "recipe": ours})
    elif recipe_explicit and MEGATRON_RECIPES.get(recipe_flag, (None, ""))[0] != fp8.recipe:
        raise ConfigError(
            f"{flag_setting(parser, 'fp8_recipe', recipe_flag)}: contradicts {where} dsv3.fp8.recipe = "
            f"{fp8.recipe!r}; drop the flag or change the block"
        )
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp > 1:
        raise ConfigError(
            f"{flag_setting(parser, 'tensor_model_parallel_size', tp)}: the plugin's FP8 layers run at tensor "
            "parallel size 1 only (drop FP8 or the flag)"
        )
    te = getattr(args, "transformer_impl", "local") == "transformer_engine"
    if not te:
        for dest in ("fp8_param_gather", "first_last_layers_bf16"):
            if getattr(args, dest, False):
                raise ConfigError(
                    f"{flag_name(parser, dest)}: a Transformer Engine FP8 option; with "
                    "--transformer-impl local every decoder layer runs the plugin's FP8 (drop the flag)"
                )
        # the plugin's backend must be able to run here (a forced one that cannot is refused before any rank builds)
        if on_cpu:
            select_backend(fp8, "cpu")
        # Megatron's own FP8 machinery (TE contexts, FP8 buffers) stays off: the plugin's layers carry the FP8
        args.fp8 = None
    else:
        if on_cpu:
            raise ConfigError("--transformer-impl transformer_engine: Transformer Engine layers need CUDA")
        # the TE layers run Megatron's own FP8 with the same recipe; the plugin's layers run ours
        args.fp8, args.fp8_recipe, args.dsv3_fp8_te = "e4m3", fp8.recipe, True
    # plain values: Megatron saves `args` in its checkpoints, and --load reads them without unpickling classes
    args.dsv3_fp8 = fp8.model_dump()
    return notes, fp8


class MegatronLinearSeam(UsesKernel):
    """Mixin for Megatron's `ColumnParallelLinear` / `RowParallelLinear`: their GEMM (`_forward_impl`, which both
    call with the input, the weight and the bias to add) runs through `self.kernel`. TP = 1 only: Megatron's
    tensor-parallel all-reduce of the input gradient and sequence parallelism are refused, not skipped."""

    def _forward_impl(self, input, weight, bias=None, *args, **kwargs):
        if kwargs.get("allreduce_dgrad") or kwargs.get("sequence_parallel"):
            raise ValueError(
                f"{type(self).__name__}: the kernel seam runs at tensor parallel size 1 without sequence parallelism"
            )
        return self.kernel(input, weight, bias)


_SEAM_CLASSES: dict[type, type] = {}


def _seam_class(cls: type) -> type:
    """`cls` with `MegatronLinearSeam` in front (one class per Megatron class, so pickling / isinstance stay sane)."""
    if issubclass(cls, MegatronLinearSeam):
        return cls
    if cls not in _SEAM_CLASSES:
        _SEAM_CLASSES[cls] = type(f"Kernel{cls.__name__}", (MegatronLinearSeam, cls), {"__module__": __name__})
    return _SEAM_CLASSES[cls]


def seam_parallel_linears(model) -> list[str]:
    """Give the kernel seam (`PlainLinearKernel`: the same GEMMs as Megatron's `_forward_impl` at TP = 1) to every
    Megatron `ColumnParallelLinear` / `RowParallelLinear` of `model` that owns its weight and has no seam yet (the
    MLA projections of the local spec, the output head, MTP's `eh_proj`; FP8 runs already gave the MLA projections
    theirs), in place, so that the W split defers their weight gradients as `dsv3 train` does for every Linear.
    An output head tied to the embedding (its weight passed at call time) and Transformer Engine's modules keep
    Megatron's own backward.

    Args:
        model: a Megatron model chunk (`GPTModel`).

    Returns:
        The names of the linears that got the seam.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    done = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) or isinstance(mod, MegatronLinearSeam):
            continue
        if mod.weight is None:  # tied output head: the embedding's weight arrives at call time
            continue
        mod.__class__ = _seam_class(type(mod))
        mod.kernel = PlainLinearKernel()
        done.append(name)
    return done


def _is_te_module(mod) -> bool:
    mod_name = type(mod).__module__
    return mod_name.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))


def _megatron_module(te_names: list[str]):
    """`convert_to_fp8`'s hook for Megatron's own modules (see its `framework_module`)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    def handle(name, mod, inside, recipe, backend, rep: Fp8Report) -> bool:
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
            if not inside:
                rep.high_precision.append(name)  # output head, MTP eh_proj
                return True
            if mod.weight is None:
                raise ValueError(f"install_fp8: {name} takes its weight at call time; it cannot be put on FP8")
            if isinstance(mod, MegatronLinearSeam):
                if not isinstance(base_kernel(mod.kernel), Fp8LinearKernel):
                    mod.kernel = rebase(mod.kernel, Fp8LinearKernel(recipe, backend))
            else:
                mod.__class__ = _seam_class(type(mod))
                mod.kernel = Fp8LinearKernel(recipe, backend)
            rep.converted.append(name)
            return True
        if isinstance(mod, VocabParallelEmbedding):
            rep.high_precision.append(name)
            return True
        if _is_te_module(mod) and "Linear" in type(mod).__name__:
            # Megatron's fp8 context runs it (inside a layer; MTP's eh_proj too: Megatron wraps the MTP layer)
            te_names.append(name)
            return True
        return False

    return handle


def convert_chunk_to_fp8(model, cfg: FP8Config, device=None) -> tuple[Fp8Report, list[str]]:
    """Put one Megatron `GPTModel` chunk (our layer spec) on the plugin's FP8 path, in place: the one conversion of
    `dsv3 train` (`convert_to_fp8`) with Megatron's `TransformerLayer` as the decoder layer; with EP > 1 and
    `cfg.dispatch` the all-to-all payload becomes FP8 too.

    Args:
        model: the chunk (a `GPTModel`, or any module holding Megatron `TransformerLayer`s with `DSv3FFN`s).
        cfg: the FP8 settings (`enabled` is not read).
        device: where the GEMMs run (default: the first parameter's device).

    Returns:
        (the `Fp8Report`, the names of Transformer Engine linears left to Megatron's own FP8 context).
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    te_names: list[str] = []
    rep = convert_to_fp8(
        model, cfg, device, layer_types=(TransformerLayer,), framework_module=_megatron_module(te_names)
    )
    if cfg.dispatch:
        codec = FP8Codec()  # what `fp8.dispatch` selects (`dispatch.codec_from_config`)
        for m in model.modules():
            if isinstance(m, ExpertParallelMoE):
                m.codec = codec
    return rep, te_names


def fp8_summary(rep: Fp8Report, te_names: list[str], te_scales: str = "") -> str:
    """One line: what runs in FP8 (and on which backend), what stays in high precision.

    Args:
        rep: the report of `convert_chunk_to_fp8`.
        te_names: the TE linears left to Megatron's fp8 context.
        te_scales: how TE scales them (printed when `te_names` is not empty).

    Returns:
        The line (without a prefix).
    """
    mla = [n for n in rep.converted if ".self_attention." in n]
    mlp = [n for n in rep.converted if ".mlp." in n]
    recipe = (
        "DeepSeek-V3 blockwise: E4M3, 1x128 activation tiles, 128x128 weight blocks, FP32 promotion every 128"
        if rep.recipe == "blockwise"
        else "tensorwise: E4M3, one current scale per tensor"
    )
    parts = []
    if te_names:
        other = [n for n in te_names if ".self_attention." not in n]
        more = f" (and the TE linears {', '.join(other)})" if other else ""
        parts.append(
            f"{len(te_names) - len(other)} MLA projections by Transformer Engine under Megatron's fp8 context"
            f"{te_scales}{more}"
        )
    if mla:
        parts.append(f"{len(mla)} MLA projections")
    parts.append(f"{len(mlp)} dense / shared-expert MLP linears (SwiGLU inputs cached in FP8)")
    parts.append(f"{len(rep.grouped)} routed-expert groups" + (" with FP8 dispatch" if rep.dispatch else ""))
    hp = rep.high_precision
    kept = [
        f"{sum('embedding' in n for n in hp)} embedding",
        f"{sum(n.endswith('output_layer') for n in hp)} output head",
        f"{sum('eh_proj' in n for n in hp)} MTP eh_proj",
        f"{sum(n.endswith('.gate') for n in hp)} routers",
        "norms, attention core",
    ]
    pow2 = ", power-of-2 scales" if rep.pow2_scales else ""
    return (
        f"FP8 ({recipe}{pow2}) on {'; '.join(parts)}; plugin backend {rep.backend} ({rep.reason}); "
        f"high precision: {', '.join(kept)}"
    )


def _te_scales(recipe: str) -> str:
    """How Megatron's TE recipe for `--fp8-recipe` scales (megatron.core.fp8_utils.get_fp8_recipe builds it with the
    format only, so TE's defaults apply)."""
    if recipe != "blockwise":
        return " (Megatron's Float8CurrentScaling: one current scale per tensor)"
    fp32 = os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") not in ("", "0")
    return (
        " (Megatron's Float8BlockScaling: FP32 scales, NVTE_FP8_BLOCK_SCALING_FP32_SCALES set)"
        if fp32
        else " (Megatron's Float8BlockScaling: TE's default power-of-2 scales)"
    )


def install_fp8(model, args, fp8: FP8Config) -> Fp8Report | None:
    """Put a freshly built (and `--dsv3-init-from`-loaded) model chunk on the FP8 path `resolve_fp8_args` chose;
    nothing when it chose none. Rank 0 prints what runs for its first chunk.

    Args:
        model: the chunk `model_provider` built.
        args: Megatron's arguments (after `resolve_fp8_args`).
        fp8: the FP8 settings `resolve_fp8_args` returned (the run's `DSv3Config.fp8`); `enabled` False: none.

    Returns:
        The `Fp8Report`, or None without FP8.
    """
    if not fp8.enabled:
        return None
    rep, te_names = convert_chunk_to_fp8(model, fp8)
    te = getattr(args, "dsv3_fp8_te", False)
    if te and not te_names:
        raise ConfigError(
            "--transformer-impl transformer_engine: the layer spec built no Transformer Engine linears, so nothing "
            "would run Megatron's FP8 for the attention (pass --transformer-impl local for the plugin's FP8 there)"
        )
    config = getattr(model, "config", None)
    if te and config is not None:
        # Megatron enters its fp8 context around each layer (and the MTP layer) when the chunk's config says so,
        # read at every forward; the config built from the dsv3 block may not carry Megatron's FP8 flags
        config.fp8, config.fp8_recipe = args.fp8, args.fp8_recipe
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0 and not getattr(args, "_dsv3_fp8_printed", False):
        args._dsv3_fp8_printed = True
        print(f"dsv3_plugin: {fp8_summary(rep, te_names, _te_scales(fp8.recipe) if te_names else '')}", flush=True)
    return rep
