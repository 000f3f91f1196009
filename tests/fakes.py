"""Stores that fail on purpose, for the failure tests. The writer process imports them.

They read their configuration from the environment, which the writer process
inherits when the Checkpointer starts it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from overlapckpt.format.attempts import ATTEMPT_MARK
from overlapckpt.format.storage import CheckpointStore


def checkpoint_of_directory(directory: str) -> str:
    """The checkpoint a writer's directory belongs to: itself, or the one an attempt directory (``NAME.attempt-...``) publishes to."""
    return directory.split(ATTEMPT_MARK, 1)[0]

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


class CannotClearTheNameStore(CheckpointStore):
    """Fails on purpose to clear a leftover directory at a checkpoint's name (``remove_tree`` of it raises PermissionError).

    A commit whose name holds a directory without ``.metadata`` clears it before its rename
    (``Attempt.publish``): with this store, the coordinating writer's commit fails there,
    after every rank wrote its shards.
    """

    def remove_tree(self, name: str) -> None:
        if name.startswith("step-") and "." not in name:
            raise PermissionError(13, f"Permission denied (injected: cannot clear {name})", name)
        super().remove_tree(name)


CANNOT_WRITE_NAMES_ENV = "OVERLAPCKPT_TEST_CANNOT_WRITE_NAMES"  # comma-separated checkpoint names


class CannotMakeTheWriterStore(CheckpointStore):
    """Fails on purpose to make DCP's writer for the checkpoints named in CANNOT_WRITE_NAMES_ENV (``make_writer`` raises PermissionError).

    Set in one rank's environment only: that rank's writer cannot begin its share, while
    the others are already on their way to the next collective.
    """

    def make_writer(self, name, before_commit, **kwargs):
        names = os.environ.get(CANNOT_WRITE_NAMES_ENV, "").split(",")
        if checkpoint_of_directory(name) in names:
            raise PermissionError(13, f"Permission denied (injected: cannot make the writer of {checkpoint_of_directory(name)})", name)
        return super().make_writer(name, before_commit, **kwargs)


class CannotLookStore(CheckpointStore):
    """Fails on purpose, in the writer, to tell whether step-000000002 is committed (``is_committed`` raises PermissionError).

    The coordinating writer asks that before it begins the checkpoint's attempt, while the
    other ranks already wait for its answer in a collective.
    """

    def is_committed(self, name: str) -> bool:
        # Only in the writer: the training process (TRAINER_PID_ENV) lists the root as usual.
        if name == "step-000000002" and os.environ.get(TRAINER_PID_ENV) != str(os.getpid()):
            raise PermissionError(13, "Permission denied (injected: cannot look at step-000000002)", name)
        return super().is_committed(name)


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


WRITE_GATE_ENV = "OVERLAPCKPT_TEST_WRITE_GATE"  # a FIFO: GatedWriteStore's first write waits until the test writes a byte to it


class GatedWriteStore(CheckpointStore):
    """The first write of checkpoint ONLY_NAME waits until the test opens the gate (a byte written to the FIFO the env names).

    Its persist, and so its host slot, stays busy for as long as the test chooses.
    """

    def make_writer(self, name, before_commit):
        writer = super().make_writer(name, before_commit)
        if checkpoint_of_directory(name) == os.environ.get(ONLY_NAME_ENV):
            gate = [os.environ[WRITE_GATE_ENV]]

            def wait_for_the_gate(path: str) -> None:
                if gate:  # the writer's other threads write on; the commit waits for this one
                    with open(gate.pop(), "rb") as fifo:
                        fifo.read(1)

            writer.fs = _HookedFileSystem(wait_for_the_gate)
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


RETENTION_GATE_ENV = "OVERLAPCKPT_TEST_RETENTION_GATE"  # a FIFO: retention waits until the test writes a byte to it


class GatedRetentionStore(CheckpointStore):
    """Deleting what retention retired waits until the test opens the gate (a byte written to the FIFO the env names)."""

    def purge_retired(self, retired: str) -> None:
        with open(os.environ[RETENTION_GATE_ENV], "rb") as gate:
            gate.read(1)  # blocks until the test writes
        super().purge_retired(retired)


class FailingRetentionStore(CheckpointStore):
    """Raises OSError whenever retention removes a checkpoint: a failure after the commit."""

    def retire_checkpoint(self, name: str, run_tag: str = "") -> str:
        raise OSError(5, "Input/output error (injected)", name)


TRAINER_PID_ENV = "OVERLAPCKPT_TEST_TRAINER_PID"  # the training process: AdamW below blocks only in others


class AdamW(torch.optim.AdamW):
    """torch's AdamW that hangs, or dies, in the writer process's replay.

    Hangs once after its first step there (BLOCK_FIFO_ENV, BLOCK_ONCE_MARKER_ENV), or kills
    its process after a chosen number of steps (FAULTS_ENV, kind "replay-step").

    Named AdamW because replay steps the training's own update rule, found by its class name.
    In the writer (any process but TRAINER_PID_ENV's) with BLOCK_FIFO_ENV set and the
    BLOCK_ONCE_MARKER_ENV marker absent, a post-step hook tells the test through the FIFO and
    hangs after the first step: the shared slot then holds one group stepped once, the
    others not yet. (A hook, not an override of step(): torch's own AdamW.step fires the
    step hooks too, and an override calling it would count every step twice.)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        marker = os.environ.get(BLOCK_ONCE_MARKER_ENV)
        if str(os.getpid()) != os.environ.get(TRAINER_PID_ENV) and marker and not os.path.exists(marker):
            self.register_step_post_hook(_hang_once)
        if _writer_faults("replay-step"):
            self.register_step_post_hook(_kill_in_replay)


def _hang_once(optimizer: Any, args: Any, kwargs: Any) -> None:
    marker = os.environ[BLOCK_ONCE_MARKER_ENV]
    if os.path.exists(marker):
        return
    with open(marker, "w"):
        pass
    with open(os.environ[BLOCK_FIFO_ENV], "w") as fifo:
        fifo.write(f"{os.getpid()}\n")
    threading.Event().wait()  # until the test kills this process


FAULTS_ENV = "OVERLAPCKPT_TEST_FAULTS"  # JSON: the writer-side faults of tests/fault_schedule.py
FIRED_DIR_ENV = "OVERLAPCKPT_TEST_FIRED_DIR"  # a directory: one marker file per fault that fired (each fires once)
SLOW_WRITE_S_ENV = "OVERLAPCKPT_TEST_SLOW_WRITE_S"  # seconds each shard write takes longer: slow storage


def fire_once(fault_id: str) -> bool:
    """True the first time ``fault_id`` is asked for, across every process of a trial."""
    import errno

    path = os.path.join(os.environ[FIRED_DIR_ENV], fault_id)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except OSError as e:
        if e.errno == errno.EEXIST:
            return False
        raise
    return True


def _writer_faults(kind: str) -> list[dict[str, Any]]:
    import json

    if str(os.getpid()) == os.environ.get(TRAINER_PID_ENV):
        return []
    return [f for f in json.loads(os.environ.get(FAULTS_ENV, "[]")) if f["kind"] == kind]


class FaultStore(CheckpointStore):
    """Kills its own writer process (SIGKILL) at the N-th file write of the first checkpoint at or after a step.

    Configured by FAULTS_ENV (kind "persist-write": id, at_step, write), once per fault
    (FIRED_DIR_ENV); SLOW_WRITE_S_ENV makes every shard write that much slower.
    """

    def make_writer(self, name, before_commit):
        import signal
        import time

        from overlapckpt.format.manifest import step_of_name

        writer = super().make_writer(name, before_commit)
        step = step_of_name(checkpoint_of_directory(name)) or 0
        due = [f for f in _writer_faults("persist-write") if step >= f["at_step"]]
        slow_s = float(os.environ.get(SLOW_WRITE_S_ENV, "0"))
        writes = [0]

        def on_write(path: str) -> None:
            writes[0] += 1
            if slow_s:
                time.sleep(slow_s)  # the injected slowness itself, not a wait for work
            for f in due:
                if writes[0] == f["write"] and fire_once(f["id"]):
                    os.kill(os.getpid(), signal.SIGKILL)

        writer.fs = _HookedFileSystem(on_write)
        return writer


def _kill_in_replay(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A writer-side post-step hook of fakes.AdamW: SIGKILL inside the replay, once per fault."""
    import signal

    _REPLAY_STEPS[0] += 1  # every replayed step of this writer process, across groups
    for f in _writer_faults("replay-step"):
        if _REPLAY_STEPS[0] == f["after_steps"] and fire_once(f["id"]):
            os.kill(os.getpid(), signal.SIGKILL)


_REPLAY_STEPS = [0]


class DiesBeforeLatestStore(CheckpointStore):
    """Kills its writer process (SIGKILL) once, right after the commit's rename and before ``latest`` is written.

    Once per BLOCK_ONCE_MARKER_ENV marker: the replacement writer persists normally.
    """

    def write_latest(self, name: str) -> None:
        import signal

        marker = os.environ.get(BLOCK_ONCE_MARKER_ENV)
        if marker and not os.path.exists(marker):
            with open(marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        super().write_latest(name)


class SkewedClockStore(CheckpointStore):
    """Writes the manifest of step 3 as if the writer's clock had stepped back an hour (NTP, a VM migration)."""

    def write_manifest(self, name: str, data: bytes) -> None:
        import json

        from overlapckpt.format.manifest import dump_manifest, step_of_name

        if step_of_name(checkpoint_of_directory(name)) == 3:
            document = json.loads(data)
            document["created_at"] -= 3600.0
            document.pop("manifest_crc32", None)
            data = dump_manifest(document)
        super().write_manifest(name, data)


class DiesInRootWriteStore(CheckpointStore):
    """The root's store: kills its writer process (SIGKILL) once, as the root's write starts, after the local tier committed.

    Once per BLOCK_ONCE_MARKER_ENV marker: the replacement writer persists normally. The
    local tier is written through the plain store, so only the root's write dies.
    """

    def make_writer(self, name, before_commit, **kwargs):
        import signal

        marker = os.environ.get(BLOCK_ONCE_MARKER_ENV)
        if marker and not os.path.exists(marker):
            with open(marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return super().make_writer(name, before_commit, **kwargs)


class WritesTheSlotAfterItsChecksumStore(CheckpointStore):
    """Breaks the slot protocol on purpose: a byte of every snapshot tensor of 1 MiB or more is flipped
    in the writer's memory after the snapshot was checksummed and before DCP stores it.

    The stored blobs then carry the snapshot's checksums (known_sums.py) over changed bytes:
    a verified load must refuse them.
    """

    def make_writer(self, name, before_commit, **kwargs):
        writer = super().make_writer(name, before_commit, **kwargs)
        write_data = writer.write_data

        def write_changed_slot(plan, planner):
            for value in planner.state_dict.values():
                if isinstance(value, torch.Tensor) and value.numel() * value.element_size() >= 1 << 20:
                    value.view(-1).view(torch.uint8)[0] ^= 1
            return write_data(plan, planner)

        writer.write_data = write_changed_slot
        return writer
