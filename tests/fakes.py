"""Stores that fail on purpose, for the failure tests. The writer process imports them.

They read their configuration from the environment, which the writer process
inherits when the Checkpointer starts it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem

from overlapckpt.format.attempts import checkpoint_of_directory
from overlapckpt.format.storage import CheckpointStore

FAIL_AT_ENV = "OVERLAPCKPT_TEST_FAIL_AT_WRITE"  # N: the N-th write of a checkpoint raises OSError
ONLY_NAME_ENV = "OVERLAPCKPT_TEST_ONLY_NAME"  # only writes of this checkpoint count
BLOCK_FIFO_ENV = "OVERLAPCKPT_TEST_BLOCK_FIFO"  # a FIFO: the first shard write announces itself there and hangs


class _HookedFileSystem(FileSystem):
    def __init__(self, on_write) -> None:
        super().__init__()
        self._on_write = on_write

    def create_stream(self, path, mode):  # type: ignore[override]
        self._on_write(str(path))
        return super().create_stream(path, mode)


class FailingStore(CheckpointStore):
    """Raises OSError(ENOSPC) on the N-th write (shards, manifest, .metadata, latest) of one checkpoint."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(root, storage_options)
        self.fail_at = int(os.environ[FAIL_AT_ENV])
        self.only_name = os.environ.get(ONLY_NAME_ENV)
        self.writes = 0
        self._current: str | None = None

    def _count(self, directory: str, path: str) -> None:
        if self.only_name and checkpoint_of_directory(directory) != self.only_name:
            return
        self.writes += 1
        if self.writes == self.fail_at:
            raise OSError(28, f"No space left on device (injected at write {self.writes})", path)

    def write_bytes(self, name: str, filename: str, data: bytes) -> None:
        self._count(name or self._current or "", filename)
        super().write_bytes(name, filename, data)

    def make_writer(self, name, before_commit):
        self._current = name
        writer = super().make_writer(name, before_commit)
        writer.fs = _HookedFileSystem(lambda path: self._count(name, path))
        return writer


class BlockingStore(CheckpointStore):
    """Hangs in the first shard write of checkpoint ONLY_NAME, after telling the test through a FIFO."""

    def make_writer(self, name, before_commit):
        writer = super().make_writer(name, before_commit)
        if checkpoint_of_directory(name) == os.environ.get(ONLY_NAME_ENV):

            def hang(path: str) -> None:
                with open(os.environ[BLOCK_FIFO_ENV], "w") as fifo:
                    fifo.write(f"{os.getpid()}\n")
                threading.Event().wait()  # until the test kills this process

            writer.fs = _HookedFileSystem(hang)
        return writer


BLOCK_ONCE_MARKER_ENV = "OVERLAPCKPT_TEST_BLOCK_ONCE_MARKER"  # a path: BlockingOnceStore hangs only while it is absent


class BlockingOnceStore(BlockingStore):
    """BlockingStore that hangs the first time only: a writer started after it was killed persists normally."""

    def make_writer(self, name, before_commit):
        marker = os.environ.get(BLOCK_ONCE_MARKER_ENV)
        if marker is None or os.path.exists(marker):
            return CheckpointStore.make_writer(self, name, before_commit)
        with open(marker, "w"):
            pass
        return super().make_writer(name, before_commit)


class FailingRetentionStore(CheckpointStore):
    """Raises OSError whenever retention removes a checkpoint: a failure after the commit."""

    def remove_checkpoint(self, name: str) -> None:
        raise OSError(5, "Input/output error (injected)", name)
