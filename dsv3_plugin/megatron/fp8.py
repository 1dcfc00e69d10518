"""FP8 in a `pretrain_gpt` run: which FP8 path the Megatron flags (`--fp8-format`, `--fp8-recipe`) and the dsv3
block's `fp8` section ask for, checked before any rank builds the model.

`resolve_fp8_args` records the decision on `args` (`args.dsv3_fp8`: the `FP8Config` to run, or None); the model
builder reads it (`install_fp8`).
"""

from __future__ import annotations

from dsv3_plugin.config import ConfigError, DSv3Config
from dsv3_plugin.megatron.flags import flag_name

__all__ = ["resolve_fp8_args", "install_fp8"]


def resolve_fp8_args(args, parser, explicit: set[str], cfg: DSv3Config, where: str, on_cpu: bool) -> list[str]:
    """Check the FP8 flags against the block; set `args.dsv3_fp8`. Returns notes to print.

    Args:
        args: Megatron-LM's parsed arguments (before `validate_args`).
        parser: the parser (for flag names in messages).
        explicit: the argument dests the command line set.
        cfg: the dsv3 config of the run.
        where: where the block came from (for messages).
        on_cpu: no CUDA on this machine.

    Returns:
        Lines saying what runs in FP8.
    """
    if cfg.fp8.enabled:
        raise ConfigError(
            f"{where} dsv3.fp8.enabled: the plugin's FP8 path runs under `dsv3 train`/DeepSpeed; with "
            "Megatron use its Transformer Engine recipes (--fp8-format e4m3 --fp8-recipe blockwise)"
        )
    if on_cpu and getattr(args, "fp8", None):
        raise ConfigError(f"{flag_name(parser, 'fp8')}: not on CPU (FP8 runs through Transformer Engine on GPUs)")
    args.dsv3_fp8 = None
    return []


def install_fp8(model, args) -> None:
    """Put a freshly built model chunk on the FP8 path `resolve_fp8_args` chose (nothing when it chose none)."""
    if getattr(args, "dsv3_fp8", None) is not None:
        raise ConfigError("dsv3 fp8: not available under pretrain_gpt yet")
