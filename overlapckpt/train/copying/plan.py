"""Split the tensor entries into W copy groups of near-equal bytes, and lay them out in a host slot.

A group never splits a tensor, and a parameter travels with its optimizer state:
an update rule couples all elements of a tensor and a parameter with its moments,
so a group must hold one version of all of them. Buffers (and any tensor the
optimizer does not update) go in the last group, which is copied at version V.

The plan is a pure function of the entries and the window, so it is deterministic
and is computed once, then reused while the layout's fingerprint is unchanged
(the lesson of DCP's plan caching).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...format.entries import ROLE_BUFFER, TensorEntry
from .packed_copy import SMALL_COPY_BYTES

# Each entry starts on a 64-byte boundary: the widest vector load, and the cache line.
ENTRY_ALIGN_BYTES = 64


@dataclass(frozen=True)
class CopyGroup:
    """The entries copied together after one step of the window."""

    index: int
    entry_indices: tuple[int, ...]
    param_fqns: tuple[str, ...]  # the parameters whose value and state this group holds
    nbytes: int


@dataclass(frozen=True)
class CopyPlan:
    """Where each entry lives in a host slot, and which group copies it."""

    window_steps: int
    offsets: tuple[int, ...]  # byte offset of entry i in the slot
    slot_nbytes: int
    groups: tuple[CopyGroup, ...]
    fingerprint: int

    def group_of_param(self) -> dict[str, int]:
        return {fqn: g.index for g in self.groups for fqn in g.param_fqns}


def align_bytes(n: int) -> int:
    """``n`` rounded up to the entry alignment."""
    return (n + ENTRY_ALIGN_BYTES - 1) // ENTRY_ALIGN_BYTES * ENTRY_ALIGN_BYTES


def _split_units(unit_order: list[str], unit_bytes: list[int], total: int, window_steps: int) -> list[list[str]]:
    """The units of each of ``window_steps`` groups: runs of ``unit_order`` of about ``total / window_steps`` bytes each."""
    groups_units: list[list[str]] = [[] for _ in range(window_steps)]
    cumulative = 0
    for fqn, nbytes in zip(unit_order, unit_bytes):
        # Place a unit by the midpoint of its byte range, so each group's bytes stay
        # within one unit of total / W and small units are packed together.
        midpoint = cumulative + nbytes / 2
        j = min(window_steps - 1, int(midpoint * window_steps / total)) if total else 0
        groups_units[j].append(fqn)
        cumulative += nbytes
    return groups_units


def make_plan(entries: list[TensorEntry], window_steps: int, fingerprint: int = 0) -> CopyPlan:
    """Partition entries into ``window_steps`` contiguous groups of about equal bytes."""
    if window_steps < 1:
        raise ConfigError(f"window_steps={window_steps} is invalid; use an integer >= 1")

    # A unit is a parameter with its optimizer state, in optimizer order; these are
    # what groups are made of.
    unit_order: list[str] = []
    unit_entries: dict[str, list[int]] = {}
    tail: list[int] = []
    for i, e in enumerate(entries):
        if e.role == ROLE_BUFFER or e.param_fqn is None:
            tail.append(i)
            continue
        if e.param_fqn not in unit_entries:
            unit_entries[e.param_fqn] = []
            unit_order.append(e.param_fqn)
        unit_entries[e.param_fqn].append(i)

    unit_bytes = [sum(entries[i].nbytes for i in unit_entries[f]) for f in unit_order]
    total = sum(unit_bytes) + sum(entries[i].nbytes for i in tail)
    groups_units = _split_units(unit_order, unit_bytes, total, window_steps)

    groups: list[CopyGroup] = []
    order: list[int] = []
    for j, fqns in enumerate(groups_units):
        idx = [i for f in fqns for i in unit_entries[f]]
        if j == window_steps - 1:
            idx += tail
        # Small entries (step counters, scalars) last and together: the copier gathers
        # them into one transfer when their destinations form one dense span.
        order.extend(sorted(idx, key=lambda i: entries[i].nbytes <= SMALL_COPY_BYTES))
        groups.append(
            CopyGroup(
                index=j,
                entry_indices=tuple(idx),
                param_fqns=tuple(fqns),
                nbytes=sum(entries[i].nbytes for i in idx),
            )
        )

    offsets = [0] * len(entries)
    cursor = 0
    for i in order:  # groups are contiguous in the slot: one group is one span
        offsets[i] = cursor
        cursor += align_bytes(entries[i].nbytes)
    return CopyPlan(
        window_steps=window_steps,
        offsets=tuple(offsets),
        slot_nbytes=max(cursor, ENTRY_ALIGN_BYTES),
        groups=tuple(groups),
        fingerprint=fingerprint,
    )
