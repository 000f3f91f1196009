"""Which rank copies and writes which tensors: a deterministic function of the layout.

Ranks never talk to agree on it. Every tensor has a *placement* on this rank: its
global shape, the global offset of the local part, and the ranks that hold the same
local part (its replicas):

* a plain tensor in a distributed run (DDP parameters, FSDP buffers) is replicated
  on every rank of the group, or on the ranks that hold it when only some do (pipeline
  stages: ``distributed.plain_holders`` finds them at construction);
* a DTensor (FSDP2, HSDP, TP) is sharded along its Shard mesh dimensions and
  replicated along its Replicate ones; each replica group holds one local shard.

Tensors travel in units (a parameter with its optimizer state, or one buffer). Per
replica class, the units are dealt to the replicas by bytes, largest first, each to
the replica with the fewest bytes so far (ties to the lowest index); buffers go to the
first replica (below). Every replica
of a group sees the same units with the same local sizes in the same order, so each
computes the same owners: the union covers every local part once, and each rank
copies about 1/N of what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorPlacement:
    """Where one tensor's local part sits in the global tensor, and who else holds it."""

    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_index: int  # this rank's index among the ranks holding the same local part
    replica_count: int


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (it holds a local shard), told without importing torch.distributed."""
    return isinstance(t, torch.Tensor) and hasattr(t, "_local_tensor")


def placement_of(t: torch.Tensor, rank: int, world_size: int, holders: tuple[int, ...] | None = None) -> TensorPlacement:
    """The placement of ``t`` on this rank (``rank`` of ``world_size`` in the checkpointing group).

    ``holders``: for a plain tensor that only some ranks hold, those ranks (None: every rank).
    """
    mesh = getattr(t, "device_mesh", None)
    placements = getattr(t, "placements", None)
    if mesh is None or placements is None:
        shape = tuple(t.shape)
        if holders is not None:
            return TensorPlacement(shape, (0,) * len(shape), holders.index(rank), len(holders))
        return TensorPlacement(shape, (0,) * len(shape), rank, world_size)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    index, count = 0, 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            index = index * mesh.size(dim) + coordinate[dim]
            count *= mesh.size(dim)
    return TensorPlacement(tuple(t.shape), tuple(int(o) for o in offset), index, count)


@dataclass(frozen=True)
class OwnershipUnit:
    """Tensors that are copied and written together, by one replica."""

    key: str  # a parameter's FQN, or a buffer's
    nbytes: int  # bytes of the local parts
    replica_index: int
    replica_count: int
    # Buffers go to the first replica: DDP broadcasts rank 0's buffers (BatchNorm running
    # stats) at every forward, so rank 0 holds the authoritative copy; others drift from it.
    first_replica_only: bool = False


def owned_units(units: list[OwnershipUnit]) -> set[str]:
    """The keys of the units this rank owns (see the module docstring)."""
    classes: dict[int, list[OwnershipUnit]] = {}
    for u in units:
        classes.setdefault(u.replica_count, []).append(u)
    owned: set[str] = set()
    for count, members in classes.items():
        loads = [0] * count
        for u in sorted(members, key=lambda u: (not u.first_replica_only, -u.nbytes, u.key)):
            owner = 0 if u.first_replica_only else min(range(count), key=lambda r: (loads[r], r))
            loads[owner] += u.nbytes
            if owner == u.replica_index:
                owned.add(u.key)
    return owned


