"""dsv3-plugin: DeepSeek-V3's training system as a plugin for DeepSpeed and Megatron-Core.

The folders are the architecture; imports point one way (enforced by tests/unit/test_import_layers.py):

    errors, json_input, config   the "dsv3" block (one typed config), ConfigError / CheckpointError
    model/                       the network: transformer, mla, rope, norm, mtp, kernels; model/moe/ (router,
                                 balancing, experts + layer)                   — device-agnostic PyTorch
    precision/                   FP8 (precision/fp8/: quant, linear, experts, hopper), BF16-moment AdamW
    parallel/                    process groups, EP dispatch, expert_parallel, pipeline/ (schedules, runtime)
    training/                    transforms (FP8 → recompute → EP → W-split), rank-local build (meta → what a
                                 rank owns), recompute, ema, data, telemetry, memory plan, run directories
    checkpoint/                  released checkpoints: reader, writer, hf, convert, synthetic, integrity
    deepspeed/, megatron/        thin adapters (import their framework lazily)
    cli/                         `dsv3 ...` commands (benches: `benchmarks/` beside the package, not installed)

docs/architecture.md draws the same picture with the data flow.
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
