"""The writers' own gloo group: how the writer processes of a distributed run agree and commit together.

Each training rank has one writer process. At construction the training ranks
hand every writer the address of the job's own TCPStore (or, without one, a
TCPStore that training rank 0 hosts) and a random key prefix, and the writers form
their own gloo process group on it, with a timeout on every
collective, so a dead writer or rank surfaces as an error, never as a hang. The
training processes' hooks never take part: everything here runs in the writers.

Per checkpoint, in this order:

1. **Agree** (through the store, not a collective, so a rank that never asked for
   the checkpoint cannot hang the others): each writer posts its claim (checkpoint
   number, version, requested step) under the checkpoint's sequence number and
   waits, up to ``agreement_timeout_s``, for every other rank's claim. Differing
   claims, or a rank that posts none in time, raise ``RankDisagreementError`` on
   every rank, naming each rank's steps; nothing is written.
   An idle writer notices another rank's claim it has not matched
   (``missing_claim``) and, after the same timeout, posts a refusal and reports it.
   The claim protocol is in ``claims.py``.
2. **Gather** each rank's manifest section (ledger, item checksums, stateful
   objects, RNG) on the coordinator (rank 0).
3. **Save** through DCP with the group: DCP builds the global ``.metadata``, and the
   coordinator writes the one manifest, then ``.metadata`` (the global commit).
4. **Window**: for ``window="auto"``, every rank proposes a window for the next
   checkpoint from its own measurements; the widest proposal is handed to every
   engine, so all ranks use the same one.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import RankDisagreementError
from ..format.manifest import RankSection
from ..protocol import WriterGroupSpec
from .claims import ClaimBoard


class WriterGroup:
    """This writer's membership of the writers' group."""

    def __init__(self, spec: WriterGroupSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        timeout = timedelta(seconds=spec.timeout_s)
        # A client of the job's own store where it could be reused (no listener of ours),
        # under a prefix drawn at random for this run (train/distributed.py).
        base = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        prefix = f"overlapckpt-writers/{spec.key_prefix}/"
        self.claims = ClaimBoard(dist.PrefixStore(prefix + "agree/", base), spec.rank, spec.world_size, spec.agreement_timeout_s)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(prefix + "pg/", base),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
        self.group = dist.group.WORLD

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def agree(self, claim: dict[str, Any]) -> int:
        """Every rank claims the same checkpoint, or RankDisagreementError on every rank (``claims.py``)."""
        return self.claims.agree(claim)

    def forget(self, sequence: int) -> None:
        """After the commit (a collective: every rank has passed ``agree``): drop this rank's claim keys."""
        self.claims.forget(sequence)

    def missing_claim(self) -> RankDisagreementError | None:
        return self.claims.missing_claim()

    def gather_sections(self, section: RankSection) -> list[RankSection] | None:
        """Every rank's manifest section on the coordinator (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(section, out, dst=0, group=self.group)
        return out

    def share_from_coordinator(self, value: Any) -> Any:
        """The coordinator's ``value`` on every rank (a collective)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree_window(self, proposal: int | None) -> int | None:
        """The widest window any rank proposes for the next checkpoint (None if none proposes)."""
        proposals: list[Any] = [None] * self.world_size
        dist.all_gather_object(proposals, proposal, group=self.group)
        chosen = [p for p in proposals if p is not None]
        return max(chosen) if chosen else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
