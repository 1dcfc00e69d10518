"""Error types shared across the package (DESIGN.md: both are `ValueError`, CLI exit code 2)."""
from dsv3_plugin.config import ConfigError

__all__ = ["ConfigError", "CheckpointError"]


class CheckpointError(ValueError):
    """Bad checkpoint input; the message names the tensor and/or file."""
