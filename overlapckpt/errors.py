"""The error types overlapckpt raises.

Every error derives from :class:`OverlapCkptError`, so one ``except`` catches them
all; configuration errors are also ``ValueError`` and lookups that find nothing are
also ``FileNotFoundError``, so code written against the standard types keeps working.
"""

from __future__ import annotations


class OverlapCkptError(Exception):
    """Base class of every error raised by overlapckpt."""


class ConfigError(OverlapCkptError, ValueError):
    """A constructor argument or call argument is invalid; the message names the fix."""


class UnsupportedOptimizerError(ConfigError):
    """The optimizer cannot be checkpointed in the requested mode."""


class WriterDiedError(OverlapCkptError):
    """The writer process exited or stopped answering; in-flight checkpoints are lost."""


class CheckpointWriteError(OverlapCkptError):
    """The writer process failed to persist a checkpoint; the cause is chained."""


class WritersRegroupedError(CheckpointWriteError):
    """A distributed run's writer died and was replaced while a checkpoint was in flight: that one is lost, not listed."""


class CorruptCheckpointError(OverlapCkptError):
    """A committed checkpoint does not match its manifest (checksum, missing item, bad manifest)."""


class CheckpointMismatchError(OverlapCkptError, ValueError):
    """A checkpoint does not fit the objects it is loaded into (names or shapes differ)."""


class CheckpointNotFoundError(OverlapCkptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class CheckpointReadError(OverlapCkptError, OSError):
    """Storage could not be read (connection lost, file missing, permission): not corruption; the cause is chained."""


class CheckpointTimeoutError(OverlapCkptError, TimeoutError):
    """``wait``/``close`` ran out of time before every requested checkpoint committed."""


class RankDisagreementError(OverlapCkptError):
    """The ranks of a distributed run did not request the same checkpoint; nothing was committed."""


class ForgedStoreValueError(OverlapCkptError):
    """A value in the job's key-value store that this run's writers must agree through was written by another client."""


class CheckpointExistsError(OverlapCkptError, FileExistsError):
    """A committed checkpoint of the same version already exists; it is never overwritten."""


class CoverageError(OverlapCkptError):
    """The ranks' parts do not cover the checkpoint's tensors exactly once; nothing was committed."""


class CopyStreamStuckError(OverlapCkptError, RuntimeError):
    """The copy stream (or its CPU model's worker thread) did not finish a copy in time."""


class InternalError(OverlapCkptError, RuntimeError):
    """An invariant of overlapckpt itself broke: a bug to report, with the message."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint file would run code when read (a crafted pickle): refused, naming the file and the global."""


class SignatureError(CorruptCheckpointError):
    """A signing key is set and the checkpoint's manifest is unsigned, or its signature does not match."""


class RootLeaseError(ConfigError):
    """Another job holds the lease on this checkpoint root."""


class UnsafeFileError(OverlapCkptError, OSError):
    """A file that must not be read where a small regular file belongs: a link, a FIFO, a device, one too large.

    Not a storage failure: the file is there, and is not what overlapckpt wrote (damaged or
    planted). An ``OSError`` too (with its ``errno``), so that a caller that skips unreadable
    files skips it.
    """


class UntrustedPathError(ConfigError):
    """A node-local tier or the native build cache is a directory another user made or can write (or a symlink): refused."""
