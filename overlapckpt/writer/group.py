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
   number, version, requested step) under the checkpoint's sequence number; the
   coordinator (rank 0) waits, up to ``agreement_timeout_s``, for every rank's claim
   and posts one verdict, which every other writer waits for (O(1) store requests per
   rank, O(N) at the store). Differing claims, or a rank that posts none in time,
   raise ``RankDisagreementError`` on every rank, naming each rank's steps; nothing
   is written.
   An idle writer notices another rank's claim it has not matched
   (``missing_claim``) and, after the same timeout, posts a refusal and reports it.
   The claim protocol is in ``claims.py``.
2. **Learn every rank's tensors** (pipeline stages hold different ones): an
   all-gather of each rank's shape table, only when the verdict says some rank's
   table, or its cached union, changed since (``shape_union.py``): once per plan.
3. **Gather** each rank's manifest section (ledger, item checksums, stateful
   objects, RNG) on the coordinator (rank 0).
4. **Save** through DCP with the group: DCP builds the global ``.metadata``, and the
   coordinator writes the one manifest, then ``.metadata`` (the global commit).
5. **Window**: for ``window="auto"``, every rank proposes a window for the next
   checkpoint from its own measurements; the widest proposal is handed to every
   engine, so all ranks use the same one.

Where the ranks span nodes, the coordinator's gathers and broadcasts go through each
node's lowest rank (``node_tree.py``): one message per node at the coordinator.
"""

from __future__ import annotations

import gc
import logging
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import RankDisagreementError
from ..format.peers import NodeLayout
from ..format.shards import forget_cached_plans
from ..protocol import REGROUP_WAIT_S, WriterGroupSpec
from .claims import COORDINATOR_RANK, Agreement, ClaimBoard
from .gloo_world import form_gloo_world
from .node_tree import NodeTree
from .open_files import raise_open_file_limit
from .save_plans import SavePlanCache
from .sealed_store import SealedStore
from .shape_union import DigestedShapes, ShapeUnionCache

log = logging.getLogger("overlapckpt")

# The store counter of the writers' generations: a replacement writer adds 1, every live
# writer follows it into the new generation's group (``regroup``).
GENERATION_KEY = "generation"
_REGROUP_POLL_S = 0.1
# A checkpoint lost to a regroup, by name: a replacement writer that is handed it refuses it
# too, so that no rank waits for a claim the others will never make.
LOST_PREFIX = "lost/"


def run_keys_prefix(spec: WriterGroupSpec) -> str:
    """Where this run's writers keep their keys in the job's store (the prefix is drawn per run)."""
    return f"overlapckpt-writers/{spec.key_prefix}/"


class WriterGroup:
    """This writer's membership of the writers' group, in its current generation.

    A gloo group cannot take a new member, so when a writer dies and its training rank
    starts a replacement (``WriterGroupSpec.restarted``), the replacement adds 1 to the
    store's generation counter and joins that generation's group; every live writer sees
    the counter move (idle, in ``_serve_requests``; waiting for claims, in ``ClaimBoard``;
    in a collective the dead writer broke, in ``regroups_after``), leaves its group and
    joins the new one. The checkpoint in flight is lost on every rank
    (``WritersRegroupedError``: the attempt is removed, nothing is listed, and its name is
    marked lost so that a replacement handed it refuses it too); the next one commits.
    One replacement at a time: two writers that die together may leave the generations
    split, and the run's next checkpoint then fails within ``collective_timeout_s``.
    """

    def __init__(self, spec: WriterGroupSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self._timeout = timedelta(seconds=spec.timeout_s)
        self._prefix = run_keys_prefix(spec)
        self._warned_forged_generation = False
        raise_open_file_limit(self.world_size)  # gloo's sockets, one per rank: before the first group forms
        self._connect()
        for name in spec.lost_names:
            self.mark_lost(name)  # before the generation moves: a live writer then knows to drop it
        self.generation = self._run_keys.increment(GENERATION_KEY, 1 if spec.restarted else 0)
        self._join()

    def _connect(self) -> None:
        # A client of the job's own store where it could be reused (no listener of ours),
        # under a prefix drawn at random for this run (train/run/distributed.py); every value
        # sealed with the run's key (sealed_store.py).
        self._base = dist.TCPStore(self.spec.store_host, self.spec.store_port, is_master=False, timeout=self._timeout)
        self._run_keys = SealedStore(dist.PrefixStore(self._prefix, self._base), self.spec.store_key, self._prefix)

    def _where(self) -> str:
        # Generation 0 keeps the run's first keys; each later one has keys of its own.
        return self._prefix if self.generation == 0 else f"{self._prefix}gen{self.generation}/"

    def _claim_board(self, sequence: int = 0) -> ClaimBoard:
        where = self._where() + "agree/"
        board = ClaimBoard(
            SealedStore(dist.PrefixStore(where, self._base), self.spec.store_key, where),
            self.rank,
            self.world_size,
            self.spec.agreement_timeout_s,
            moved=self.generation_moved,
        )
        board.sequence = sequence
        return board

    def _join(self) -> None:
        self.claims = self._claim_board()
        self.shapes = ShapeUnionCache()  # a new group gathers its union again
        self.plans = SavePlanCache()  # and plans its saves again (save_plans.py)
        # The first generation's writers start together; a later one's join while others
        # are still failing out of the old group (WriterGroupSpec.regroup_join_timeout_s).
        # Gloo's rendezvous waits on the store under the store's timeout, and connects under the group's.
        join_timeout = self._timeout if self.generation == 0 else timedelta(seconds=self.spec.regroup_join_timeout_s)
        self._base.set_timeout(join_timeout)
        try:
            form_gloo_world(dist.PrefixStore(self._where() + "pg/", self._base), self.rank, self.world_size, join_timeout)
        finally:
            self._base.set_timeout(self._timeout)
        self.group = dist.group.WORLD
        if join_timeout != self._timeout:
            _set_group_timeout(self._timeout, self.group)  # every collective after the join: the collective timeout
        # On several nodes, the rounds go through each node's leader (node_tree.py); its groups
        # are the generation's too (destroy_process_group ends them with the world's).
        layout = NodeLayout(tuple(self.spec.round_nodes)) if len(self.spec.round_nodes) == self.world_size else None
        self.tree = NodeTree(layout, self.rank, self._timeout) if layout is not None and NodeTree.pays_for(layout) else None

    def reconnect(self) -> None:
        """A new client connection to the store, after a store error (the group's own connections are gloo's)."""
        self._connect()
        self.claims = self._claim_board(self.claims.sequence)

    def generation_moved(self) -> bool:
        """Whether a replacement writer opened a newer generation than this writer's (one or two store requests)."""
        current = self._run_keys.read_counter(GENERATION_KEY)
        if current is None:
            if not self._warned_forged_generation:
                self._warned_forged_generation = True
                log.warning(
                    "overlapckpt: the writers' generation counter in the job's store holds a value this run's writers did "
                    "not write; ignored (a writer that dies now cannot be replaced). Another client of the store wrote it"
                )
            return False
        return current > self.generation

    def regroup(self) -> None:
        """Leave this generation's group and join the newest one (blocks until every writer has joined).

        Call it with no exception of the old group in hand: its traceback holds the group,
        and a group still held keeps its connections open, so a peer waiting on this writer
        in the old group waits out the collective timeout instead of failing at once.
        """
        self.group = None
        self.tree = None  # its groups end with the world's
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_cached_plans()  # the new group's ranks plan afresh, the replacement has no cache
        gc.collect()  # the group's last references may sit in cycles: its connections close now
        self.generation = self._run_keys.increment(GENERATION_KEY, 0)
        try:
            self._join()
        except Exception as e:
            # A writer left with no group would fail every checkpoint from now on and never be
            # replaced, and joining this generation again would meet its stale addresses. Ending
            # the process makes its training rank start a replacement, which opens a fresh generation.
            log.error(
                "overlapckpt: the writer of rank %d could not join generation %d of the writers' group (%s: %s); it exits, "
                "and its training rank replaces it (max_writer_restarts)", self.rank, self.generation, type(e).__name__, e,
            )
            raise SystemExit(f"the writer of rank {self.rank} could not join generation {self.generation} of the writers' group") from e

    def mark_lost(self, name: str) -> None:
        """Checkpoint ``name`` is lost with the old group: every writer refuses it from now on (``was_lost``)."""
        self._run_keys.set(f"{LOST_PREFIX}{name}", name)

    def was_lost(self, name: str) -> bool:
        """Whether some writer lost checkpoint ``name`` to a replacement (a replacement may get it afterwards)."""
        key = f"{LOST_PREFIX}{name}"
        return self._run_keys.get(key) == name  # one request, never waiting: None when absent (or forged)

    def regroups_after(self, error: BaseException) -> bool:
        """After a failed persist: whether it failed because a writer was replaced (the caller then regroups).

        A collective that a dead writer broke fails at once on the others (gloo sees the
        connection close); its replacement opens the next generation a few seconds later,
        once its training rank has noticed the death. Storage errors are not waited on.
        """
        if isinstance(error, OSError) or not isinstance(error, RuntimeError):
            return False  # a storage failure or one of ours: not a broken group
        if not self.spec.replaced_when_dead:
            return False  # max_writer_restarts=0 on every rank: no replacement will come
        deadline = time.monotonic() + min(REGROUP_WAIT_S, self.spec.timeout_s)
        while not self.generation_moved():
            if time.monotonic() >= deadline:
                return False
            time.sleep(_REGROUP_POLL_S)  # the replacement is starting: nothing to wait on but the counter
        return True

    @property
    def is_coordinator(self) -> bool:
        return self.rank == COORDINATOR_RANK

    def agree(self, claim: dict[str, Any]) -> Agreement:
        """Every rank claims the same checkpoint, or RankDisagreementError on every rank (``claims.py``)."""
        return self.claims.agree(claim)

    def forget(self, sequence: int) -> None:
        """After the commit: drop this rank's claim keys that no rank reads any more (``ClaimBoard.forget``)."""
        self.claims.forget(sequence)

    def missing_claim(self) -> RankDisagreementError | None:
        return self.claims.missing_claim()

    def gather_on_coordinator(self, value: Any) -> list[Any] | None:
        """Every rank's ``value``, by rank, on the coordinator (None elsewhere): a collective, through the nodes' leaders where there are several."""
        if self.tree is not None:
            return self.tree.gather(value, self.world_size, COORDINATOR_RANK)
        out: list[Any] | None = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(value, out, dst=COORDINATOR_RANK, group=self.group)
        return out

    def shapes_claim(self, local: dict[str, tuple[int, ...]]) -> str:
        """What this rank's claim says of its tensors (``shape_union.py``)."""
        return self.shapes.claim_field(local)

    def union_of_shapes(self, local: dict[str, tuple[int, ...]], reusable: bool) -> dict[str, tuple[int, ...]]:
        """Every rank's tensors by global shape, on every rank: gathered (a collective) unless the verdict says ``reusable``."""
        return self.shapes.union(local, reusable, self._gather_tables)

    def _gather_tables(self, local: DigestedShapes) -> list[DigestedShapes]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=self.group)
        return gathered

    def share_from_coordinator(self, value: Any) -> Any:
        """The coordinator's ``value`` on every rank (a collective, through the nodes' leaders where there are several)."""
        if self.tree is not None:
            return self.tree.broadcast(value, COORDINATOR_RANK)
        box = [value]
        dist.broadcast_object_list(box, src=COORDINATOR_RANK, group=self.group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _set_group_timeout(timeout: timedelta, group: Any) -> None:
    # torch's private setter (torch 2.2 and later, same signature). Where it is missing or
    # refuses, the group keeps the join's longer timeout, which only delays an error.
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:
        log.warning("overlapckpt: this torch has no _set_pg_timeout: the writers' group keeps its join timeout for its collectives")
        return
    try:
        setter(timeout, group)
    except (RuntimeError, TypeError) as e:
        log.warning("overlapckpt: the writers' group keeps its join timeout for its collectives: _set_pg_timeout failed (%s)", e)
