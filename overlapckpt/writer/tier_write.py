"""One tier's write of a prepared snapshot: the attempt, DCP's save with the manifest before ``.metadata``, the commit, ``latest``, retention.

Runs in the writer process, once per tier of a checkpoint (``persist.py`` prepares the
snapshot once). In the local tier across nodes, each node's leader makes, publishes and
retires its node's directory, and the shards are replicated to partner nodes before any
node publishes (``replicas.py``); in the root (and on one node) the coordinator does.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

from .. import protocol as p
from ..errors import CheckpointExistsError, CheckpointWriteError
from ..format.attempts import Attempt, new_attempt_id
from ..format.blob_macs import default_mac_algorithm
from ..format.blobsums import ChecksummingFileSystem, StoredChecksums
from ..format.checksumming_stream import StreamTimings
from ..format.commit_writer import BeforeCommit
from ..format.manifest import CheckpointInfo, dump_manifest
from ..format.manifest_records import ExportRecord, RankSection
from ..format.peers import NodeLayout
from ..format.shards import CoveringSavePlanner
from ..format.signing import sign
from ..format.storage import CheckpointStore
from ..format.tiers import LOCAL_TIER, ROOT_TIER
from . import group_save
from .exports import write_exports
from .group import WriterGroup
from .persist_context import PersistContext, PreparedSnapshot
from .replicas import agree_on_failure, replicate_attempt
from .retention import Retired, remember_lineage, retire_old
from .snapshot_manifest import build_manifest


def write_tier(
    ctx: PersistContext,
    tier: str,
    snapshot: PreparedSnapshot,
    layout: NodeLayout | None,
    purge_later: Retired,
    attempt: Attempt | None = None,
) -> p.CommittedResponse:
    """Write ``snapshot`` to ``tier`` and commit it there; the caller asked ``held_already`` first.

    ``layout``: the local tier across nodes (replicated); None in the root and on one node.
    A checkpoint committed here already is this run's (answered by the caller) or refused.
    ``attempt``: begun already (``held_or_begun``), else begun here.
    """
    store, req = ctx.stores[tier], snapshot.req
    # Laps of the root keep their names (the figures read them); the local tier's are prefixed.
    prefix = "" if tier == ROOT_TIER else f"{tier}."
    if attempt is None:
        attempt = begin_attempt(store, ctx.group, req)
    streams = _write_and_publish(ctx, tier, snapshot, layout, attempt, prefix)
    committed_at = time.time()
    removed: list[str] = []
    warnings_: list[str] = []
    if leads(ctx.group, layout):  # committed: a failure from here on is a warning
        removed, warnings_ = after_commit(store, tier, req, purge_later)
    path = store.checkpoint_url(req.name)
    if ctx.group is not None and layout is None:
        _commit_barrier(ctx.group, path)
    snapshot.phases.lap(prefix + "commit")
    stream_phases = {} if streams is None else {prefix + k: v for k, v in streams.as_phases().items()}
    return p.CommittedResponse(
        request_id=req.request_id,
        info=CheckpointInfo.from_manifest(snapshot.manifest, path, tier),
        committed_at=committed_at,
        persist_s=time.perf_counter() - snapshot.started,
        phases_s={**snapshot.phases.laps, **stream_phases},
        removed=removed,
        warnings=warnings_,
        tier_paths={tier: path},
    )


def _write_and_publish(
    ctx: PersistContext, tier: str, snapshot: PreparedSnapshot, layout: NodeLayout | None, attempt: Attempt, prefix: str
) -> StreamTimings | None:
    """DCP's save into ``attempt`` (the manifest written at its finish), the replicas, and the commit; abandoned on failure."""
    store, group, req, phases = ctx.stores[tier], ctx.group, snapshot.req, snapshot.phases
    exports: dict[str, ExportRecord] = {}
    wrote_manifest: list[bool] = []

    def write_manifest(checksums: StoredChecksums) -> None:
        # Called by DCP's finish() on the coordinator with the checksums every rank computed
        # of the blobs it stored, and of .metadata's bytes, right before .metadata appears.
        where = store.checkpoint_url(req.name)
        if group is None and not snapshot.sections_gathered:  # one process: its own section, its checksums hashed by now
            _take_sections(None, snapshot, [snapshot.own_section()])
        if checksums.algorithm != snapshot.algorithm:
            raise CheckpointWriteError(
                f"the shards of {where} were checksummed with {checksums.algorithm!r} and its tensors with {snapshot.algorithm!r}; "
                "a store's make_writer must use format.checksum.default_algorithm()"
            )
        document = dataclasses.replace(
            snapshot.manifest, checksums=checksums.to_record(), exports=exports, created_at=time.time()
        ).to_json()
        if ctx.signing_key is not None:
            sign(document, checksums.metadata_bytes, ctx.signing_key)
        phases.lap(prefix + "write")  # serialization, stored-byte checksums, page cache, writeback, fsync: split below
        raw = dump_manifest(document)
        store.write_manifest(attempt.directory, raw)
        remember_lineage(raw, document["run_id"], document["step"])  # read unparsed by the next commits' retention
        phases.lap(prefix + "manifest")
        wrote_manifest.append(True)

    is_leader = leads(group, layout)
    try:
        if layout is not None:
            assert group is not None  # node_layout() gives one only with a group
            _begin_on_every_node(attempt, group, layout)
        if req.export_formats:  # one process only (the Checkpointer refuses it distributed): whole tensors
            if snapshot.landing is not None:
                snapshot.landing.wait_all()  # the exports read every tensor at once
            exports.update(write_exports(store, attempt.directory, req.export_formats, snapshot.state_dict, req.extra_state, ctx.signing_key))
        if group is not None and layout is None and snapshot.saving is not None:
            streams = _save_in_group(ctx, group, store, attempt.directory, snapshot, write_manifest, prefix)
        else:
            if group is not None and not snapshot.sections_gathered:  # the manifest is written inside DCP's save
                _take_sections(group, snapshot, group.gather_on_coordinator(snapshot.own_section()))
            streams = _save(ctx, store, attempt.directory, snapshot, write_manifest)
        if not wrote_manifest:  # a rank that does not write the manifest: its write ends here
            phases.lap(prefix + "write")
        if layout is not None:
            # Before any node publishes: every shard on its node and its partners' (writer/replicas.py).
            assert group is not None
            replicate_attempt(group, layout, store, attempt.directory, group.spec.replica_bytes_per_s, ctx.unpaced)
            phases.lap(prefix + "replicas")
        _publish(attempt, group, layout)
    except BaseException:
        if is_leader:
            _abandon(attempt)
        raise
    return streams


def _publish(attempt: Attempt, group: WriterGroup | None, layout: NodeLayout | None) -> None:
    """The commit: the leader publishes ``attempt``; across nodes, a failure on any node's leader raises on every rank (a collective)."""
    publish_failure: BaseException | None = None
    if leads(group, layout):
        try:
            attempt.publish()  # the commit: every rank's shards are in place (DCP's finish ran after them)
        except Exception as e:
            if layout is None:
                if group is not None:  # the others wait in _commit_barrier's collective: they learn it there
                    _fail_commit_barrier(group, e)
                raise
            publish_failure = e
    if layout is not None:
        assert group is not None
        agree_on_failure(group, publish_failure, f"publishing {attempt.store.checkpoint_url(attempt.name)} on every node")


def _commit_barrier(group: WriterGroup, where: str) -> None:
    """Every rank answers its trainer only once the coordinator has committed (and written ``latest``, retired the old).

    A collective after the coordinator's commit: a rank's ``wait()`` must not return a
    checkpoint the coordinator has not made durable yet (it may still fail, or die). On
    the coordinator it shares None; where its publish failed, ``_publish`` shared the
    failure in this same collective, and every other rank raises it here.
    """
    failure = group.share_from_coordinator(None)
    if failure is not None:
        raise CheckpointWriteError(f"committing {where} failed on the coordinating writer (rank 0): {failure}; nothing was committed")


def _fail_commit_barrier(group: WriterGroup, failure: BaseException) -> None:
    """On the coordinator, in place of ``_commit_barrier``'s None: ``failure``, which every other rank raises there."""
    group.share_from_coordinator(f"{type(failure).__name__}: {failure}")


def _take_sections(group: WriterGroup | None, snapshot: PreparedSnapshot, sections: list[RankSection] | None) -> None:
    """Every rank's sections gathered (``sections`` on the coordinator, None elsewhere): the coordinator's manifest holds them."""
    if sections is not None:
        snapshot.manifest = build_manifest(snapshot.req, snapshot.entries, snapshot.global_shapes, sections, group)
    snapshot.sections_gathered = True


def _commit_barrier_failed(group: WriterGroup, where: str, own_failure: BaseException) -> None:
    """A rank whose own write failed: it waits in the commit barrier with the others, then raises its own error."""
    try:
        _commit_barrier(group, where)
    except CheckpointWriteError:
        pass  # the coordinator's account of this very failure: this rank's own says more
    raise own_failure


def after_commit(store: CheckpointStore, tier: str, req: p.PersistRequest, purge_later: Retired) -> tuple[list[str], list[str]]:
    """On the rank that leads the tier, once ``req``'s checkpoint is committed there: ``latest`` and the tier's retention.

    The names retention removed, and the warnings (a failure from here on never fails the persist).
    """
    warnings_ = write_latest(store, req)
    keep = req.local_keep if tier == LOCAL_TIER else req.keep
    removed, retention_warnings = retire_old(store, req, keep, purge_later, local_tier=tier == LOCAL_TIER)
    return removed, warnings_ + retention_warnings


def write_latest(store: CheckpointStore, req: p.PersistRequest) -> list[str]:
    """After the commit: ``latest``; a failure here is a warning, never a failed persist."""
    try:
        store.write_latest(req.name)
    except Exception as e:
        return [f"checkpoint {req.name} committed, but updating {store.root}/latest failed: {type(e).__name__}: {e}"]
    return []


def leads(group: WriterGroup | None, layout: NodeLayout | None) -> bool:
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


def begin_attempt(store: CheckpointStore, group: WriterGroup | None, req: p.PersistRequest) -> Attempt:
    """This checkpoint's attempt (attempts.py): the coordinator makes its place, every rank learns where it is.

    In a group, ``held_or_begun``'s broadcast with nothing held: a refusal or a storage
    error on the coordinator raises on every rank.
    """
    if group is not None:
        attempt = held_or_begun(store, group, req, _never_held)
        assert attempt is not None  # _never_held: nothing is held, so the attempt was begun
        return attempt
    attempt = Attempt(store, req.name, req.run_id, new_attempt_id(req.run_id), root_leased=req.root_leased)
    attempt.begin()
    return attempt


def _never_held() -> bool:
    return False


def held_or_begun(
    store: CheckpointStore, group: WriterGroup, req: p.PersistRequest, held_here: Callable[[], str | bool]
) -> Attempt | None:
    """In one collective: None if this run's checkpoint is committed in ``store`` already, else its attempt, begun.

    The coordinator asks ``held_here()`` (True: this run's, committed; a string: another
    run's, refused on every rank; False: not there), and begins the attempt where it is
    not there; every rank learns both from one broadcast, where asking and then beginning
    took two.
    """
    attempt = Attempt(store, req.name, req.run_id, new_attempt_id(req.run_id), root_leased=req.root_leased)
    verdict: str | bool = False
    refusal: str | None = None
    failure: BaseException | None = None
    begun = False
    if group.is_coordinator:
        # The coordinator's storage errors go into the broadcast too: the others are already
        # in it, and would otherwise wait there until the collective timeout.
        try:
            verdict = held_here()
            if verdict is False:
                attempt.begin()
                begun = True
        except CheckpointExistsError as e:
            refusal = str(e)
        except Exception as e:
            failure = e
            refusal = f"{type(e).__name__}: {e}"
    try:
        verdict, attempt_id, refusal, failed = group.share_from_coordinator((verdict, attempt.attempt_id, refusal, failure is not None))
    except BaseException:
        if begun:
            _abandon(attempt)
        raise
    if failed:
        raise CheckpointWriteError(
            f"checkpoint {req.name}: the coordinating writer (rank 0) could not begin it in {store.checkpoint_url(req.name)}: {refusal}"
        ) from failure
    if isinstance(verdict, str):
        raise CheckpointExistsError(verdict)
    if verdict:
        return None
    if refusal is not None:
        raise CheckpointExistsError(refusal)
    return dataclasses.replace(attempt, attempt_id=attempt_id)


def _abandon(attempt: Attempt) -> None:
    """A failed attempt leaves nothing behind (a disk-full write's partial shard frees its space)."""
    try:
        attempt.abandon()
    except Exception:  # noqa: BLE001 - the write's own error is the one to report
        pass


def _make_writer(ctx: PersistContext, store: CheckpointStore, name: str, snapshot: PreparedSnapshot, write_manifest: BeforeCommit) -> Any:
    """The store's DCP writer into ``name``, with the snapshot's known checksums, and MACs under ``ctx.signing_key``.

    ``ctx.signing_key``: every blob gets a MAC under it (``format/blob_macs.py``), and the
    manifest's signature needs ``.metadata``'s bytes.
    """
    signing_key, write_threads = ctx.signing_key, ctx.write_threads
    # Only a signature needs .metadata's bytes, and only more than one thread a thread count;
    # a store subclass written for make_writer(name, before_commit) keeps working without them.
    extra: dict[str, Any] = {"wants_metadata_bytes": True} if signing_key is not None else {}
    if write_threads > 1:
        extra["thread_count"] = write_threads
    writer = store.make_writer(name, before_commit=write_manifest, **extra)
    fs = getattr(writer, "fs", None)
    if isinstance(fs, ChecksummingFileSystem):
        fs.known_checksums = snapshot.known
    if signing_key is not None:
        if not isinstance(fs, ChecksummingFileSystem):
            raise CheckpointWriteError(
                f"{type(store).__name__}.make_writer returned a writer whose files are not checksummed, so its blobs "
                "cannot be signed; build it with CheckpointStore.make_writer's writer class"
            )
        fs.mac_key, fs.mac_algorithm = signing_key, default_mac_algorithm()
    return writer


def _timings(writer: Any) -> StreamTimings | None:
    timings = getattr(getattr(writer, "fs", None), "timings", None)
    return timings() if callable(timings) else None


def _save(
    ctx: PersistContext, store: CheckpointStore, name: str, snapshot: PreparedSnapshot, write_manifest: BeforeCommit
) -> StreamTimings | None:
    """DCP's save of ``snapshot.state_dict`` into ``name``, with ``ctx``'s group and threads; where the shards' time went, when known."""
    import torch.distributed.checkpoint as dcp

    group = ctx.group
    writer = _make_writer(ctx, store, name, snapshot, write_manifest)
    planner = CoveringSavePlanner(snapshot.global_shapes)
    if snapshot.landing is not None:
        planner.before_reading = snapshot.landing.wait_for_tensor
    if group is None:
        with warnings.catch_warnings():
            # no_dist=True is deliberate: a single writer saves its own process's snapshot.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(snapshot.state_dict, storage_writer=writer, planner=planner, no_dist=True)
    else:
        dcp.save(snapshot.state_dict, storage_writer=writer, planner=planner, process_group=group.group)
    return _timings(writer)


def _save_in_group(
    ctx: PersistContext,
    group: WriterGroup,
    store: CheckpointStore,
    name: str,
    snapshot: PreparedSnapshot,
    write_manifest: BeforeCommit,
    prefix: str,
) -> StreamTimings | None:
    """DCP's save where the coordinator commits alone: the plan round only when a plan changed, the write round ending on the coordinator.

    A failure of the plan round raises on every rank from its own collective. After the
    write round, the others wait in the commit barrier (``_commit_barrier``): a failure
    on the coordinator, or of any rank's write, which it learns from the gather, goes
    there, and every rank raises it (a rank whose own write failed, its own error).
    """
    assert snapshot.saving is not None
    tier = group_save.set_up(group, snapshot.saving, lambda: _make_writer(ctx, store, name, snapshot, write_manifest))
    plans_round = snapshot.saving.planned is None and not snapshot.saving.plans_unchanged
    planned = group_save.plan(group, snapshot.saving, tier)
    if plans_round:  # a phase of its own, only where it ran: the first checkpoint of each layout
        snapshot.phases.lap(prefix + "plan_round")
    # Every rank's manifest section rides in the write round's gather, where no earlier tier's gathered them.
    with_sections = not snapshot.sections_gathered
    own_failure = group_save.write(group, snapshot.saving, tier, planned, snapshot.own_section if with_sections else None)
    if not group.is_coordinator:
        if with_sections:
            _take_sections(group, snapshot, None)
        if own_failure is not None:
            _commit_barrier_failed(group, store.checkpoint_url(snapshot.req.name), own_failure)
        return _timings(tier.writer)
    try:
        if own_failure is not None:
            raise own_failure
        group_save.raise_failures(snapshot.saving)  # before the sections: a rank that failed sent none
        if with_sections:  # inside: a failure to build the manifest reaches the others in the barrier
            _take_sections(group, snapshot, snapshot.saving.sections)
        group_save.finish(snapshot.saving, tier, planned)  # the manifest, then .metadata
    except BaseException as e:
        _fail_commit_barrier(group, e)  # the others wait in the commit barrier
        raise
    return _timings(tier.writer)
