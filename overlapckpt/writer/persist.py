"""Persist one snapshot from the shared host slot: replay, checksums, manifest, DCP save, commit.

Runs in the writer process. In a distributed run (a ``WriterGroup``), every rank's
writer runs it for the same checkpoint: the ranks agree on the checkpoint first,
each writes its share through DCP with the writers' group, and the coordinator
(rank 0) writes the one manifest (a section per rank) right before ``.metadata``,
then ``latest`` and retention.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import protocol as p
from ..errors import CheckpointExistsError, CheckpointWriteError, InternalError
from ..format.attempts import Attempt, already_committed, new_attempt_id
from ..format.blob_macs import default_mac_algorithm
from ..format.blobsums import ChecksummingFileSystem, StoredChecksums, StreamTimings
from ..format.checksum import default_algorithm
from ..format.entries import TensorEntry, build_state_dict
from ..format.extra_state import encode
from ..format.key_layout import TORCHTITAN
from ..format.known_sums import KnownChecksums
from ..format.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    CheckpointInfo,
    ChecksumsRecord,
    ExportRecord,
    ItemRecord,
    Manifest,
    RankSection,
    dump_manifest,
    parse_manifest,
    tensor_checksum,
)
from ..format.peers import NodeLayout
from ..format.shards import CoveringSavePlanner, LocalShard
from ..format.signing import sign
from ..format.storage import BeforeCommit, CheckpointStore
from ..format.tiers import LOCAL_TIER, ROOT_TIER
from ..hostbuf import exact_view
from .exports import write_exports
from .group import WriterGroup
from .replicas import agree_on_failure, node_layout, replicate_attempt
from .retention import Retired, remember_lineage, retire_old


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def persist_snapshot(
    stores: dict[str, CheckpointStore],
    group: WriterGroup | None,
    entries: list[TensorEntry],
    offsets: tuple[int, ...],
    global_shapes: dict[str, tuple[int, ...]],
    buffers: dict[int, torch.Tensor],
    req: p.PersistRequest,
    signing_key: bytes | None = None,
    write_threads: int = 1,
    on_replay: Callable[[bool], None] | None = None,
    purge_later: Retired | None = None,
    replay_tables: p.ReplayTables | None = None,
    unpaced: Callable[[], bool] | None = None,
) -> p.CommittedResponse:
    """Persist one snapshot and commit it in each of its tiers (``req.tiers``, in order); the answer for the training side.

    ``stores`` maps each tier to its store (``format/tiers.py``). The snapshot is replayed and
    checksummed once; each tier then gets its own attempt, DCP save, commit, ``latest`` and
    retention (``req.local_keep`` in the local tier, ``req.keep`` in the root). The local
    tier goes first: it is the faster, and what a preemption's grace must reach.
    ``purge_later`` receives the directories of checkpoints retention retired (already
    uncommitted and out of the listing): the caller deletes them after answering.
    """
    started = time.perf_counter()
    purge_later = purge_later if purge_later is not None else []
    missing = [tier for tier in req.tiers if tier not in stores]
    if missing or not req.tiers:
        raise InternalError(f"checkpoint {req.name} is for tiers {req.tiers}, but this writer has stores for {sorted(stores)}")
    if group is not None:
        # Before any work: a rank that disagrees must not leave the others in a collective.
        claim = {"name": req.name, "version": req.step, "requested": req.requested_step}
        if req.tiers != (ROOT_TIER,):  # ranks that would write different tiers would enter different collectives
            claim["tiers"] = ",".join(req.tiers)
        sequence = group.agree(claim)
        # The manifest and the coverage check need every rank's tensors: pipeline stages hold different ones.
        global_shapes = group.union_of_shapes(global_shapes)
    if group is None and all(stores[tier].is_committed(req.name) for tier in req.tiers):
        # Persisted again by the successor of a writer that died after the commit (the rename)
        # and before it answered: this run's own checkpoint of this step is a success.
        done = [_committed_already(stores[tier], tier, req, started, purge_later) for tier in req.tiers]
        return _merged(done)
    slot = buffers[req.buffer_id]
    # Exact-storage views: DCP writes them in place instead of cloning each (hostbuf.exact_view).
    tensors = [exact_view(slot, off, e.dtype, e.shape) for e, off in zip(entries, offsets)]
    if req.replay is not None:
        from .replay import replay_to_version

        # The training side hears of it before the slot is written, and once it holds the
        # version: a successor of a writer killed in between must not replay it again.
        if on_replay is not None:
            on_replay(False)
        if replay_tables is None:
            raise InternalError(f"the snapshot of step {req.step} needs replay, but its plan {req.plan_id} came without replay tables")
        replay_to_version(entries, tensors, req.replay, replay_tables, buffers[req.replay.grad_buffer_id])
        if on_replay is not None:
            on_replay(True)
    phases = PhaseClock(started)
    phases.lap("agree_and_replay")
    # Per local part: the checksum of the host snapshot, checked against what DCP decodes at
    # load. The same algorithm as the stored bytes' (the storage writer's default_algorithm()).
    algorithm = default_algorithm()
    checksums = [tensor_checksum(t, algorithm) for t in tensors]
    parts = {
        e.key: ItemRecord(
            dtype=_dtype_name(e.dtype),
            shape=tuple(e.shape),
            checksum=checksum,
            offset=tuple(e.global_offset or (0,) * len(e.shape)),
        )
        for e, checksum in zip(entries, checksums)
    }
    # DCP stores these very bytes next: their checksums are not computed a second time (known_sums.py).
    known = KnownChecksums(algorithm)
    for t, checksum in zip(tensors, checksums):
        known.add(t, int(checksum, 16))
    phases.lap("snapshot_checksums")
    section = RankSection(
        rank=0 if group is None else group.rank,
        nbytes=sum(e.nbytes for e in entries),
        items=parts,
        extra_state=encode(req.extra_state, "extra_state"),
        ledger=req.ledger,
        stats=req.stats,
    )
    sections = [section] if group is None else group.gather_sections(section)
    manifest = _manifest(req, entries, global_shapes, sections, group)
    # The torchtitan layout saves the stateful objects as DCP items too, for TorchTitan's own manager.
    stateful = req.extra_state.get("stateful", {}) if req.key_layout == TORCHTITAN else None
    state_dict = build_state_dict(entries, [_part(e, t) for e, t in zip(entries, tensors)], req.small_state, req.key_layout, stateful)
    answers: list[p.CommittedResponse] = []
    for tier in req.tiers:
        store = stores[tier]
        keep = req.local_keep if tier == LOCAL_TIER else req.keep
        layout = node_layout(group) if tier == LOCAL_TIER else None  # a local tier on several nodes: replicated
        if _held_already(store, group, req, layout):  # this run committed it here (before a writer's death, or a local-only checkpoint)
            answers.append(_committed_already(store, tier, req, started, purge_later, _leads(group, layout)))
            continue
        write = _TierWrite(store, tier, keep, group, req, manifest, algorithm, signing_key, phases, layout, unpaced, known)
        answers.append(write.run(state_dict, entries, global_shapes, write_threads, purge_later, started))
    agreed_window = group.agree_window(req.proposed_next_window) if group is not None else req.proposed_next_window
    if group is not None:
        group.forget(sequence)  # agree_window was a collective: every rank is past the wait on these keys
    answer = _merged(answers)
    answer.agreed_next_window = agreed_window
    answer.persist_s = time.perf_counter() - started
    return answer


def _merged(answers: list[p.CommittedResponse]) -> p.CommittedResponse:
    """One answer for a checkpoint's tiers: the last tier's info and commit time, every tier's paths, removals and warnings."""
    last = answers[-1]
    return dataclasses.replace(
        last,
        removed=[name for a in answers for name in a.removed],
        warnings=[w for a in answers for w in a.warnings],
        tier_paths={tier: path for a in answers for tier, path in a.tier_paths.items()},
        phases_s={k: v for a in answers for k, v in a.phases_s.items()},
    )


class _TierWrite:
    """One tier's write of a prepared snapshot: attempt, DCP save with the manifest before ``.metadata``, commit, ``latest``, retention."""

    def __init__(
        self,
        store: CheckpointStore,
        tier: str,
        keep: int | None,
        group: WriterGroup | None,
        req: p.PersistRequest,
        manifest: Manifest,
        algorithm: str,
        signing_key: bytes | None,
        phases: PhaseClock,
        layout: NodeLayout | None = None,
        unpaced: Callable[[], bool] | None = None,
        known: KnownChecksums | None = None,
    ) -> None:
        self.known = known  # the snapshot's checksums, for the shards' (known_sums.py)
        self.store, self.tier, self.keep, self.group, self.req = store, tier, keep, group, req
        # Across nodes (the local tier's peer replicas): each node's leader makes, publishes and
        # retires its node's directory; on one node (and in the root) the coordinator does.
        self.layout = layout
        self.unpaced = unpaced  # while it says so (a preemption), replicas go at full speed
        self.leads = _leads(group, layout)
        self.manifest, self.algorithm, self.signing_key, self.phases = manifest, algorithm, signing_key, phases
        # Laps of the root keep their names (the figures read them); the local tier's are prefixed.
        self.prefix = "" if tier == ROOT_TIER else f"{tier}."

    def run(
        self,
        state_dict: dict[str, Any],
        entries: list[TensorEntry],
        global_shapes: dict[str, tuple[int, ...]],
        write_threads: int,
        purge_later: Retired,
        started: float,
    ) -> p.CommittedResponse:
        # The caller asked _held_already first: a checkpoint committed here is this run's (answered) or refused.
        store, group, req, phases = self.store, self.group, self.req, self.phases
        attempt = _begin_attempt(store, group, req)
        exports: dict[str, ExportRecord] = {}
        wrote_manifest: list[bool] = []

        def write_manifest(checksums: StoredChecksums) -> None:
            # Called by DCP's finish() on the coordinator with the checksums every rank computed
            # of the blobs it stored, and of .metadata's bytes, right before .metadata appears.
            where = store.checkpoint_url(req.name)
            if checksums.algorithm != self.algorithm:
                raise CheckpointWriteError(
                    f"the shards of {where} were checksummed with {checksums.algorithm!r} and its tensors with {self.algorithm!r}; "
                    "a store's make_writer must use format.checksum.default_algorithm()"
                )
            document = dataclasses.replace(
                self.manifest, checksums=ChecksumsRecord.from_json(checksums.to_json(), where), exports=exports, created_at=time.time()
            ).to_json()
            if self.signing_key is not None:
                sign(document, checksums.metadata_bytes, self.signing_key)
            phases.lap(self.prefix + "write")  # serialization, stored-byte checksums, page cache, writeback, fsync: split below
            raw = dump_manifest(document)
            store.write_manifest(attempt.directory, raw)
            remember_lineage(raw, document["run_id"], document["step"])  # read unparsed by the next commits' retention
            phases.lap(self.prefix + "manifest")
            wrote_manifest.append(True)

        try:
            if self.layout is not None:
                assert group is not None  # node_layout() gives one only with a group
                _begin_on_every_node(attempt, group, self.layout)
            if req.export_formats:  # one process only (the Checkpointer refuses it distributed): whole tensors
                exports.update(write_exports(store, attempt.directory, req.export_formats, state_dict, req.extra_state, self.signing_key))
            streams = _save(
                store, attempt.directory, state_dict, write_manifest, global_shapes, group, self.signing_key, write_threads, self.known
            )
            if not wrote_manifest:  # a rank that does not write the manifest: its write ends here
                phases.lap(self.prefix + "write")
            if self.layout is not None:
                # Before any node publishes: every shard on its node and its partners' (writer/replicas.py).
                assert group is not None
                replicate_attempt(group, self.layout, store, attempt.directory, group.spec.replica_bytes_per_s, self.unpaced)
                phases.lap(self.prefix + "replicas")
            publish_failure: BaseException | None = None
            if self.leads:
                try:
                    attempt.publish()  # the commit: every rank's shards are in place (DCP's finish ran after them)
                except Exception as e:
                    if self.layout is None:
                        raise
                    publish_failure = e
            if self.layout is not None:
                assert group is not None
                agree_on_failure(group, publish_failure, f"publishing {store.checkpoint_url(req.name)} on every node")
        except BaseException:
            if self.leads:
                _abandon(attempt)
            raise
        committed_at = time.time()
        removed: list[str] = []
        warnings: list[str] = []
        if self.leads:  # committed: a failure from here on is a warning
            warnings = _write_latest(store, req)
            removed, retention_warnings = retire_old(store, req, self.keep, purge_later, local_tier=self.tier == LOCAL_TIER)
            warnings += retention_warnings
        phases.lap(self.prefix + "commit")
        path = store.checkpoint_url(req.name)
        stream_phases = {} if streams is None else {self.prefix + k: v for k, v in streams.as_phases().items()}
        return p.CommittedResponse(
            request_id=req.request_id,
            info=CheckpointInfo.from_manifest(self.manifest, path, self.tier),
            committed_at=committed_at,
            persist_s=time.perf_counter() - started,
            phases_s={**phases.laps, **stream_phases},
            removed=removed,
            warnings=warnings,
            tier_paths={self.tier: path},
        )


def _write_latest(store: CheckpointStore, req: p.PersistRequest) -> list[str]:
    """After the commit: ``latest``; a failure here is a warning, never a failed persist."""
    try:
        store.write_latest(req.name)
    except Exception as e:
        return [f"checkpoint {req.name} committed, but updating {store.root}/latest failed: {type(e).__name__}: {e}"]
    return []


def _leads(group: WriterGroup | None, layout: NodeLayout | None) -> bool:
    """Whether this rank makes, publishes and retires the tier's directories: its node's leader, else the coordinator."""
    if group is None:
        return True
    return layout.is_leader(group.rank) if layout is not None else group.is_coordinator


def _begin_on_every_node(attempt: Attempt, group: WriterGroup, layout: NodeLayout) -> None:
    """The attempt's directory on every other node too (the coordinator made its own): before any rank writes there."""
    failure: BaseException | None = None
    if layout.is_leader(group.rank) and not group.is_coordinator:
        try:
            attempt.begin()
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            failure = e
    agree_on_failure(group, failure, f"making the attempt {attempt.directory} in every node's local tier")


def _held_already(store: CheckpointStore, group: WriterGroup | None, req: p.PersistRequest, layout: NodeLayout | None = None) -> bool:
    """Whether this run's checkpoint of this version is committed in ``store`` already (another run's: refused).

    A writer that died after a commit and before answering leaves one; so does a local-only
    checkpoint whose version a ``request()`` then asks of both tiers. In a distributed run
    the coordinator looks, and every rank learns its verdict (a collective every rank reaches).
    """
    verdict: str | bool = False
    if _leads(group, layout):
        if store.is_committed(req.name):
            try:
                manifest = parse_manifest(store.read_bytes(req.name, MANIFEST_NAME), store.checkpoint_url(req.name))
                verdict = manifest.run_id == req.run_id and manifest.step == req.step
            except Exception:  # noqa: BLE001 - unreadable: not provably this run's, so refused below
                verdict = False
            if not verdict:
                verdict = str(already_committed(store, req.name))
    if group is not None and layout is not None:
        return _held_on_every_node(group, layout, req, verdict)
    if group is not None:
        verdict = group.share_from_coordinator(verdict)
    if isinstance(verdict, str):
        raise CheckpointExistsError(verdict)
    return verdict


def _held_on_every_node(group: WriterGroup, layout: NodeLayout, req: p.PersistRequest, verdict: str | bool) -> bool:
    """Every node leader's verdict, on every rank: held on all nodes, on none, or refused (a collective)."""
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, verdict, group=group.group)
    leaders = [gathered[r] for r in range(group.world_size) if layout.is_leader(r)]
    refusals = [v for v in leaders if isinstance(v, str)]
    if refusals:
        raise CheckpointExistsError(refusals[0])
    if all(leaders):
        return True
    if any(leaders):
        # A writer died between two nodes' publishes: the nodes that listed it keep it, the
        # others cannot add it now (its snapshot may be gone); this version is not written again.
        raise CheckpointWriteError(
            f"checkpoint {req.name} is committed in the local tier of some nodes only (nodes "
            f"{[layout.node_of_rank[r] for r in range(group.world_size) if layout.is_leader(r) and gathered[r] is True]}); "
            "the next checkpoint commits on every node"
        )
    return False


def _committed_already(
    store: CheckpointStore, tier: str, req: p.PersistRequest, started: float, purge_later: Retired, leads: bool = True
) -> p.CommittedResponse:
    """The answer for a checkpoint this run committed already (a writer died before answering); else refused."""
    where = store.checkpoint_url(req.name)
    try:
        manifest = parse_manifest(store.read_bytes(req.name, MANIFEST_NAME), where)
    except Exception:
        raise already_committed(store, req.name) from None
    if manifest.run_id != req.run_id or manifest.step != req.step:
        raise already_committed(store, req.name)
    warnings: list[str] = []
    removed: list[str] = []
    if leads:
        warnings = _write_latest(store, req)
        removed, retention_warnings = retire_old(
            store, req, req.local_keep if tier == LOCAL_TIER else req.keep, purge_later, local_tier=tier == LOCAL_TIER
        )
        warnings += retention_warnings
    return p.CommittedResponse(
        request_id=req.request_id,
        info=CheckpointInfo.from_manifest(manifest, where, tier),
        committed_at=manifest.created_at,
        persist_s=time.perf_counter() - started,
        removed=removed,
        warnings=warnings,
        agreed_next_window=req.proposed_next_window,
        tier_paths={tier: where},
    )


def _begin_attempt(store: CheckpointStore, group: WriterGroup | None, req: p.PersistRequest) -> Attempt:
    """This checkpoint's attempt (attempts.py): the coordinator makes its place, every rank learns where it is."""
    attempt = Attempt(store, req.name, req.run_id, new_attempt_id(req.run_id), root_leased=req.root_leased)
    refusal: str | None = None
    if group is None or group.is_coordinator:
        try:
            attempt.begin()
        except CheckpointExistsError as e:
            if group is None:
                raise
            refusal = str(e)
    if group is None:
        return attempt
    # A collective every rank reaches: a refusal on the coordinator raises on every rank.
    attempt_id, refusal = group.share_from_coordinator((attempt.attempt_id, refusal))
    if refusal is not None:
        raise CheckpointExistsError(refusal)
    return dataclasses.replace(attempt, attempt_id=attempt_id)


def _abandon(attempt: Attempt) -> None:
    """A failed attempt leaves nothing behind (a disk-full write's partial shard frees its space)."""
    try:
        attempt.abandon()
    except Exception:  # noqa: BLE001 - the write's own error is the one to report
        pass


def _part(entry: TensorEntry, tensor: torch.Tensor) -> Any:
    # A whole tensor is written as itself; a shard as a part of the global tensor.
    if entry.is_whole:
        return tensor
    return LocalShard(tensor, entry.global_shape, entry.global_offset)


def _manifest(
    req: p.PersistRequest,
    entries: list[TensorEntry],
    global_shapes: dict[str, tuple[int, ...]],
    sections: list[RankSection] | None,
    group: WriterGroup | None,
) -> Manifest:
    """The manifest less its checksums (known at DCP's finish). Not the coordinator: only what CheckpointInfo needs."""
    world_size = 1 if group is None else group.world_size
    common: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": req.step,
        "requested_step": req.requested_step,
        "mode": req.mode,
        "window": req.window,
        "torch_version": torch.__version__,
        "created_at": time.time(),
        "world_size": world_size,
        "mesh_shape": (1,) if group is None else tuple(group.spec.mesh_shape),
        "ledger": req.ledger,
        "stats": req.stats,
        "run_id": req.run_id,
        "restored_from": req.restored_from,
        "ancestors": tuple(req.ancestors),
        "extra_state_index": tuple(sorted(req.extra_state.keys())),
        "key_layout": req.key_layout,
        "optimizer": req.optimizer,
        # How each param group was replayed, and how exactly: the coordinator's own (every rank measures its groups alike).
        "replay_arithmetic": tuple(req.replay.group_arithmetics) if req.replay is not None else (),
    }
    if sections is None:
        return Manifest(nbytes=sum(e.nbytes for e in entries), items={}, **common)
    nbytes = sum(s.nbytes for s in sections)
    if world_size == 1:
        (only,) = sections
        items = {e.key: ItemRecord(dtype=_dtype_name(e.dtype), shape=tuple(e.shape), checksum=only.items[e.key].checksum) for e in entries}
        return Manifest(nbytes=nbytes, items=items, extra_state=only.extra_state, **common)
    # The tensors of the whole checkpoint, by global shape; each rank's parts and their CRC-32s in its section.
    dtype_of = {key: part.dtype for s in sections for key, part in s.items.items()}
    items = {key: ItemRecord(dtype=dtype_of.get(key, ""), shape=tuple(shape)) for key, shape in global_shapes.items()}
    return Manifest(nbytes=nbytes, items=items, ranks=tuple(sections), **common)


def _save(
    store: CheckpointStore,
    name: str,
    state_dict: dict[str, Any],
    write_manifest: BeforeCommit,
    global_shapes: dict[str, tuple[int, ...]],
    group: WriterGroup | None,
    signing_key: bytes | None = None,
    write_threads: int = 1,
    known: KnownChecksums | None = None,
) -> StreamTimings | None:
    """DCP's save of ``state_dict`` into ``name``; where the shards' time went, when the store's writer says.

    ``signing_key``: every blob gets a MAC under it (``format/blob_macs.py``), and the
    manifest's signature needs ``.metadata``'s bytes.
    """
    import torch.distributed.checkpoint as dcp

    # Only a signature needs .metadata's bytes, and only more than one thread a thread count;
    # a store subclass written for make_writer(name, before_commit) keeps working without them.
    extra: dict[str, Any] = {"wants_metadata_bytes": True} if signing_key is not None else {}
    if write_threads > 1:
        extra["thread_count"] = write_threads
    writer = store.make_writer(name, before_commit=write_manifest, **extra)
    fs = getattr(writer, "fs", None)
    if known is not None and isinstance(fs, ChecksummingFileSystem):
        fs.known_checksums = known
    if signing_key is not None:
        if not isinstance(fs, ChecksummingFileSystem):
            raise CheckpointWriteError(
                f"{type(store).__name__}.make_writer returned a writer whose files are not checksummed, so its blobs "
                "cannot be signed; build it with CheckpointStore.make_writer's writer class"
            )
        fs.mac_key, fs.mac_algorithm = signing_key, default_mac_algorithm()
    planner = CoveringSavePlanner(global_shapes)
    if group is None:
        with warnings.catch_warnings():
            # no_dist=True is deliberate: a single writer saves its own process's snapshot.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state_dict, storage_writer=writer, planner=planner, no_dist=True)
    else:
        dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group.group)
    timings = getattr(getattr(writer, "fs", None), "timings", None)
    return timings() if callable(timings) else None


class PhaseClock:
    """Consecutive phases of a persist, in seconds: each ``lap`` ends one, named, and starts the next."""

    def __init__(self, started: float) -> None:
        self.laps: dict[str, float] = {}
        self._last = started

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self._last
        self._last = now

