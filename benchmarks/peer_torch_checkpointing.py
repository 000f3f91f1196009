"""torch_checkpointing's asynchronous saver as a peer in ``durable.py``'s time to durable.

TorchTitan 0.3 ships ``torch_checkpointing`` as its second checkpoint manager
(``torchtitan/components/checkpointer/torch_checkpointing.py``). Its save path is still
a stub there (``_save`` raises ``NotImplementedError``), so what is copied here is the
backend it builds, ``_default_backend_config()``: a ``CheckpointManager`` with an
``AsyncCheckpointSaverConfig`` (staging in a background thread into shared memory,
pinned where CUDA can pin it; the files written by a spawned writer process), a
``TCPStoreBarrier`` before the commit, and a DTensor resharder declared on the model
and optimizer items, which turns on the distributed metadata file.

One departure is forced: TorchTitan leaves the storage at the library's default,
``LocalFileSystemStorageConfig(use_direct_io=True)``, whose writer opens each file
``O_DIRECT`` and streams ``torch.save``'s unaligned writes into it. Filesystems that take
the open but refuse unaligned writes (ext4, XFS) fail the save with ``EINVAL``; the
library falls back to buffered writes only when the open itself is refused. So the
target directory is probed once with the library's own writer, and direct I/O is turned
off where it cannot write there (``direct_io`` says which).

"Durable" is what the library's write future means: every file written (``O_DIRECT``, or
through the page cache), the barrier passed and ``tmp_<name>`` renamed onto ``<name>``.
The library calls no ``fsync`` (nor on the directory after the rename): with buffered
writes its own figure excludes writeback. ``save_and_sync_s`` also reports the time
until its files and directories are fsynced, the time to durable of a job that needs
them on the disk.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import time
from typing import Any

import torch
from torch import nn

# TorchTitan's _DEFAULT_BARRIER_TIMEOUT_SEC and _DEFAULT_BARRIER_INIT_TIMEOUT_SEC.
_BARRIER_TIMEOUT_S = 600
_BARRIER_INIT_TIMEOUT_S = 60
_CHECKPOINT_PREFIX = "step-"


def available() -> str | None:
    """None if torch_checkpointing's asynchronous saver can run here, else a one-line reason."""
    try:
        from torch_checkpointing.checkpoint_manager import CheckpointManager  # noqa: F401
        from torch_checkpointing.config import AsyncCheckpointSaverConfig  # noqa: F401
    except ImportError as error:
        return f"torch_checkpointing is not importable: {error}"
    if _resharder_class() is None:
        return "torch_checkpointing has neither DTensorResharder nor DefaultResharder"
    if not torch.distributed.is_available():
        return "torch.distributed is not available (the writer's commit barrier is a TCPStore)"
    if not hasattr(os, "O_DIRECT"):
        return "torch_checkpointing's file writer opens files with os.O_DIRECT, which this platform lacks"
    return None


def _resharder_class() -> Any:
    """TorchTitan imports ``DTensorResharder``; torch_checkpointing 0.1.1 names the same DTensor resharder ``DefaultResharder``."""
    try:
        from torch_checkpointing.dtensor_resharder import DTensorResharder  # type: ignore[import-not-found]  # absent in 0.1.1

        return DTensorResharder
    except ImportError:
        pass
    try:
        from torch_checkpointing.default_resharder import DefaultResharder

        return DefaultResharder
    except ImportError:
        return None


def _free_port() -> int:
    """A port for the writer's barrier TCPStore.

    TorchTitan uses a fixed 43001; a benchmark that opens this peer once per storage,
    next to other jobs, takes a free one instead. The port does not change the cost.
    """
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _direct_io_writes(directory: str) -> bool:
    """Whether the library's default writer (``O_DIRECT``) can write an unaligned file in ``directory``."""
    from pathlib import Path

    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    probe = Path(directory) / ".direct-io-probe"
    try:
        LocalFileSystemStorageConfig(use_direct_io=True).create_storage().write(probe, b"\0" * 1302)
        return True
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)


def _manager(barrier_port: int, direct_io: bool) -> Any:
    """TorchTitan 0.3's ``_default_backend_config().build()``, but for the port, CPU-only pinning and direct I/O."""
    from torch_checkpointing._pin_memory_utils import can_pin_memory
    from torch_checkpointing.barriers import TCPStoreBarrierConfig
    from torch_checkpointing.checkpoint_manager import CheckpointManager
    from torch_checkpointing.checkpoint_writer import CheckpointWriterConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.schema import ItemSpec
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    resharder = _resharder_class()()
    save = AsyncCheckpointSaverConfig(
        writer_config=CheckpointWriterConfig(
            checkpoint_write_barrier_timeout_sec=_BARRIER_TIMEOUT_S,
            barrier_config=TCPStoreBarrierConfig(
                master_address=os.environ.get("MASTER_ADDR", "localhost"),
                tcpstore_port=barrier_port,
                timeout_barrier_init_sec=_BARRIER_INIT_TIMEOUT_S,
                use_checkpoint_barrier_tcpstore_libuv=True,
            ),
        ),
        # TorchTitan passes use_pinned_memory=True; pinning calls cudaHostRegister, which a
        # CPU-only torch has not, so it is on exactly where CUDA can pin. The other staging
        # settings are the library's defaults, as TorchTitan leaves them: asynchronous
        # staging in a thread, shared memory, non-blocking copies where CUDA is.
        staging_config=CheckpointStagerConfig(use_pinned_memory=can_pin_memory()),
        wait_timeout_secs=_BARRIER_TIMEOUT_S,
    )
    items = {name: ItemSpec(requires_copy=True, resharder=resharder, required=False) for name in ("model", "optimizer")}
    return CheckpointManager.Config(
        items=items, default=ItemSpec(requires_copy=False), save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=direct_io)
    ).build()


def _flat_state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state dicts in the flat FQN-keyed form TorchTitan's optimizer container gives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))


def _fsync(path: str) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    """fsync every file under ``path``, then each directory (the renames), deepest first."""
    for directory, _, files in sorted(os.walk(path), key=lambda entry: -entry[0].count(os.sep)):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


class TorchCheckpointingAsync:
    """torch_checkpointing's asynchronous saver, configured as TorchTitan 0.3 configures it.

    One manager (its writer process, staging thread and shared-memory buffers) lives for
    the whole run, as a training job keeps it. Checkpoints go to ``<directory>/step-<n>``;
    only the newest is kept.
    """

    label = "torch_checkpointing async"  # its own figure: the library calls no fsync
    synced_label = "torch_checkpointing async, then fsync of its files"  # save_and_sync_s's second figure

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self._newest_path: str | None = None
        self.direct_io = _direct_io_writes(directory)  # False: buffered writes, no fsync
        self._manager = _manager(_free_port(), self.direct_io)  # spawns the writer process in the background

    @property
    def manager(self) -> Any:
        """The ``CheckpointManager``: ``manager.lock()`` guards the optimizer step against a capture."""
        return self._manager

    def start_save(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> Any:
        """Start a save of the current state to ``step-<step>``; returns its write future."""
        return self._save_states(step, *_flat_state_dicts(model, opt))

    def _save_states(self, step: int, model_state: dict[str, Any], optim_state: dict[str, Any]) -> Any:
        """``CheckpointManager.save`` to ``step-<step>``; the previous checkpoint goes once this one is in place."""
        path = os.path.join(self.directory, f"{_CHECKPOINT_PREFIX}{step}")
        shutil.rmtree(path, ignore_errors=True)  # the commit's rename refuses an occupied destination
        write_future = self._manager.save(path, {"model": model_state, "optimizer": optim_state})
        previous, self._newest_path = self._newest_path, path

        def keep_newest(_: Any) -> None:
            if previous is not None and previous != path:
                shutil.rmtree(previous, ignore_errors=True)

        write_future.add_done_callback(keep_newest)
        return write_future

    def save_s(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
        """Seconds from ``CheckpointManager.save`` to its write future's result (files renamed into place).

        Untimed first, as ``durable.py``'s other methods do: an optimizer step (under the
        manager's lock, as the library asks), so every byte differs from the last save,
        and the state dicts.
        """
        return self.save_and_sync_s(model, opt, step)[0]

    def save_and_sync_s(self, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> tuple[float, float]:
        """``save_s``, and the seconds from the same start until its files and directory are fsynced too.

        The library calls no fsync (module docstring): the second figure is what its save
        costs a job that needs the bytes on the disk, the time to durable that the other
        methods report. On tmpfs the fsyncs cost next to nothing.
        """
        with self._manager.lock():
            opt.step()
        states = _flat_state_dicts(model, opt)
        started_s = time.perf_counter()
        path = os.path.join(self.directory, f"{_CHECKPOINT_PREFIX}{step}")
        self._save_states(step, *states).result(timeout=_BARRIER_TIMEOUT_S)
        saved_s = time.perf_counter() - started_s
        _fsync_tree(path)
        return saved_s, time.perf_counter() - started_s

    def close(self) -> None:
        """Wait for any write, then stop the staging thread and the writer process."""
        self._manager.close()
