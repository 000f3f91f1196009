"""A checkpoint's manifest, less the stored bytes' checksums (added at DCP's finish): from every rank's section on the coordinator.

Runs in the writer process. Every rank makes its own section (its parts and their
checksums, its extra state); the coordinator writes the one manifest with every rank's
section, gathered either before DCP's save or in the write round (``group_save.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .. import protocol as p
from ..format.entries import TensorEntry
from ..format.manifest import FORMAT_VERSION, ItemRecord, Manifest, RankSection
from .group import WriterGroup


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_manifest(
    req: p.PersistRequest,
    entries: list[TensorEntry],
    global_shapes: dict[str, tuple[int, ...]],
    sections: list[RankSection] | None,
    group: WriterGroup | None,
) -> Manifest:
    """The manifest less its checksums (known at DCP's finish). Not the coordinator: only what CheckpointInfo needs."""
    world_size = 1 if group is None else group.world_size
    common: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": req.step,
        "requested_step": req.requested_step,
        "mode": req.mode,
        "window": req.window,
        "torch_version": torch.__version__,
        "created_at": time.time(),
        "world_size": world_size,
        "mesh_shape": (1,) if group is None else tuple(group.spec.mesh_shape),
        "ledger": req.ledger,
        "stats": req.stats,
        "run_id": req.run_id,
        "restored_from": req.restored_from,
        "ancestors": tuple(req.ancestors),
        "extra_state_index": tuple(sorted(req.extra_state.keys())),
        "key_layout": req.key_layout,
        "optimizer": req.optimizer,
        # How each param group was replayed, and how exactly: the coordinator's own (every rank measures its groups alike).
        "replay_arithmetic": tuple(req.replay.group_arithmetics) if req.replay is not None else (),
    }
    if sections is None:
        return Manifest(nbytes=sum(e.nbytes for e in entries), items={}, **common)
    nbytes = sum(s.nbytes for s in sections)
    if world_size == 1:
        (only,) = sections
        items = {e.key: ItemRecord(dtype=dtype_name(e.dtype), shape=tuple(e.shape), checksum=only.items[e.key].checksum) for e in entries}
        return Manifest(nbytes=nbytes, items=items, extra_state=only.extra_state, **common)
    # The tensors of the whole checkpoint, by global shape; each rank's parts and their CRC-32s in its section.
    dtype_of = {key: part.dtype for s in sections for key, part in s.items.items()}
    items = {key: ItemRecord(dtype=dtype_of.get(key, ""), shape=tuple(shape)) for key, shape in global_shapes.items()}
    return Manifest(nbytes=nbytes, items=items, ranks=tuple(sections), **common)
