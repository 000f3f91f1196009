"""overlapckpt: checkpoint PyTorch training state without stopping training.

What a training script calls, and the errors it catches. Every error type is in
``overlapckpt.errors`` (all derive from ``OverlapCkptError``); reading a checkpoint
without live objects is ``overlapckpt.restore.read_checkpoint``, one consolidated file
``overlapckpt.consolidate.export_checkpoint``; the framework adapters are
``overlapckpt.lightning``, ``overlapckpt.hf`` and ``overlapckpt.titan``.
"""

from .checkpointer import Checkpointer
from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    ConfigError,
    CorruptCheckpointError,
    OverlapCkptError,
    WriterDiedError,
)
from .format.manifest import CheckpointInfo
from .format.storage import CheckpointStore
from .restore import list_checkpoints, load
from .restore.pipeline import LoadTargets
from .settings import CheckpointerSettings
from .user_log import install_default_handler, set_verbosity

install_default_handler()  # a resume and a close are told without any logging set-up (user_log.py)

__all__ = [
    # the API
    "Checkpointer",
    "CheckpointerSettings",
    "CheckpointInfo",
    "LoadTargets",
    "CheckpointStore",
    "list_checkpoints",
    "load",
    "set_verbosity",
    # the errors a training script catches (the rest: overlapckpt.errors)
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointReadError",
    "CheckpointTimeoutError",
    "CheckpointWriteError",
    "ConfigError",
    "CorruptCheckpointError",
    "OverlapCkptError",
    "WriterDiedError",
]
__version__ = "0.1.0"
