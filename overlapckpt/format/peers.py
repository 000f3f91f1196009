"""Which node each rank runs on, and which ranks hold a copy of each rank's local-tier shard.

A node-local tier on several nodes holds each rank's shard on its own node only; a node
that is lost (replaced, its tmpfs gone) takes its ranks' shards with it. So each shard is
also held by ``replicas`` partner ranks, each on another node (peer replicas), and losing
any one node (any ``replicas`` nodes) loses no shard.

**Nodes.** Ranks are on one node when they share a host name and a network namespace:
two pods on one machine have namespaces (and ``/dev/shm``) of their own, and so do the
tests' "hosts" (``tests/test_tier_nodes.py``), which share a host name.

**Partners.** Nodes are ordered by their lowest rank. The rank at position ``i`` among
its node's ranks has, for ``k = 1 .. replicas``, the rank at position ``i`` (modulo that
node's size) of the ``k``-th next node, in a ring. Its ``replicas`` partners are then on
``replicas`` distinct nodes, none its own, and each node receives about as much as it
sends.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError


def node_key() -> str:
    """This process's node: host name and network namespace (``/proc/self/ns/net``'s inode where Linux has one)."""
    try:
        namespace = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        namespace = "-"
    return f"{socket.gethostname()}/{namespace}"


@dataclass(frozen=True)
class NodeLayout:
    """Each rank's node, as the index of its node in rank order (``node_of_rank[r]``)."""

    node_of_rank: tuple[int, ...]

    @classmethod
    def from_keys(cls, keys: Sequence[str]) -> NodeLayout:
        """From every rank's ``node_key()``, by rank: node 0 is rank 0's, then in order of first rank."""
        index: dict[str, int] = {}
        return cls(tuple(index.setdefault(k, len(index)) for k in keys))

    @property
    def node_count(self) -> int:
        return 1 + max(self.node_of_rank, default=-1)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    def ranks_by_node(self) -> list[list[int]]:
        """Every node's ranks, in rank order, indexed by node: one pass over the ranks (``ranks_on`` for each node is one per node)."""
        ranks: list[list[int]] = [[] for _ in range(self.node_count)]
        for r, node in enumerate(self.node_of_rank):
            ranks[node].append(r)
        return ranks

    def leader(self, node: int) -> int:
        """The node's lowest rank: the one that makes, publishes and retires the node's checkpoint directories."""
        return self.ranks_on(node)[0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of_rank[rank]) == rank

    def partners(self, rank: int, replicas: int) -> list[int]:
        """The ranks that hold copies of ``rank``'s shard, one per next node in the ring (none on its own node)."""
        self.check_replicas(replicas)
        node = self.node_of_rank[rank]
        position = self.ranks_on(node).index(rank)
        out = []
        for k in range(1, replicas + 1):
            theirs = self.ranks_on((node + k) % self.node_count)
            out.append(theirs[position % len(theirs)])
        return out

    def check_replicas(self, replicas: int) -> None:
        if replicas < 0:
            raise ConfigError(f"local_replicas={replicas} is invalid; pass 0 (no peer replicas) or more")
        if self.node_count > 1 and replicas >= self.node_count:
            raise ConfigError(
                f"local_replicas={replicas} needs at least {replicas + 1} nodes (each replica on another node), but the ranks "
                f"run on {self.node_count}; pass local_replicas={self.node_count - 1} or fewer"
            )
