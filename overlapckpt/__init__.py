"""overlapckpt: checkpoint PyTorch training state without stopping training."""

from .checkpointer import Checkpointer
from .errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigError,
    CopyStreamStuckError,
    CorruptCheckpointError,
    CoverageError,
    ForgedStoreValueError,
    InternalError,
    OverlapCkptError,
    RankDisagreementError,
    RootLeaseError,
    SignatureError,
    UnsafeCheckpointError,
    UnsupportedOptimizerError,
    WriterDiedError,
    WritersRegroupedError,
)
from .format.manifest import CheckpointInfo
from .format.storage import CheckpointStore
from .restore import list_checkpoints, load

__all__ = [
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointStore",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "Checkpointer",
    "ConfigError",
    "CopyStreamStuckError",
    "CorruptCheckpointError",
    "CoverageError",
    "ForgedStoreValueError",
    "InternalError",
    "OverlapCkptError",
    "RankDisagreementError",
    "RootLeaseError",
    "SignatureError",
    "UnsafeCheckpointError",
    "UnsupportedOptimizerError",
    "WriterDiedError",
    "WritersRegroupedError",
    "list_checkpoints",
    "load",
]
__version__ = "0.1.0"
