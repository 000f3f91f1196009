"""overlapckpt: checkpoint PyTorch training state without stopping training."""

from .checkpointer import Checkpointer
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    OverlapCkptError,
    UnsupportedOptimizerError,
    WriterDiedError,
)
from .format.manifest import CheckpointInfo
from .format.storage import CheckpointStore
from .loading import list_checkpoints, load

__all__ = [
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointStore",
    "CheckpointWriteError",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "OverlapCkptError",
    "UnsupportedOptimizerError",
    "WriterDiedError",
    "list_checkpoints",
    "load",
]
__version__ = "0.1.0"
