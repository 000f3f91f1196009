"""Host-resident state copied by the host: read at the copy's call, written then or once a DMA landed.

On CUDA, torch keeps some optimizer state in host memory: Adam's, AdamW's (and others')
``step`` counter, one 0-dim tensor per parameter. A copy route hands those to the host,
in program order (``stream_copier.py``). With tens of thousands of parameters, a per-tensor
copy is the largest cost in a snapshot's hook: ``_foreach_copy_`` on CPU tensors still
dispatches each pair, about 0.6 µs each on a small machine. Single-element tensors of one
dtype take a faster road: their values are gathered into one tensor, and written into the
slot with one ``index_copy_`` at element positions worked out once, when the route was made.

The gather is native where it can be (``native.py``: a memcpy per value, in one call),
else its Python twin (``item()`` per value, the fastest torch road measured). The native
gather reads the addresses the route recorded, so each gather first checks them against
the live tensors' data pointers (one C-level pass): a tensor whose storage moved since
(``.data`` reassigned) is read through torch, never through a stale address.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .native import gather_library
from .tensor_passes import DataPointers


def copy_on_host(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
    """One grouped copy; under no_grad a source that requires grad is read as it is (no detach per tensor)."""
    if sources:
        with torch.no_grad():
            torch._foreach_copy_(list(destinations), list(sources))


class _ScalarPositions:
    """Single-element host destinations of one dtype inside one host buffer: their element positions."""

    def __init__(self, destinations: Sequence[torch.Tensor]) -> None:
        first = destinations[0]
        storage = first.untyped_storage()
        itemsize = first.element_size()
        self.dtype = first.dtype
        self.flat = torch.empty(0, dtype=first.dtype)
        self.flat.set_(storage, 0, (storage.nbytes() // itemsize,), (1,))
        base = storage.data_ptr()
        self.positions = torch.tensor([(d.data_ptr() - base) // itemsize for d in destinations], dtype=torch.int64)
        self.itemsize = itemsize
        self._native = gather_library()
        self._addresses: DataPointers | None = None

    @staticmethod
    def fit(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> bool:
        if len(sources) < 2:
            return False
        first = destinations[0]
        base, itemsize = first.untyped_storage().data_ptr(), first.element_size()
        return all(
            s.numel() == 1 and d.numel() == 1 and s.device.type == "cpu" and d.device.type == "cpu"
            and s.dtype == first.dtype and d.dtype == first.dtype and not s.is_complex()
            and d.untyped_storage().data_ptr() == base and (d.data_ptr() - base) % itemsize == 0
            for s, d in zip(sources, destinations)
        )

    def read(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        if self._native is None:
            return self.read_python(sources)
        tensors = sources if isinstance(sources, list) else list(sources)
        if self._addresses is None or not self._addresses.unchanged(tensors):
            # First use, or a storage moved: the addresses the C loop reads are the live ones.
            self._addresses = DataPointers(tensors)
        addresses = self._addresses.array
        out = torch.empty(len(tensors), dtype=self.dtype)
        self._native.overlapckpt_gather_values(
            ctypes.c_void_p(addresses.data_ptr()), len(tensors), self.itemsize, ctypes.c_void_p(out.data_ptr())
        )
        return out

    def read_python(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        """The native gather's twin. item() of a host tensor reads its value without a dispatch per copy;
        every value of these dtypes (floats, integers, bool) goes through a Python float or int exactly."""
        return torch.tensor(list(map(torch.Tensor.item, sources)), dtype=self.dtype)

    def write(self, values: torch.Tensor) -> None:
        self.flat.index_copy_(0, self.positions, values)


class HostValues:
    """The host's copies of one route's host-resident sources into their slot destinations."""

    def __init__(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
        self.count = len(destinations)
        self.destinations = list(destinations)
        self._scalars = _ScalarPositions(destinations) if _ScalarPositions.fit(sources, destinations) else None
        # Values kept from the call to a later write (the route's own: a slot's group is copied
        # once per snapshot, and its previous copy has landed before the slot is used again).
        self._scratch = [] if self._scalars is not None else [torch.empty_like(s, device="cpu") for s in sources]

    def read(self, sources: Sequence[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
        """The sources' values now, held until ``write``."""
        if self._scalars is not None:
            return self._scalars.read(sources)
        copy_on_host(sources, self._scratch)
        return self._scratch

    def write(self, values: torch.Tensor | list[torch.Tensor]) -> None:
        if isinstance(values, torch.Tensor):
            assert self._scalars is not None
            self._scalars.write(values)
        else:
            copy_on_host(values, self.destinations)

    def copy_now(self, sources: Sequence[torch.Tensor]) -> None:
        if self._scalars is not None:
            self._scalars.write(self._scalars.read(sources))
        else:
            copy_on_host(sources, self.destinations)
