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


@dataclass
class MapSlotRequest:
    slot_id: int
    path: str
    nbytes: int


@dataclass
class ReleaseSlotRequest:
    slot_id: int


@dataclass
class SetLayoutRequest:
    layout_id: int
    entries: list[TensorEntry]
    offsets: tuple[int, ...]


@dataclass
class PersistRequest:
    request_id: int
    slot_id: int
    layout_id: int
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


@dataclass
class ShutdownRequest:
    pass


@dataclass
class ReadyResponse:
    pid: int


@dataclass
class MappedResponse:
    slot_id: int


@dataclass
class CommittedResponse:
    request_id: int
    info: CheckpointInfo
    committed_at: float  # UNIX time
    persist_s: float
    removed: list[str] = field(default_factory=list)  # names deleted by retention


@dataclass
class ErrorResponse:
    request_id: int | None  # the persist request that failed, or None
    exception: BaseException | None  # the original exception, when it pickles
    type_name: str
    message: str
    traceback_text: str
