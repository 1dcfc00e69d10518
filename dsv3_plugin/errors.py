"""Error types shared across the package (docs/architecture.md, Conventions: bad input is a `ValueError`, CLI
exit code 2; a peer that is gone is a `PeerError`, exit code 1, reported in one message without a traceback)."""

__all__ = ["ConfigError", "CheckpointError", "DataError", "PeerError", "Preempted"]


class ConfigError(ValueError):
    """Invalid `"dsv3"` configuration (or DeepSpeed key); the message starts with the dotted key path."""


class CheckpointError(ValueError):
    """Bad checkpoint input; the message names the tensor and/or file."""


class DataError(ValueError):
    """Bad training data or tokenizer input; the message names the file (and line, key or record)."""


class PeerError(RuntimeError):
    """Another rank is dead, or silent longer than the configured timeout (`parallel.p2p_timeout_s`); the
    message names the operation, the ranks and the limit. Not bad input and not a bug in this rank: the
    launchers report it as one `error:` line (exit 1), without a traceback."""


class Preempted(Exception):
    """The run stopped on request after saving a complete checkpoint: a signal (SIGTERM / SIGINT / SIGUSR1 on any
    rank, agreed by all ranks at a step boundary) or `dsv3.train.exit_after_minutes`. Not an error: `exit_code` is
    the status the process exits with (128 + the signal number; 0 for the wall-clock budget) and the message is
    the one line the launcher prints (which signal, the step, the checkpoint, how to resume)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
