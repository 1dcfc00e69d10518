"""dsv3-plugin: DeepSeek-V3's training system as a plugin for DeepSpeed and Megatron-Core.

The folders are layers; imports point one way, downward (enforced by tests/unit/test_import_layers.py):
errors, json_input, safe_files, schedule_traits, config < model/ < precision/ < parallel/ < data/ < training/ <
checkpoint/ < deepspeed/, megatron/ (thin adapters, importing their framework lazily) < cli/ (the `dsv3` commands).
The benches live beside the package, in `benchmarks/`.

docs/architecture.md draws the same picture with the data flow; CONTRIBUTING.md lists what each layer holds.
Design notes: docs/design_notes.md#package
"""

from dsv3_plugin.checkpoint.hf import load_pretrained
from dsv3_plugin.config import ConfigError, DSv3Config, load_config
from dsv3_plugin.model.transformer import DSv3Model
from dsv3_plugin.training.rank_local import RankLayout, build_rank_local
from dsv3_plugin.training.transforms import build_model

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "DSv3Config",
    "load_config",
    "load_pretrained",
    "DSv3Model",
    "build_model",
    "RankLayout",
    "build_rank_local",
    "__version__",
]
