"""What one writer's persists share, and a snapshot prepared once for each tier's write.

``persist.py`` prepares a snapshot (replay, checksums, the manifest less its checksums,
DCP's state dict) once; ``tier_write.py`` then writes it to each of its tiers. These are
the records between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .. import protocol as p
from ..format.entries import TensorEntry
from ..format.known_sums import KnownChecksums
from ..format.manifest import Manifest, RankSection
from ..format.storage import CheckpointStore
from .group import WriterGroup
from .slot_views import SlotViews

if TYPE_CHECKING:
    from .group_save import GroupSave
    from .slot_landing import SlotLanding


@dataclass
class PersistContext:
    """One writer's: its tiers' stores, its group, the shared host slots, its key and threads."""

    stores: dict[str, CheckpointStore]  # by tier (format/tiers.py)
    group: WriterGroup | None  # the writers' group of a distributed run
    buffers: dict[int, torch.Tensor]  # the host slots, by buffer id
    signing_key: bytes | None = None
    write_threads: int = 1
    # While it says so (a preemption), the local tier's replicas go at full speed (replicas.py).
    unpaced: Callable[[], bool] | None = None
    views: SlotViews | None = None  # the slots' views, kept across persists; None: made anew each time


@dataclass
class PreparedSnapshot:
    """A snapshot replayed and checksummed once, ready for each of its tiers' writes."""

    req: p.PersistRequest
    entries: list[TensorEntry]
    global_shapes: dict[str, tuple[int, ...]]
    manifest: Manifest  # less its checksums, known at DCP's finish
    algorithm: str  # the tensors' checksum algorithm, which the shards' must match
    known: KnownChecksums  # the snapshot's checksums, for the shards' (known_sums.py)
    state_dict: dict[str, Any]  # what DCP saves
    phases: PhaseClock
    started: float  # perf_counter at the persist's start
    # This rank's part of the manifest, made when first needed (it waits for the snapshot's checksums);
    # the coordinator's manifest holds every rank's once they are taken (tier_write.py).
    own_section: Callable[[], RankSection]
    # In a group: the planner set up with state_dict, the local plan, and the verdict on reusing it (group_save.py).
    saving: GroupSave | None = None
    sections_gathered: bool = False
    landing: SlotLanding | None = None  # pipelined: its bytes still landing in the slot (slot_landing.py)


class PhaseClock:
    """Consecutive phases of a persist, in seconds: each ``lap`` ends one, named, and starts the next."""

    def __init__(self, started: float) -> None:
        self.laps: dict[str, float] = {}
        self._last = started

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now
