"""`RunConfig`: one run's configuration, parsed and validated once where the process starts.

A DeepSpeed JSON (a path, a dict, or the built-in `ds_config.json`) is read once, the command line's overrides
(`RunOverrides`: --data / --valid-data / --tokenizer, the --init-from checkpoint's shape, --exit-after-minutes)
are written into its "dsv3" block, and `validate_ds_config` checks the whole (with `dsv3.lora`, `lora_base_rules`
too: a release to train on, FP8 kept FP8): the result holds DeepSpeed's keys and the typed `DSv3Config` side by
side. It is picklable: `dsv3 train --nproc N` hands it to the ranks it spawns, and the engine, the model builders,
the data and the loop take it (or its `cfg`) as it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from dsv3_plugin.checkpoint.init_from import init_from_config, with_model_shape
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.config import ConfigError, DSv3Config, check_ds_dict, read_ds_json
from dsv3_plugin.deepspeed.config_keys import check_deepspeed_keys, resolve_batch
from dsv3_plugin.deepspeed.validate import (
    check_layout,
    check_memory,
    deepspeed_path_rules,
    lora_rules,
    pipeline_microbatch_rule,
)
from dsv3_plugin.training.lora import lora_model_config
from dsv3_plugin.training.memory_estimate import MemoryEstimate
from dsv3_plugin.training.run_rules import with_data_flags

__all__ = [
    "RunConfig",
    "RunOverrides",
    "validate_ds_config",
    "lora_base_rules",
    "DEFAULT_DS_CONFIG_PATH",
    "default_ds_config",
]

# What `dsv3 train` runs with no --config (package data; examples/deepspeed/ds_config.json is a copy of it).
DEFAULT_DS_CONFIG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")


def default_ds_config() -> dict:
    """The built-in DeepSpeed JSON (`tiny` preset, ZeRO-1, AdamW, WarmupLR) as a new dict."""
    return read_ds_json(DEFAULT_DS_CONFIG_PATH)


@dataclass(kw_only=True)
class RunOverrides:
    """What the command line writes into the "dsv3" block before it is validated (`dsv3 train`'s flags)."""

    data: list[str] | None = None  # --data: dsv3.train.data.train
    valid_data: list[str] | None = None  # --valid-data: dsv3.train.data.valid
    tokenizer: str | None = None  # --tokenizer: dsv3.train.data.tokenizer
    init_from: str | None = None  # --init-from: the model's shape from the checkpoint's config.json
    exit_after_minutes: float | None = None  # --exit-after-minutes: dsv3.train.exit_after_minutes

    def apply(self, raw: dict) -> dict:
        """`raw` (a DeepSpeed JSON dict of one's own) with the overrides written into its "dsv3" block."""
        raw = with_data_flags(raw, self.data, self.valid_data, self.tokenizer)
        if self.exit_after_minutes is not None and isinstance(raw["dsv3"].setdefault("train", {}), dict):
            raw["dsv3"]["train"]["exit_after_minutes"] = self.exit_after_minutes
        if self.init_from:
            raw = init_from_config(raw, self.init_from)
        return raw


@dataclass(frozen=True)
class RunConfig:
    """A validated run: DeepSpeed's keys and the "dsv3" block, typed.

    Attributes:
        ds: DeepSpeed's part (no "dsv3"), normalised: zero stage and clipping explicit, and the batch triple
            resolved when the world size is known. What `deepspeed.initialize` is given.
        cfg: the validated "dsv3" block, overrides included.
        target: "train" (`dsv3 train`'s rules) or "engine" (`dsv3_plugin.deepspeed.initialize`'s).
        world_size: the world the rules were checked for (None: not checked).
        memory: the host-memory estimate (None: not checked).
    """

    ds: dict
    cfg: DSv3Config
    target: Literal["train", "engine"] = "train"
    world_size: int | None = None
    memory: MemoryEstimate | None = None

    @classmethod
    def load(
        cls,
        config: str | os.PathLike | dict | None = None,
        *,
        overrides: RunOverrides | None = None,
        target: Literal["train", "engine"] = "train",
        world_size: int | None = None,
        ranks_on_host: int | None = None,
        host_memory: int | None = None,
        model_shape: DSv3Config | None = None,
    ) -> RunConfig:
        """Read (once), apply the overrides, validate (once).

        Args:
            config: a DeepSpeed JSON path, or a parsed dict (not changed), with a "dsv3" block; None: the built-in
                `ds_config.json`.
            overrides: the command line's (`RunOverrides`, or a `TrainRequest`, which is one).
            target, world_size, ranks_on_host, host_memory: as `deepspeed.validate.validate_ds_config`.
            model_shape: a built model's config: its `model` / `moe` / `mtp` fill the block (the JSON need not
                repeat them; keys it gives must then agree with the model).

        Returns:
            The `RunConfig`.

        Raises:
            ConfigError / CheckpointError: naming the key, the flag or the file.
        """
        if config is None:
            raw = default_ds_config()
        elif isinstance(config, dict):
            raw = check_ds_dict(config)
        else:
            raw = read_ds_json(config)
        if overrides is not None:
            raw = overrides.apply(raw)
        if model_shape is not None:
            raw = with_model_shape(raw, model_shape, keep_user_model_keys=True)
        run = validate_ds_config(
            raw, target=target, world_size=world_size, ranks_on_host=ranks_on_host, host_memory=host_memory
        )
        if target == "train" and run.cfg.lora is not None:
            lora_base_rules(run.cfg, overrides.init_from if overrides is not None else None)
        return run

    @property
    def micro_batch(self) -> int:
        """train_micro_batch_size_per_gpu (resolved for `world_size`)."""
        return self.ds["train_micro_batch_size_per_gpu"]

    @property
    def gas(self) -> int:
        """gradient_accumulation_steps (resolved for `world_size`)."""
        return self.ds.get("gradient_accumulation_steps", 1)


def lora_base_rules(cfg: DSv3Config, init_from: str | None) -> None:
    """`dsv3 train` with `dsv3.lora`: the adapters train on a released base (`--init-from`), and an FP8 release
    stays FP8 (`fp8.enabled`: the frozen base computes with its FP8 GEMMs). Reads the release's headers only."""
    if not init_from:
        raise ConfigError("dsv3.lora: LoRA trains adapters on a released base: pass --init-from DIR")
    with CheckpointReader(init_from) as reader:
        quantized = reader.is_quantized()
    if quantized and not cfg.fp8.enabled:
        raise ConfigError(
            f"dsv3.fp8.enabled: --init-from {init_from} is an FP8 release; LoRA keeps its base in FP8 and computes "
            "with FP8 GEMMs, so set fp8.enabled = true (or convert the release to BF16 first)"
        )


def validate_ds_config(
    config: str | os.PathLike | dict,
    *,
    target: Literal["train", "engine"] = "train",
    world_size: int | None = None,
    ranks_on_host: int | None = None,
    host_memory: int | None = None,
) -> RunConfig:
    """Validate a DeepSpeed JSON (path or dict, not changed) with a "dsv3" block; see the module docstring for the
    order. Overrides go in first: `RunConfig.load` is the entry point that applies them.

    target: "train" adds what `dsv3 train` needs on this machine; "engine" is `deepspeed.initialize`'s view.
    world_size: total ranks (None: the world-size rules are skipped).
    ranks_on_host, host_memory: ranks sharing this host and its memory in bytes (None: no memory check).
    Returns a `RunConfig`; raises `ConfigError` naming the key (or the file) otherwise.
    """
    if target not in ("train", "engine"):
        raise ValueError(f"validate_ds_config: target must be 'train' or 'engine' (got {target!r})")
    raw = check_ds_dict(config) if isinstance(config, dict) else check_ds_dict(read_ds_json(config))
    cfg = DSv3Config.from_block(raw.pop("dsv3"))
    ds = check_deepspeed_keys(raw, train=target == "train")
    deepspeed_path_rules(cfg, ds)
    lora_rules(cfg)
    cfg = lora_model_config(cfg)  # lora.mtp "off": no MTP modules; the layout, memory and model are built from it
    dp = check_layout(cfg, target=target, world_size=world_size)
    gas = resolve_batch(ds, dp)
    if gas is not None:
        pipeline_microbatch_rule(cfg, gas)
    memory = None
    if host_memory is not None:
        memory = check_memory(cfg, ds, world_size or 1, ranks_on_host or world_size or 1, host_memory)
    return RunConfig(ds=ds, cfg=cfg, target=target, world_size=world_size, memory=memory)
