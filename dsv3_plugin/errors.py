"""Error types shared across the package (docs/architecture.md, Conventions: both are `ValueError`, CLI exit code 2)."""
__all__ = ["ConfigError", "CheckpointError"]


class ConfigError(ValueError):
    """Invalid `"dsv3"` configuration (or DeepSpeed key); the message starts with the dotted key path."""


class CheckpointError(ValueError):
    """Bad checkpoint input; the message names the tensor and/or file."""
