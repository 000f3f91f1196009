"""The writers' rounds through each node's leader: a gather onto the coordinator and a broadcast from it, in two hops.

Runs in the writer process, inside ``WriterGroup`` (``group.py``). On several nodes, a flat
gather or broadcast in the writers' gloo group is one message per rank at the coordinator
(rank 0), and torch's ``gather_object`` starts with an all-gather of the objects' sizes, a
ring through every rank. Here each node's lowest rank speaks for its node, as the tier
listing's does (``restore/tiers.py``): a round is one collective inside each node (its
leader and its ranks) and one among the leaders, so the coordinator exchanges one message
per node and per rank of its own node, and the ring of each steady-state round is a node's
or the leaders'. What arrives is the same list, by rank, as the flat round's
(``tests/test_node_tree.py``). The rounds of a new layout (DCP's plan round, the shape
union) and the local tier's across nodes stay flat.

A hop that fails at once (a writer of the node died: its connections closed) is carried to
the next: a leader whose node's gather failed still joins the leaders' gather with the
failure, and a leader whose leaders' broadcast failed passes it on to its node, so no rank
waits out the collective timeout there. A hop that failed by timing out is not carried:
the next hop's ranks began waiting at the same time and have given up, or are about to, and
joining it would wait a second timeout. Every rank raises a ``RuntimeError``, which the
group's regroup reads as a broken group (``WriterGroup.regroups_after``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..format.peers import NodeLayout

# A hop that failed after this share of the collective timeout timed out (or nearly): the next
# hop's ranks are giving up on their own, and are not told.
_CARRIED_UNTIL_SHARE_OF_TIMEOUT = 0.5


@dataclass
class _Broken:
    """A hop that failed, as the next hop carries it: which rank saw it, and the collective's error."""

    rank: int
    text: str

    def raise_it(self) -> None:
        raise RuntimeError(
            f"a round of the writers' group failed on the writer of rank {self.rank}, which leads its node: {self.text}"
        )


class NodeTree:
    """This rank's two groups for the rounds: its node's (where the node has other ranks) and, on a leader, the leaders'."""

    def __init__(self, layout: NodeLayout, rank: int, timeout: timedelta) -> None:
        self.rank = rank
        self._carried_until_s = timeout.total_seconds() * _CARRIED_UNTIL_SHARE_OF_TIMEOUT
        ranks_of_node = layout.ranks_by_node()
        self.node_ranks = ranks_of_node[layout.node_of_rank[rank]]
        self.leader = self.node_ranks[0]
        self.leaders = [ranks[0] for ranks in ranks_of_node]
        # Every rank makes every group, in the same order: torch names a group by the count of
        # groups made before it, and a rank that is no member of one only counts it (no store
        # request, no connection). Made by its members alone (use_local_synchronization), a
        # group is named by the groups each member made before, which differ between a node's
        # leader and the others.
        self.node_group = None
        for ranks in ranks_of_node:
            if len(ranks) > 1:
                group = dist.new_group(ranks, timeout=timeout, backend="gloo")
                if ranks is self.node_ranks:
                    self.node_group = group
        leaders_group = dist.new_group(self.leaders, timeout=timeout, backend="gloo")
        self.leaders_group = leaders_group if self.is_leader else None

    @staticmethod
    def pays_for(layout: NodeLayout) -> bool:
        """Whether the rounds go through the nodes' leaders: more than one node, and some node with more than one rank."""
        return layout.node_count > 1 and len(layout.node_of_rank) > layout.node_count

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def gather(self, value: Any, world_size: int, coordinator: int) -> list[Any] | None:
        """Every rank's ``value``, by rank, on ``coordinator`` (None elsewhere): the node's gather on its leader, then the leaders'."""
        node_values: Any = [value]
        broken: RuntimeError | None = None
        if self.node_group is not None:
            out: list[Any] | None = [None] * len(self.node_ranks) if self.is_leader else None
            started = time.monotonic()
            try:
                dist.gather_object(value, out, dst=self.leader, group=self.node_group)
                node_values = out
            except RuntimeError as e:
                if not self.is_leader or time.monotonic() - started >= self._carried_until_s:
                    raise
                # The other leaders are in the leaders' gather already: it carries this, then this rank raises.
                broken, node_values = e, _Broken(self.rank, str(e))
        if not self.is_leader:
            return None
        gathered: list[Any] | None = [None] * len(self.leaders) if self.rank == coordinator else None
        dist.gather_object((self.node_ranks, node_values), gathered, dst=coordinator, group=self.leaders_group)
        if broken is not None:
            raise broken
        if gathered is None:
            return None
        by_rank: list[Any] = [None] * world_size
        for ranks, values in gathered:
            if isinstance(values, _Broken):
                values.raise_it()
            for r, v in zip(ranks, values):
                by_rank[r] = v
        return by_rank

    def broadcast(self, value: Any, coordinator: int) -> Any:
        """``coordinator``'s ``value`` on every rank: the leaders' broadcast, then each node's from its leader."""
        box = [value]
        if self.is_leader:
            started = time.monotonic()
            try:
                dist.broadcast_object_list(box, src=coordinator, group=self.leaders_group)
            except RuntimeError as e:
                if self.node_group is not None and time.monotonic() - started < self._carried_until_s:
                    # The node's ranks are already in its broadcast: they raise it there.
                    dist.broadcast_object_list([_Broken(self.rank, str(e))], src=self.leader, group=self.node_group)
                raise
        if self.node_group is not None:
            dist.broadcast_object_list(box, src=self.leader, group=self.node_group)
        if isinstance(box[0], _Broken):
            box[0].raise_it()
        return box[0]
