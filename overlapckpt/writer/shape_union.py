"""Every rank's tensors by global shape, gathered only when some rank's own tensors changed.

The manifest and the coverage check need every rank's tensors (pipeline stages hold
different ones): an all-gather of each rank's shape table. It is the same at every
checkpoint of an unchanged plan, so it is gathered once and reused, and the claims decide
when (``claims.py``): each rank's claim carries the digest of its own table and the digest
of the gather its cached union came from; the coordinator's verdict says the union may be
reused only when every rank's cached union came from a gather of exactly the tables the
ranks hold now. A replaced writer holds no union, a regrouped one starts a new cache: either
makes every rank gather again. The verdict is sealed like every value the writers write, so
no other client of the store can make a rank skip the gather.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from ..errors import CheckpointWriteError, InternalError

Shapes = dict[str, tuple[int, ...]]
DigestedShapes = tuple[str, Shapes]  # a rank's table and its shapes_digest, as the gather carries them


def shapes_digest(shapes: Shapes) -> str:
    """One rank's table, as 32 hex digits."""
    text = json.dumps(sorted((key, list(shape)) for key, shape in shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def gather_digest(local_digests: list[str]) -> str:
    """The digest of a gather: every rank's table digest, in rank order."""
    return hashlib.sha256(json.dumps(local_digests).encode()).hexdigest()[:32]


def claim_field(local_digest: str, held_gather: str) -> str:
    """What a rank's claim says of its shapes: its own table's digest, and the gather its union came from ("" if none)."""
    return f"{local_digest}:{held_gather}"


def union_reusable(fields: list[str]) -> bool:
    """The coordinator's part: whether every rank holds the union of a gather of the tables the ranks hold now.

    ``fields``: every rank's ``claim_field``, in rank order ("" where a claim carries none).
    """
    parts = [field.split(":", 1) if ":" in field else ["", ""] for field in fields]
    now = gather_digest([local for local, _ in parts])
    return all(held == now for _, held in parts)


def merged(gathered: list[Shapes]) -> Shapes:
    """The union of every rank's table; CheckpointWriteError if one tensor has two global shapes."""
    union: Shapes = {}
    for rank, theirs in enumerate(gathered):
        for key, shape in theirs.items():
            if union.setdefault(key, tuple(shape)) != tuple(shape):
                raise CheckpointWriteError(
                    f"tensor {key!r} has global shape {union[key]} on one rank and {tuple(shape)} on rank {rank}; every "
                    "rank must checkpoint the same model"
                )
    return union


class ShapeUnionCache:
    """This rank's union of every rank's table, and the gather it came from."""

    def __init__(self) -> None:
        self._union: Shapes | None = None
        self._gather = ""  # gather_digest of the tables the union was merged from
        # The last local table and its digest: the table is a plan's (``SetPlanRequest.global_shapes``),
        # the same object, never changed, at every checkpoint of that plan, and hashing it walks every
        # tensor's name (about 0.16 s at 30,000 tensors), so it is hashed once per plan, not per checkpoint.
        self._local: Shapes | None = None
        self._local_digest = ""

    def claim_field(self, local: Shapes) -> str:
        return claim_field(self._digest_of(local), self._gather)

    def _digest_of(self, local: Shapes) -> str:
        if local is not self._local:
            self._local, self._local_digest = local, shapes_digest(local)
        return self._local_digest

    def union(self, local: Shapes, reusable: bool, gather: Callable[[DigestedShapes], list[DigestedShapes]]) -> Shapes:
        """The union: the cached one when the verdict says so, else every rank's table gathered (a collective).

        Each rank's table travels with its digest, so no rank hashes the others' tables again.
        """
        if reusable:
            if self._union is None:  # the verdict said every rank holds one: this rank's claim said it does
                raise InternalError("the writers' verdict reused a shape union this writer does not hold")
            return self._union
        gathered = gather((self._digest_of(local), local))
        self._union = merged([table for _, table in gathered])
        self._gather = gather_digest([digest for digest, _ in gathered])
        return self._union
