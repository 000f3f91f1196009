"""Requests and responses between the training process and its writer process.

Small dataclasses over a pipe; tensor data never travels here, only offsets into
shared host buffers that both processes map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .manifest import CheckpointInfo
from .state import TensorEntry


@dataclass
class InitRequest:
    sys_path: list[str]
    root: str
    storage_options: dict[str, Any]
    store_class: tuple[str, str]  # (module, qualified name) of a CheckpointStore subclass
    group: Any = None  # a WriterGroupSpec in a distributed run: the writers' group to join


@dataclass
class MapBufferRequest:
    """Followed on the socket by the buffer's file descriptor (SCM_RIGHTS)."""

    buffer_id: int
    nbytes: int


@dataclass
class ReleaseBufferRequest:
    buffer_id: int


@dataclass
class SetPlanRequest:
    plan_id: int  # names one (layout, window) pair
    entries: list[TensorEntry]  # this rank's share
    offsets: tuple[int, ...]
    # Every tensor of the checkpoint across all ranks, by DCP key: the coverage the writers check.
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class PersistRequest:
    request_id: int
    buffer_id: int  # the host slot the snapshot landed in
    plan_id: int
    name: str
    step: int
    requested_step: int
    mode: str
    window: int
    small_state: dict[str, Any]
    extra_state: dict[str, Any]
    ledger: dict[str, Any]
    stats: dict[str, Any]
    keep: int | None
    replay: Any = None  # the replay log of a replay-mode snapshot (see replay.py)
    proposed_next_window: int | None = None  # window="auto": this rank's choice for the next checkpoint


@dataclass
class ShutdownRequest:
    pass


@dataclass
class ReadyResponse:
    pid: int


@dataclass
class MappedResponse:
    buffer_id: int


@dataclass
class CommittedResponse:
    request_id: int
    info: CheckpointInfo
    committed_at: float  # UNIX time
    persist_s: float
    removed: list[str] = field(default_factory=list)  # names deleted by retention
    agreed_next_window: int | None = None  # window="auto": the window every rank uses next


@dataclass
class ErrorResponse:
    request_id: int | None  # the persist request that failed, or None
    exception: BaseException | None  # the original exception, when it pickles
    type_name: str
    message: str
    traceback_text: str
