"""Forming the writers' gloo group over the job's store, at the store's lowest cost.

Runs in the writer process, at construction and at every regroup. Gloo connects every pair
of ranks when a group is made: each rank posts its address under its rank in the store and
reads every other rank's. Two of gloo's settings decide what that costs the store
(``benchmarks/group_formation.py`` counts it through a ``Store`` subclass):

* ``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER``: each pair is named by the ranks' numbers instead of
  a number each rank draws per pair, so a rank's entry holds its address alone: 154·N bytes
  read per rank instead of N·(154 + 8·N). Every rank of a group must agree on it.
* ``GLOO_ENABLE_STORE_V2_API``: the addresses are read with one ``multi_get`` per 128 ranks
  (gloo's batch) instead of a wait and a get per rank: 1 + ⌈N/128⌉ requests per rank instead of
  2N + 1, so 9,216 requests at the store's server for 1,024 ranks instead of 2.1 million. A
  rank's choice changes only its own reads, and only where the store has the extended API
  (``TCPStore`` and ``PrefixStore`` over it do; others keep the per-rank reads).

Both are set only where the job has not set them: a job's own choice, the same on every rank,
is kept. Gloo reads them when a group is made, so they also hold for the node tree's groups
(``node_tree.py``), made after the world's.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

PAIRS_NAMED_BY_RANK_ENV = "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER"
BATCHED_ADDRESS_READS_ENV = "GLOO_ENABLE_STORE_V2_API"


def form_gloo_world(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """``init_process_group("gloo")`` over ``store``, with pairs named by rank and the addresses read in batches."""
    os.environ.setdefault(PAIRS_NAMED_BY_RANK_ENV, "1")
    os.environ.setdefault(BATCHED_ADDRESS_READS_ENV, "1")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
