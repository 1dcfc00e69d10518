"""dsv3-plugin: DeepSeek-V3's training system as a plugin for DeepSpeed and Megatron-Core.

The core (this package's top-level modules) is device-agnostic PyTorch; `dsv3_plugin.deepspeed` and
`dsv3_plugin.megatron` are thin adapters that import their framework lazily.
"""
from .config import ConfigError, DSv3Config, load_config

__version__ = "0.1.0"
__all__ = ["ConfigError", "DSv3Config", "load_config", "load_pretrained", "DSv3Model", "__version__"]


def __getattr__(name):  # lazy: `import dsv3_plugin` stays cheap and framework-free
    if name == "load_pretrained":
        from .checkpoint.hf import load_pretrained
        return load_pretrained
    if name == "DSv3Model":
        from .model import DSv3Model
        return DSv3Model
    raise AttributeError(name)
