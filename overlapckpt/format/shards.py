"""DCP write items for the parts of tensors one writer holds, and the check that the parts tile the whole.

A writer process holds host copies of its rank's share: whole tensors (a DDP
rank's share of the replicated state) and local shards at a global offset (FSDP2,
HSDP). ``LocalShard`` describes a shard to DCP's planner the way a DTensor does
(``__create_write_items__``), without a device mesh in the writer process, so DCP
records the shard's offsets and the global shape in ``.metadata`` and any world
size can load it.

``CoveringSavePlanner`` runs DCP's global planning on the coordinating writer and
then checks that the parts of every tensor, across all ranks, cover it exactly
once, and that every tensor of the checkpoint was written by some rank. A missing
or doubled part raises there, so nothing is committed.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlanner, TensorWriteData, WriteItem, WriteItemType

try:
    from torch.distributed.checkpoint.planner_helpers import _create_write_items
except ImportError:  # not in this torch: DCP plans every item each time
    _create_write_items = None  # type: ignore[assignment]

from ..errors import CoverageError
from .shared_metadata import forget_shared, share_equal_parts


@dataclass
class LocalShard:
    """The part of a tensor at ``global_offset`` inside a tensor of ``global_shape``."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.global_offset), sizes=self.tensor.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(self.global_offset)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    properties=TensorProperties.create_from_tensor(self.tensor),
                    size=torch.Size(self.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.tensor


def _planner_kwargs(dcp_plan_caching: bool) -> dict[str, Any]:
    accepted = inspect.signature(DefaultSavePlanner.__init__).parameters
    kwargs: dict[str, Any] = {}
    # DCP caches the global plan across saves of the same layout where this torch has it
    # (unless the caller keeps the plans itself: writer/save_plans.py).
    if "enable_plan_caching" in accepted:
        kwargs["enable_plan_caching"] = dcp_plan_caching
    # An item several ranks hold is written once, by the lowest of them. The tensors' parts are
    # already dealt to one rank each (train/copying/ownership.py), so this moves only what every
    # rank holds whole: the optimizer's param_groups and scalars. Balanced by size instead, DCP
    # would scatter those small items over every rank's file, and every rank's restore would read
    # every file: a node-local tier's restore fetches a node only the files its ranks read
    # (restore/tiers.py), which is then its own ranks' shards and rank 0's file.
    if "dedup_save_to_lowest_rank" in accepted:
        kwargs["dedup_save_to_lowest_rank"] = True
    return kwargs


def forget_cached_plans() -> None:
    """Drop DCP's plan caches (class-level, per planner class): a new writers' group must plan afresh.

    With plan caching, each rank sends only what changed since its cached plan, and the
    coordinator merges it into the plans it cached. A replacement writer has no cache, and
    its group's coordinator may hold one from the group before: both must start over.
    """
    for name in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata", "_cached_final_save_plan"):
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.clear()
    forget_shared()


def _overlaps(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes)
    )


def check_coverage(state_dict_metadata: dict[str, Any], global_shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise CoverageError unless every expected tensor is covered exactly once by the chunks written."""
    missing = sorted(k for k in global_shapes if k not in state_dict_metadata)
    if missing:
        raise CoverageError(
            f"no rank wrote {len(missing)} tensor(s) of the checkpoint, e.g. {missing[:3]}; the ranks' layouts "
            "differ (same model and optimizer on every rank?)"
        )
    for key, shape in global_shapes.items():
        md = state_dict_metadata[key]
        if not isinstance(md, TensorStorageMetadata):
            continue
        if tuple(md.size) != tuple(shape):
            raise CoverageError(f"tensor {key!r} was written with global shape {tuple(md.size)}, expected {tuple(shape)}")
        if len(md.chunks) == 1 and not any(md.chunks[0].offsets) and tuple(md.chunks[0].sizes) == tuple(shape):
            continue  # one whole part: covered exactly once (most tensors; the general check below costs 3 us more)
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
        doubled = any(_overlaps(a, b) for i, a in enumerate(chunks) for b in chunks[i + 1 : i + 2])
        if volume != math.prod(shape) or doubled:
            raise CoverageError(
                f"tensor {key!r} of global shape {tuple(shape)} is covered by {len(md.chunks)} part(s) of "
                f"{volume} elements in all ({'overlapping' if doubled else 'not overlapping'}), not exactly once"
            )


# Tensors remembered per key: more than the host slots a writer maps (max_inflight, 1 to a few).
WRITE_ITEMS_PER_KEY = 4


class WriteItemsMemo:
    """DCP's write items of each tensor of a writer's state dict, kept while that very tensor object lives.

    The writer hands DCP the same view of its slot for a tensor at every persist
    (``writer/slot_views.py``), and a tensor's items depend only on its key, dtype, shape,
    strides and the like, which a view keeps. DCP builds them anew for every save: five
    dataclasses and a ``torch.Size`` or two per tensor, 0.3 to 0.5 s of each persist at
    40,000 tensors (2-core VM). A weak reference names the tensor, so a released slot's
    views are not kept alive; any other value (bytes, a new object) is planned by DCP.
    """

    def __init__(self) -> None:
        # Per key, the last few tensors seen there, newest first: a run of two or more host slots
        # alternates between their views (slots.py's max_inflight).
        self._held: dict[str, list[tuple[weakref.ref[torch.Tensor], Any, tuple[WriteItem, ...]]]] = {}

    def items(self, fqn: str, obj: Any) -> list[WriteItem]:
        assert _create_write_items is not None
        tensor = obj.tensor if isinstance(obj, LocalShard) else obj
        if type(tensor) is not torch.Tensor:
            return _create_write_items(fqn, obj)
        placement = (obj.global_shape, obj.global_offset) if isinstance(obj, LocalShard) else None
        held = self._held.setdefault(fqn, [])
        for ref, where, items in held:
            if ref() is tensor and where == placement:
                return list(items)
        made = _create_write_items(fqn, obj)
        held.insert(0, (weakref.ref(tensor), placement, tuple(made)))
        del held[WRITE_ITEMS_PER_KEY:]
        return made


class _Remembered:
    """A state-dict value seen by DCP's local planning through the memo (only while it plans)."""

    __slots__ = ("obj", "memo")

    def __init__(self, obj: Any, memo: WriteItemsMemo) -> None:
        self.obj = obj
        self.memo = memo

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return self.memo.items(fqn, self.obj)


class CoveringSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with local shards resolved and the coverage of the whole checked."""

    # One per process: the writer's persists share it (its tensors are the same views each time).
    write_items = WriteItemsMemo()

    def __init__(self, global_shapes: dict[str, tuple[int, ...]], dcp_plan_caching: bool = True) -> None:
        super().__init__(**_planner_kwargs(dcp_plan_caching))
        self.global_shapes = global_shapes
        # A pipelined snapshot (writer/slot_landing.py): called with each tensor before its bytes are
        # read, it returns once they have landed in the host slot. None: every byte is there.
        self.before_reading: Callable[[torch.Tensor], None] | None = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        if self.before_reading is not None and isinstance(data, torch.Tensor):
            self.before_reading(data)
        return data

    def slot_order(self, write_item: WriteItem) -> int:
        """Where an item's tensor lies in memory: a pipelined snapshot's items are written in the order they land."""
        obj = self.lookup_object(write_item.index)
        return obj.data_ptr() if isinstance(obj, torch.Tensor) else 0

    def create_local_plan(self) -> Any:
        if _create_write_items is None:  # a torch without DCP's item helper: DCP plans every item
            return super().create_local_plan()
        # DCP's own planning (its plan caching included) over the memo's items; the tensors themselves
        # are back in place before anything resolves them.
        state_dict = self.state_dict
        self.state_dict = {
            fqn: _Remembered(obj, self.write_items) if type(obj) is torch.Tensor or isinstance(obj, LocalShard) else obj
            for fqn, obj in state_dict.items()
        }
        try:
            return super().create_local_plan()
        finally:
            self.state_dict = state_dict

    def lookup_object(self, index: MetadataIndex) -> Any:
        # DCP finds a shard by offset only inside tensors; a LocalShard is found by its key.
        obj = self.state_dict.get(index.fqn)
        return obj.tensor if isinstance(obj, LocalShard) else super().lookup_object(index)

    def create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
        global_plan, metadata = super().create_global_plan(all_plans)
        check_coverage(metadata.state_dict_metadata, self.global_shapes)
        share_equal_parts(metadata.state_dict_metadata)  # pickled once each at the commit
        return global_plan, metadata
