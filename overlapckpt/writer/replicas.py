"""Peer replicas of the node-local tier: files copied between nodes' tiers through the writers' group.

Runs in the writer processes, never the training's: the copies go over the writers' own
gloo group (``group.py``), so they share no communicator with training.

* **At a local-tier checkpoint** (``replicate_attempt``): once DCP has written every
  rank's shards into its node's attempt directory, each rank's files go to its partners
  (``format/peers.py``), then the coordinator's manifest and ``.metadata`` go to every
  other node's leader. Only then does each node's leader publish its directory: a
  local-tier checkpoint is listed once every shard and its replicas are in place, on
  every node. A failure anywhere raises on every rank and nothing is published.
* **At a restore** (``fetch_into_tier``): the training side works out which node lacks
  which file of the checkpoint to restore (``restore/tiers.py``), and the writers copy
  them from nodes that hold them; a node that lacked the checkpoint gets it published.

**Rate.** Each writer sends at most ``bytes_per_s`` (``replica_mib_per_s``): a file goes in
chunks of a tenth of a second's worth at the cap (``paced_chunk_bytes``), and before each
round the sender waits until its bytes so far are within the cap.
A replica is spread over seconds instead of taking the network in a burst. Once a
preemption is under way (the writer's preemption watch has seen a rank's signal), the
cap is lifted, mid-copy too: the last checkpoint has only the grace period to reach
every node's tier, and the training that the cap protects is over.

**Order.** Every rank runs the same list of copies in the same rounds: in round ``k`` each
copy sends its ``k``-th chunk (``isend``, tagged with the copy's index) and each receiver
posts the matching ``irecv``, then all are waited on. No rank waits on a rank that is not
in the same round; a dead peer surfaces as the group's timeout.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointWriteError
from ..format.attempts import Attempt, new_attempt_id
from ..format.manifest import MANIFEST_NAME
from ..format.peers import NodeLayout
from ..format.private_files import open_regular_file, recreate_private_file
from ..format.storage import CheckpointStore
from ..protocol import FileCopy
from .group import WriterGroup

log = logging.getLogger("overlapckpt")

CHUNK_BYTES = 8 << 20  # per copy and round at most: the memory a round holds, per copy in flight
# A paced copy's rounds carry this many seconds' worth of bytes at the cap (no fewer than
# MIN_PACED_CHUNK_BYTES): a shard smaller than 8 MiB is spread over rounds too, instead of
# one burst followed by an idle wait.
PACE_ROUND_S = 0.1
MIN_PACED_CHUNK_BYTES = 4 << 10
_PART_SUFFIX = ".replica-part"
# The longest a paced sender sleeps before it asks again whether a preemption lifted the cap.
_PACE_SLICE_S = 0.05
METADATA_NAME = ".metadata"


def node_layout(group: WriterGroup | None) -> NodeLayout | None:
    """The nodes of the writers' group, where its ranks run on more than one; None on one node."""
    if group is None or not group.spec.node_of_rank:
        return None
    layout = NodeLayout(tuple(group.spec.node_of_rank))
    return layout if layout.node_count > 1 else None


def own_files(directory: str, rank: int) -> list[tuple[str, int]]:
    """(name, bytes) of the shard files rank ``rank`` wrote into ``directory`` (DCP names them ``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    names = sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".distcp"))
    return [(n, os.lstat(os.path.join(directory, n)).st_size) for n in names]


def agree_on_failure(group: WriterGroup, failure: BaseException | None, what: str) -> None:
    """A collective: if any rank failed ``what``, CheckpointWriteError on every rank, naming each failure."""
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, None if failure is None else f"{type(failure).__name__}: {failure}", group=group.group)
    failed = [(rank, text) for rank, text in enumerate(gathered) if text is not None]
    if failed:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise CheckpointWriteError(f"{what} failed ({detail})") from failure


def replicate_attempt(
    group: WriterGroup,
    layout: NodeLayout,
    store: CheckpointStore,
    directory: str,
    bytes_per_s: float,
    unpaced: Callable[[], bool] | None = None,
) -> int:
    """Copy each rank's shards of attempt ``directory`` to its partners, and the manifest and ``.metadata`` to every node.

    A collective of every writer; the bytes this rank received. Every file is durable
    (fsynced) in its node's attempt directory when it returns; nothing is published here.
    Sent at most ``bytes_per_s``, except while ``unpaced()`` says so (a preemption's grace is short).
    """
    where = store.checkpoint_url(directory)
    mine: list[tuple[str, int]] = []
    failure: BaseException | None = None
    try:
        mine = own_files(where, group.rank)
    except OSError as e:
        failure = e
    agree_on_failure(group, failure, f"listing the local tier's shards in {where}")
    listed: list[Any] = [None] * group.world_size
    dist.all_gather_object(listed, mine, group=group.group)
    replicas = group.spec.local_replicas
    copies = [
        FileCopy(source, partner, name, nbytes)
        for source, files in enumerate(listed)
        for partner in layout.partners(source, replicas)
        for name, nbytes in files
    ]
    received = copy_files(group, copies, where, where, bytes_per_s, unpaced)
    # The manifest and .metadata, which the coordinator's DCP finish wrote on its node only.
    commit_files: tuple[bytes, bytes] | None = None
    if group.is_coordinator:
        commit_files = (store.read_bytes(directory, MANIFEST_NAME), store.read_bytes(directory, METADATA_NAME))
    manifest_bytes, metadata_bytes = group.share_from_coordinator(commit_files)
    failure = None
    if layout.is_leader(group.rank) and layout.node_of_rank[group.rank] != layout.node_of_rank[0]:
        try:
            store.write_manifest(directory, manifest_bytes)
            store.write_bytes(directory, METADATA_NAME, metadata_bytes)  # last, as DCP's own commit
        except OSError as e:
            failure = e
    agree_on_failure(group, failure, f"writing the manifest and .metadata of {where} on every node")
    return received


def copy_files(
    group: WriterGroup,
    copies: Sequence[FileCopy],
    read_dir: str,
    write_dir: str,
    bytes_per_s: float,
    unpaced: Callable[[], bool] | None = None,
) -> int:
    """Run ``copies`` (the same list on every rank): this rank sends its own, receives its own; bytes received.

    The sender keeps within ``bytes_per_s`` unless ``unpaced()``: asked between rounds, and
    while it waits, so a preemption that comes during a paced copy speeds up the rest of it.
    """
    rank = group.rank
    outgoing = [(index, c) for index, c in enumerate(copies) if c.source == rank]
    incoming = [(index, c) for index, c in enumerate(copies) if c.target == rank]
    readers: dict[int, Any] = {}
    writers: dict[int, Any] = {}
    failure = _open_ends(outgoing, incoming, read_dir, write_dir, readers, writers)
    try:
        agree_on_failure(group, failure, "opening the files to copy between nodes")
        chunk_bytes = paced_chunk_bytes(bytes_per_s)  # the same on every rank: the cap is the run's
        rounds = max((-(-c.nbytes // chunk_bytes) for c in copies), default=0)
        started, sent = time.monotonic(), 0
        for k in range(rounds):
            # Before the round, not after it: the last round is followed by no wait.
            pace_sender(sent, bytes_per_s, started, unpaced)
            works: list[Any] = []
            received: list[tuple[int, torch.Tensor]] = []
            for index, c in outgoing:
                chunk = readers[index].read(chunk_bytes) if k * chunk_bytes < c.nbytes else b""
                if chunk:
                    works.append(dist.isend(torch.frombuffer(bytearray(chunk), dtype=torch.uint8), c.target, group=group.group, tag=index))
                    sent += len(chunk)
            for index, c in incoming:
                length = min(chunk_bytes, c.nbytes - k * chunk_bytes)
                if length > 0:
                    buffer = torch.empty(length, dtype=torch.uint8)
                    works.append(dist.irecv(buffer, c.source, group=group.group, tag=index))
                    received.append((index, buffer))
            for work in works:
                work.wait()  # gloo's isend/irecv always return a Work
            for index, buffer in received:
                writers[index].write(buffer.numpy().tobytes())
        _commit_received(incoming, writers, write_dir)
    finally:
        for f in [*readers.values(), *writers.values()]:
            f.close()
    total = sum(c.nbytes for _, c in incoming)
    if incoming or outgoing:
        log.info("overlapckpt: rank %d sent %d and received %d bytes of replicas", rank, sum(c.nbytes for _, c in outgoing), total)
    return total


def _open_ends(
    outgoing: list[tuple[int, FileCopy]],
    incoming: list[tuple[int, FileCopy]],
    read_dir: str,
    write_dir: str,
    readers: dict[int, Any],
    writers: dict[int, Any],
) -> BaseException | None:
    """Open this rank's ends of its copies, by copy index: the files it sends into ``readers``, the parts it receives into ``writers``.

    Filled in place, so that the caller closes whatever opened before a failure; the failure is
    returned, for every rank to hear of it (``agree_on_failure``).
    """
    try:
        for index, c in outgoing:
            # A regular file, never a link's target or a FIFO, at the size the manifest gives it.
            readers[index], size = open_regular_file(os.path.join(read_dir, c.filename))
            if size != c.nbytes:
                raise CheckpointWriteError(f"{os.path.join(read_dir, c.filename)} holds {size} bytes, {c.nbytes} were listed")
        for index, c in incoming:
            # A tier's file: 0600, over what a killed copy left.
            writers[index] = os.fdopen(recreate_private_file(os.path.join(write_dir, c.filename + _PART_SUFFIX)), "wb")
    except (OSError, CheckpointWriteError) as e:
        return e
    return None


def _commit_received(incoming: list[tuple[int, FileCopy]], writers: dict[int, Any], write_dir: str) -> None:
    """Each received part made durable (fsynced), closed and renamed onto its file's name: a file appears only whole."""
    for index, c in incoming:
        f = writers.pop(index)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(os.path.join(write_dir, c.filename + _PART_SUFFIX), os.path.join(write_dir, c.filename))


def paced_chunk_bytes(bytes_per_s: float) -> int:
    """The bytes of one copy in one round: ``PACE_ROUND_S`` at the cap, within [MIN_PACED_CHUNK_BYTES, CHUNK_BYTES]."""
    if bytes_per_s == float("inf"):
        return CHUNK_BYTES
    return max(MIN_PACED_CHUNK_BYTES, min(CHUNK_BYTES, int(bytes_per_s * PACE_ROUND_S)))


def pace_sender(sent: int, bytes_per_s: float, started: float, unpaced: Callable[[], bool] | None) -> None:
    """The cap: hold this sender until its bytes so far are within ``bytes_per_s`` of the copy's start."""
    while not (unpaced is not None and unpaced()):
        ahead_s = sent / bytes_per_s - (time.monotonic() - started)
        if ahead_s <= 0:
            return
        time.sleep(min(ahead_s, _PACE_SLICE_S))  # pacing the sender, not waiting for work


def fetch_into_tier(group: WriterGroup, store: CheckpointStore, name: str, copies: Sequence[FileCopy], run_id: str) -> int:
    """At a restore: copy the checkpoint ``name``'s files a node lacks from the nodes that hold them (every writer).

    A receiving rank (its node's leader) writes into the committed directory when its node
    has one, else into a new attempt that it publishes once every file is in.
    """
    receiving = any(c.target == group.rank for c in copies)
    attempt: Attempt | None = None
    failure: BaseException | None = None
    try:
        if receiving and not store.is_committed(name):
            attempt = Attempt(store, name, run_id, new_attempt_id(run_id))
            attempt.begin()
    except Exception as e:  # noqa: BLE001 - reported on every rank below, never left one rank behind
        failure = e
    agree_on_failure(group, failure, f"preparing to fetch checkpoint {name} into the local tiers")
    directory = store.checkpoint_url(attempt.directory if attempt is not None else name)
    # Every rank reads its own node's directory: a sender holds the committed checkpoint there.
    source_dir = store.checkpoint_url(name)
    try:
        received = copy_files(group, copies, source_dir, directory, float("inf"))
    except BaseException:
        if attempt is not None:
            attempt.abandon()
        raise
    failure = None
    if attempt is not None:
        try:
            attempt.publish()
        except Exception as e:  # noqa: BLE001 - reported on every rank
            failure = e
    agree_on_failure(group, failure, f"publishing the fetched checkpoint {name}")
    return received
