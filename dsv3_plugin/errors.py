"""Error types shared across the package (docs/architecture.md, Conventions: both are `ValueError`, CLI exit code 2)."""
from dsv3_plugin.config import ConfigError

__all__ = ["ConfigError", "CheckpointError"]


class CheckpointError(ValueError):
    """Bad checkpoint input; the message names the tensor and/or file."""
