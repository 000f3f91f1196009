"""``.metadata``'s equal parts made one object each, so pickle writes each once and refers to it after.

Runs in the coordinating writer, on the global plan's metadata (``shards.CoveringSavePlanner``),
before DCP pickles it at the commit. DCP builds a ``TensorProperties``, a ``torch.Size`` for
the global shape and a ``ChunkStorageMetadata`` per tensor; for a state of many small
tensors most of them are equal (one dtype, a handful of shapes). Pickle's memo writes an
object it has seen as a two-to-five-byte reference, so sharing them cut the pickle of
40,012 entries from 0.69 s to 0.36 s and its unpickle, by stock ``dcp.load`` too, from
1.76 s to 0.95 s (one run each, ``time.perf_counter``, 2-core VM).

The unpickled metadata holds the same values; only equal, never-mutated parts are shared
(DCP's load planners read them). Each tensor keeps its own list of chunks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

# The last state_dict_metadata shared here: DCP's plan caching hands the same one back for every
# checkpoint of an unchanged plan, which needs no second pass.
_last_shared: list[Any] = [None]


def _properties_key(p: TensorProperties) -> tuple[Any, ...]:
    return (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)


def share_equal_parts(state_dict_metadata: dict[str, Any]) -> None:
    """Make equal properties, sizes and chunks of ``state_dict_metadata``'s tensors one object each, in place."""
    if state_dict_metadata is _last_shared[0]:
        return
    properties: dict[tuple[Any, ...], TensorProperties] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}
    chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata] = {}
    for md in state_dict_metadata.values():
        if type(md) is not TensorStorageMetadata:
            continue
        md.properties = properties.setdefault(_properties_key(md.properties), md.properties)
        md.size = sizes.setdefault(tuple(md.size), md.size)
        shared = []
        for chunk in md.chunks:
            offsets, chunk_sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            one = chunks.get((offsets, chunk_sizes))
            if one is None:
                chunk.offsets = sizes.setdefault(offsets, chunk.offsets)
                chunk.sizes = sizes.setdefault(chunk_sizes, chunk.sizes)
                one = chunks[(offsets, chunk_sizes)] = chunk
            shared.append(one)
        md.chunks = shared
    _last_shared[0] = state_dict_metadata


def forget_shared() -> None:
    """Drop the reference to the last metadata shared (with DCP's plan caches: ``shards.forget_cached_plans``)."""
    _last_shared[0] = None
