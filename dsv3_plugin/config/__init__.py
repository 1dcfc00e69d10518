"""The typed `"dsv3"` configuration block: schema (`schema.py`, `bounds.py`, cross-field `checks.py`, error
wording `messages.py`), presets (`presets.py`), reading (`loading.py`). Every public name is re-exported here:
`from dsv3_plugin.config import DSv3Config`.

Build a config with `DSv3Config.from_block(block)` (a `"dsv3"` dict), `load_config(path)` (a DeepSpeed JSON
file) or `DSv3Config.from_hf(config_json)`; a whole run's config (DeepSpeed keys, CLI overrides) is
`dsv3_plugin.deepspeed.run_config.RunConfig`. Errors are `ConfigError`s led by the dotted key.
"""

from dsv3_plugin.config.checks import lora_targets
from dsv3_plugin.config.loading import check_ds_dict, load_config, read_ds_json, reference_table
from dsv3_plugin.config.presets import PRESETS, deep_merge
from dsv3_plugin.config.schema import (
    LORA_TARGETS,
    ConfigError,
    DataConfig,
    DSv3Config,
    FP8Config,
    LoRAConfig,
    MemoryConfig,
    ModelConfig,
    MoEConfig,
    MTPConfig,
    ParallelConfig,
    RopeScaling,
    ScheduleStep,
    TrainConfig,
    check_numbers,
    json_type,
    schedule_value,
    short_json,
    value_with_type,
)

__all__ = [
    "ConfigError",
    "ScheduleStep",
    "RopeScaling",
    "ModelConfig",
    "MoEConfig",
    "MTPConfig",
    "ParallelConfig",
    "FP8Config",
    "MemoryConfig",
    "LoRAConfig",
    "LORA_TARGETS",
    "lora_targets",
    "DataConfig",
    "TrainConfig",
    "DSv3Config",
    "PRESETS",
    "deep_merge",
    "load_config",
    "read_ds_json",
    "check_ds_dict",
    "schedule_value",
    "reference_table",
    "check_numbers",
    "json_type",
    "value_with_type",
    "short_json",
]
