"""``CpuCopier``: the ``Copier`` that copies at the call, with plain memcpy and no stream.

Every ticket it returns has already landed, so no fence is ever needed. Separate from the
stream copier (``stream_copier.py``): it shares none of its routes, events or fences, only
the protocol (``transfer.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .host_values import copy_on_host
from .transfer import CopyRoute, CopyTicket, FenceResult, tensor_nbytes


class CpuCopier:
    """Copies at the call, with plain memcpy: the same engine logic with no stream at all."""

    pins_host_memory = False
    clone_is_cheap = False
    device = None

    def note_training_stream(self) -> None:
        return None

    def copy_async(
        self,
        sources: Sequence[torch.Tensor],
        destinations: Sequence[torch.Tensor],
        keepalive: Sequence[torch.Tensor] = (),
        route: CopyRoute | None = None,
    ) -> CopyTicket:
        start = time.perf_counter()
        copy_on_host(sources, destinations)
        end = time.perf_counter()
        nbytes = sum(tensor_nbytes(d) for d in destinations)
        return CopyTicket(nbytes=nbytes, enqueued_at_s=start, landed_at_s=end, copy_s=end - start)

    def route(
        self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor], keep_sources: bool = False
    ) -> CopyRoute | None:
        return None  # one memcpy per tensor at the call: nothing to work out in advance

    def stage(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # The copy happens at the call, before any later mutation: nothing to protect.
        return list(sources)

    def clone_packed(self, sources: Sequence[torch.Tensor], dtype: torch.dtype, numel: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([s.reshape(-1) for s in sources]) if len(sources) != 1 else sources[0].reshape(-1).clone()

    def allocate_on_training_stream(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_on_training_stream(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        copy_on_host(sources, destinations)

    def device_free_bytes(self) -> int | None:
        return None

    def host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def is_device_resident(self, t: torch.Tensor) -> bool:
        return False  # every copy happens at the call

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        return FenceResult.NOT_NEEDED  # the copy already happened on the host

    def poll(self, ticket: CopyTicket) -> bool:
        return True

    def wait(self, ticket: CopyTicket) -> None:
        return None

    def await_landing(self, ticket: CopyTicket, timeout_s: float) -> bool:
        return True  # landed at the call

    def synchronize(self) -> None:
        return None

    def close(self) -> None:
        return None
