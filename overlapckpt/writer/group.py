"""The writers' own gloo group: how the writer processes of a distributed run agree and commit together.

Each training rank has one writer process. At construction the training ranks
hand every writer the address of a TCPStore (hosted by training rank 0) and the
writers form their own gloo process group on it, with a timeout on every
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
2. **Gather** each rank's manifest section (ledger, item checksums, stateful
   objects, RNG) on the coordinator (rank 0).
3. **Save** through DCP with the group: DCP builds the global ``.metadata``, and the
   coordinator writes the one manifest, then ``.metadata`` (the global commit).
4. **Window**: for ``window="auto"``, every rank proposes a window for the next
   checkpoint from its own measurements; the widest proposal is handed to every
   engine, so all ranks use the same one.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import RankDisagreementError
from ..protocol import WriterGroupSpec

# A claim key: one per rank per checkpoint sequence number.
_CLAIM_KEY = "claim/{sequence}/{rank}"


class WriterGroup:
    """This writer's membership of the writers' group."""

    def __init__(self, spec: WriterGroupSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        timeout = timedelta(seconds=spec.timeout_s)
        base = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        self.store = dist.PrefixStore("overlapckpt-writers/agree/", base)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("overlapckpt-writers/pg/", base),
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
        self.group = dist.group.WORLD
        self.sequence = 0  # checkpoints claimed (committed or refused) so far: the same count on every rank
        self._unmatched_since: float | None = None

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _key(self, sequence: int, rank: int) -> str:
        return _CLAIM_KEY.format(sequence=sequence, rank=rank)

    def _claims(self, sequence: int) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(self.world_size):
            key = self._key(sequence, r)
            if self.store.check([key]):
                out[r] = json.loads(self.store.get(key).decode("utf-8"))
        return out

    def agree(self, claim: dict[str, Any]) -> None:
        """Post this rank's claim for the next checkpoint; raise RankDisagreementError unless all ranks match."""
        sequence = self.sequence
        self.sequence += 1
        self._unmatched_since = None
        self.store.set(self._key(sequence, self.rank), json.dumps(claim, sort_keys=True))
        keys = [self._key(sequence, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, timedelta(seconds=self.spec.agreement_timeout_s))
        except Exception as e:  # the store's timeout error type differs between torch releases
            claims = self._claims(sequence)
            missing = [r for r in range(self.world_size) if r not in claims]
            raise RankDisagreementError(
                f"checkpoint #{sequence}: ranks {missing} requested no checkpoint (or their writer died) within "
                f"agreement_timeout_s={self.spec.agreement_timeout_s} of {_describe(claims)}; nothing was committed. "
                "Every rank must request the same checkpoints (request() after the same step, or the same every=)"
            ) from e
        claims = self._claims(sequence)
        if any(c != claims[0] for c in claims.values()):
            raise RankDisagreementError(
                f"checkpoint #{sequence}: the ranks disagree: {_describe(claims)}; nothing was committed. Every rank "
                "must request the same checkpoints (request() after the same step, or the same every=)"
            )

    def missing_claim(self) -> RankDisagreementError | None:
        """For an idle writer: a checkpoint another rank claimed that this rank has not, past the timeout."""
        claims = self._claims(self.sequence)
        if not claims:
            self._unmatched_since = None
            return None
        now = time.monotonic()
        if self._unmatched_since is None:
            self._unmatched_since = now
        if now - self._unmatched_since < self.spec.agreement_timeout_s:
            return None
        sequence = self.sequence
        self.store.set(self._key(sequence, self.rank), json.dumps({"requested": None}))  # the others fail at once
        self.sequence += 1
        self._unmatched_since = None
        return RankDisagreementError(
            f"checkpoint #{sequence}: {_describe(claims)}, but this rank ({self.rank}) requested none within "
            f"agreement_timeout_s={self.spec.agreement_timeout_s}; nothing was committed. Every rank must request "
            "the same checkpoints"
        )

    def gather_sections(self, section: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Every rank's manifest section on the coordinator (None elsewhere)."""
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(section, out, dst=0, group=self.group)
        return out

    def agree_window(self, proposal: int | None) -> int | None:
        """The widest window any rank proposes for the next checkpoint (None if none proposes)."""
        proposals: list[Any] = [None] * self.world_size
        dist.all_gather_object(proposals, proposal, group=self.group)
        chosen = [p for p in proposals if p is not None]
        return max(chosen) if chosen else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _describe(claims: dict[int, dict[str, Any]]) -> str:
    parts = []
    for rank, c in sorted(claims.items()):
        if c.get("requested") is None and "version" not in c:
            parts.append(f"rank {rank} requested none")
        else:
            parts.append(f"rank {rank} requested it after step {c['requested']} (version {c['version']})")
    return ", ".join(parts)
