"""DCP's save plans, made once per layout: each rank's central plan and the coordinator's global metadata, reused while no local plan changes.

Runs in the writer process of a distributed run. DCP's save begins with a plan round:
every rank's local plan gathered on the coordinator, the global plan made there, each
rank's part scattered back. Its plan caching (where torch has it) sends empty plans when
nothing changed, but the gather and the scatter stay: two collective calls and four
rounds of every checkpoint (``benchmarks/scale.py``). The plans change only with the
layout (the tensors, their shards, the small state's keys), so the round is run once per
layout, and the claims decide when, as for the shape union (``shape_union.py``): each
rank's claim carries the digest of its local plan and the digest of the plan round its
cached plan came from; the coordinator's verdict says the plans may be reused only when
every rank's cached plan came from a round over exactly the local plans the ranks make
now. A replaced writer holds no plan and a regrouped one starts a new cache: either makes
every rank plan again. The verdict is sealed, so no other client of the store can make a
rank skip the round.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from ..errors import InternalError
from .shape_union import claim_field, gather_digest


def _item_text(item: Any) -> str:
    # The whole item, every field of its index, type and chunk: equal items give equal text.
    return repr(item)


class LocalPlanDigests:
    """The digest of a local save plan, with each item's text kept while the next plan holds the same item.

    The writer hands DCP the same write items for a tensor at every persist
    (``format/shards.py``'s ``WriteItemsMemo``), so most items of the next plan are the
    very objects of this one, and their text is not made again: at 30,000 tensors the
    text of every item took 0.15 s (2-core VM). The items are held while their text is
    (an id is unique only while its object lives).
    """

    def __init__(self) -> None:
        self._texts: dict[int, tuple[Any, str]] = {}

    def digest(self, plan: Any) -> str:
        """32 hex digits of ``plan``'s items, in order, and its planner data (the flattened keys' paths)."""
        texts: dict[int, tuple[Any, str]] = {}
        h = hashlib.blake2b(digest_size=16)
        for item in plan.items:
            held = self._texts.get(id(item))
            text = held[1] if held is not None and held[0] is item else _item_text(item)
            texts[id(item)] = (item, text)
            h.update(text.encode())
            h.update(b"\n")
        planner_data = plan.planner_data
        if isinstance(planner_data, dict):
            h.update(repr(sorted(planner_data.items(), key=lambda kv: str(kv[0]))).encode())
        elif planner_data is not None:
            h.update(repr(planner_data).encode())
        h.update(repr((plan.storage_data, plan.usable)).encode())
        self._texts = texts
        return h.hexdigest()


@dataclass
class PlannedSave:
    """What one plan round gave this rank: its central plan, and on the coordinator the global metadata."""

    central_plan: Any
    metadata: Any | None  # the coordinator's; None on the other ranks


class SavePlanCache:
    """This rank's plan from the last plan round, and the digests of the local plans that round was made from."""

    def __init__(self) -> None:
        self.digests = LocalPlanDigests()
        self._planned: PlannedSave | None = None
        self._round = ""  # gather_digest of every rank's local plan digest in that round

    def claim_field(self, local_digest: str) -> str:
        return claim_field(local_digest, self._round)

    def reused(self) -> PlannedSave:
        """The plan the verdict says every rank may reuse; this rank's claim said it holds one."""
        if self._planned is None:
            raise InternalError("the writers' verdict reused a save plan this writer does not hold")
        return self._planned

    def hold(self, planned: PlannedSave, local_digests: list[str]) -> None:
        """Keep the plan of a round that succeeded on this rank, over these local plans (every rank's digest, in rank order)."""
        self._planned = planned
        self._round = gather_digest(local_digests)

    def forget(self) -> None:
        """A failed round leaves no plan: the next checkpoint's claims plan again."""
        self._planned = None
        self._round = ""
