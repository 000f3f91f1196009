"""Small copies gathered into one transfer: which pairs pack into one host span, and scratch layouts.

An optimizer has one 4-byte ``step`` tensor per parameter, and each copy costs a few
microseconds of launch and DMA set-up, so the stream copier gathers small device tensors
into one device scratch buffer laid out like their host destinations and copies it in one
transfer. Separate from ``stream_copier.py`` because it is pure layout arithmetic over
tensors, with no stream or fence; the copy plan (``plan.py``) orders entries by the same
size threshold so that they land in one dense span.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .device import align_up
from .transfer import tensor_nbytes

# Device tensors below this size are gathered into one device scratch buffer and
# copied to the host in one transfer: each copy costs a few microseconds of launch
# and DMA set-up, and an optimizer has one 4-byte ``step`` tensor per parameter.
SMALL_COPY_BYTES = 64 * 1024
# Clones packed into one allocation start on this boundary, so every dtype views them in place.
CLONE_ALIGN_BYTES = 64


@dataclass(frozen=True)
class PackedSpan:
    """Small copies whose destinations lie in one host buffer, gathered into one transfer.

    ``span`` is the host buffer's bytes from the first destination to the end of the
    last; ``scratch_offsets[k]`` is where source k goes inside a scratch buffer laid
    out like ``span``, so one copy of the scratch writes every destination at once.
    The copy writes the whole span: the bytes between destinations too.
    """

    span: torch.Tensor
    scratch_offsets: tuple[int, ...]
    sources: tuple[torch.Tensor, ...]

    def covers(self, destination: torch.Tensor) -> bool:
        start = self.span.data_ptr()
        return start <= destination.data_ptr() < start + self.span.numel()


def plan_packed_copy(
    sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]
) -> tuple[PackedSpan | None, list[int]]:
    """Gather the small pairs whose destinations share one contiguous host buffer.

    Returns the packed span (or None) and the indices of the pairs left to copy one by one.
    Packing pays only where the span is mostly the destinations themselves (the plan lays
    a group's small entries out together); a sparse span is left unpacked.
    """
    small = [
        k
        for k, (s, d) in enumerate(zip(sources, destinations))
        if tensor_nbytes(d) <= SMALL_COPY_BYTES and d.is_contiguous() and s.dtype == d.dtype
    ]
    small_set = set(small)
    rest = [k for k in range(len(sources)) if k not in small_set]
    if len(small) < 2:
        return None, list(range(len(sources)))
    storage = destinations[small[0]].untyped_storage()
    if any(destinations[k].untyped_storage().data_ptr() != storage.data_ptr() for k in small):
        return None, list(range(len(sources)))
    base_ptr = storage.data_ptr()
    starts = [destinations[k].data_ptr() - base_ptr for k in small]
    ends = [st + tensor_nbytes(destinations[k]) for st, k in zip(starts, small)]
    first, last = min(starts), max(ends)
    payload = sum(e - s for s, e in zip(starts, ends))
    if last - first > 4 * payload + 64 * len(small):
        return None, list(range(len(sources)))
    span = torch.empty(0, dtype=torch.uint8, device=destinations[small[0]].device)
    span.set_(storage, first, (last - first,), (1,))
    packed = PackedSpan(
        span=span,
        scratch_offsets=tuple(st - first for st in starts),
        sources=tuple(sources[k] for k in small),
    )
    return packed, rest


def views_of(block: torch.Tensor, offsets: Sequence[int], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the uint8 ``block`` at ``offsets``, shaped and typed like ``like`` (contiguous)."""
    return [block[off : off + tensor_nbytes(t)].view(t.dtype).view(t.shape) for off, t in zip(offsets, like)]


def packed_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Aligned offsets of ``tensors`` packed one after another, and the bytes they take."""
    offsets, cursor = [], 0
    for t in tensors:
        offsets.append(cursor)
        cursor += align_up(tensor_nbytes(t), CLONE_ALIGN_BYTES)
    return offsets, cursor
