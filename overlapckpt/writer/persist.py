"""Persist one snapshot from the shared host slot: replay, checksums, manifest, DCP save, commit.

Runs in the writer process. In a distributed run (a ``WriterGroup``), every rank's
writer runs it for the same checkpoint: the ranks agree on the checkpoint first,
each writes its share through DCP with the writers' group, and the coordinator
(rank 0) writes the one manifest (a section per rank) right before ``.metadata``,
then ``latest`` and retention.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import protocol as p
from ..errors import CheckpointExistsError, CheckpointWriteError, InternalError, RankDisagreementError
from ..format.attempts import already_committed
from ..format.checksum import default_algorithm
from ..format.entries import TensorEntry, build_state_dict
from ..format.extra_state import encode
from ..format.key_layout import TORCHTITAN
from ..format.known_sums import KnownChecksums
from ..format.manifest import MANIFEST_NAME, CheckpointInfo, ItemRecord, RankSection, parse_manifest
from ..format.peers import NodeLayout
from ..format.shards import LocalShard
from ..format.storage import CheckpointStore
from ..format.tiers import LOCAL_TIER, ROOT_TIER
from ..hostbuf import exact_view
from . import group_save
from .claims import FAILED_FIELD, NEXT_WINDOW_FIELD, PLANS_FIELD, SHAPES_FIELD
from .group import WriterGroup
from .persist_context import PersistContext, PhaseClock, PreparedSnapshot
from .replicas import node_layout
from .retention import Retired
from .slot_landing import SlotLanding
from .snapshot_manifest import build_manifest, dtype_name
from .snapshot_sums import SnapshotChecksums
from .tier_write import after_commit, held_or_begun, leads, write_tier


def persist_snapshot(
    ctx: PersistContext,
    plan: p.SetPlanRequest,
    req: p.PersistRequest,
    on_replay: Callable[[bool], None] | None = None,
    purge_later: Retired | None = None,
) -> p.CommittedResponse:
    """Persist one snapshot and commit it in each of its tiers (``req.tiers``, in order); the answer for the training side.

    ``ctx.stores`` maps each tier to its store (``format/tiers.py``); ``plan`` is the layout
    the snapshot was copied under (its entries, their offsets in the slot, replay's tables).
    The snapshot is replayed and checksummed once; each tier then gets its own attempt, DCP
    save, commit, ``latest`` and retention (``tier_write.py``: ``req.local_keep`` in the local
    tier, ``req.keep`` in the root). The local
    tier goes first: it is the faster, and what a preemption's grace must reach.
    ``purge_later`` receives the directories of checkpoints retention retired (already
    uncommitted and out of the listing): the caller deletes them after answering.
    """
    started = time.perf_counter()
    stores, group, global_shapes = ctx.stores, ctx.group, plan.global_shapes
    purge_later = purge_later if purge_later is not None else []
    missing = [tier for tier in req.tiers if tier not in stores]
    if missing or not req.tiers:
        raise InternalError(f"checkpoint {req.name} is for tiers {req.tiers}, but this writer has stores for {sorted(stores)}")
    agreed_window = req.proposed_next_window
    saving: group_save.GroupSave | None = None
    # Pipelined: sent while its copies land; every read of the slot waits for its bytes (slot_landing.py).
    landing = SlotLanding.of(ctx.buffers, req)
    if landing is not None and group is not None:
        raise InternalError(f"checkpoint {req.name} came pipelined in a distributed run: pipelined persists are for runs of one process")
    if group is not None:
        # The local plan is made before the claims, which say whether every rank may reuse its
        # plan; it reads the views' shapes only (replay steps them in place, later). Its failure
        # goes into this rank's claim, so every rank refuses the checkpoint at once.
        preparing: BaseException | None = None
        try:
            tensors = _views(ctx, plan, req)
            state_dict = _state_dict(req, plan.entries, tensors)
            saving = group_save.prepare(group, state_dict)
        except Exception as e:  # noqa: BLE001 - raised below, after the claims
            preparing = e
        # Before any collective: a rank that disagrees must not leave the others in one.
        sequence, global_shapes, agreed_window = _agree_on_checkpoint(group, req, global_shapes, saving, preparing)
        assert saving is not None  # else _agree_on_checkpoint raised
    else:
        tensors = _views(ctx, plan, req)
        # DCP's state dict holds the slot's views: replay steps them in place, later.
        state_dict = _state_dict(req, plan.entries, tensors)
    if group is None and all(stores[tier].is_committed(req.name) for tier in req.tiers):
        # Persisted again by the successor of a writer that died after the commit (the rename)
        # and before it answered: this run's own checkpoint of this step is a success.
        done = [_committed_already(stores[tier], tier, req, started, purge_later) for tier in req.tiers]
        return _merged(done)
    _replay(ctx, plan, req, tensors, on_replay)
    phases = PhaseClock(started)
    phases.lap("agree_and_replay")
    # Per local part: the checksum of the host snapshot, checked against what DCP decodes at
    # load. The same algorithm as the stored bytes' (the storage writer's default_algorithm()).
    algorithm = default_algorithm()
    sums = SnapshotChecksums(ctx.buffers[req.buffer_id], [e.nbytes for e in plan.entries], plan.offsets, algorithm, landing)
    try:  # the large entries are hashed on a thread while DCP writes them (snapshot_sums.py)
        snapshot = _prepare(group, req, plan.entries, tensors, sums, algorithm, global_shapes, phases, started, state_dict, saving)
        answers = _write_tiers(ctx, snapshot, purge_later)
    finally:
        sums.close()  # joined before the answer: the slot may be released after it
    if group is not None:
        group.forget(sequence)
    answer = _merged(answers)
    answer.agreed_next_window = agreed_window
    answer.persist_s = time.perf_counter() - started
    if group is not None and group.tree is not None:
        answer.round_node_count = len(group.tree.leaders)
    return answer


def _agree_on_checkpoint(
    group: WriterGroup,
    req: p.PersistRequest,
    global_shapes: dict[str, tuple[int, ...]],
    saving: group_save.GroupSave | None,
    preparing: BaseException | None,
) -> tuple[int, dict[str, tuple[int, ...]], int | None]:
    """Every rank claims the same checkpoint, then learns every rank's tensors (a collective unless the verdict reuses them).

    Answers the claim's sequence, the shapes, and the window every rank uses next (the
    widest any rank proposed, carried by the coordinator's verdict); ``saving`` learns
    whether every rank reuses its save plan. ``preparing``: this rank failed to prepare its
    save (``saving`` is None); its claim says so, every rank refuses the checkpoint, and this
    rank raises its own error.
    """
    claim = {"name": req.name, "version": req.step, "requested": req.requested_step}
    if req.tiers != (ROOT_TIER,):  # ranks that would write different tiers would enter different collectives
        claim["tiers"] = ",".join(req.tiers)
    claim[SHAPES_FIELD] = group.shapes_claim(global_shapes)  # this rank's own: not compared (claims.py)
    if req.proposed_next_window is not None:
        claim[NEXT_WINDOW_FIELD] = req.proposed_next_window  # this rank's own too: the verdict takes the widest
    if preparing is not None:
        claim[FAILED_FIELD] = f"{type(preparing).__name__}: {preparing}"[:_FAILED_SHOWN_CHARS]
        try:
            group.agree(claim)  # refused on every rank: the coordinator's verdict names this failure
        except RankDisagreementError:
            pass
        raise preparing
    assert saving is not None  # made, where preparing did not fail
    claim[PLANS_FIELD] = group.plans.claim_field(saving.local_digest)  # and its plan's (save_plans.py)
    agreement = group.agree(claim)
    # Reused only with the shape union too: the coverage check of the union ran at the plan's round.
    saving.plans_unchanged = agreement.plans_unchanged and agreement.shapes_unchanged
    # The manifest and the coverage check need every rank's tensors: pipeline stages hold different ones.
    union = group.union_of_shapes(global_shapes, reusable=agreement.shapes_unchanged)
    saving.planner.global_shapes = union  # the coordinator's coverage check, at a plan round
    return agreement.sequence, union, agreement.next_window


def _views(ctx: PersistContext, plan: p.SetPlanRequest, req: p.PersistRequest) -> list[torch.Tensor]:
    """The snapshot's tensors in its host slot, as they are (replayed later, in place, where ``req.replay`` asks)."""
    slot = ctx.buffers[req.buffer_id]
    # Exact-storage views: DCP writes them in place instead of cloning each (hostbuf.exact_view).
    if ctx.views is not None:
        return ctx.views.of(req.buffer_id, slot, plan)
    return [exact_view(slot, off, e.dtype, e.shape) for e, off in zip(plan.entries, plan.offsets)]


# How much of a preparing failure a claim carries (the store holds small values).
_FAILED_SHOWN_CHARS = 300


def _replay(
    ctx: PersistContext, plan: p.SetPlanRequest, req: p.PersistRequest, tensors: list[torch.Tensor], on_replay: Callable[[bool], None] | None
) -> None:
    """``tensors`` (the slot's views) replayed to the checkpoint's version where ``req.replay`` asks."""
    if req.replay is None:
        return
    from .replay import replay_to_version

    # The training side hears of it before the slot is written, and once it holds the
    # version: a successor of a writer killed in between must not replay it again.
    if on_replay is not None:
        on_replay(False)
    if plan.replay_tables is None:
        raise InternalError(f"the snapshot of step {req.step} needs replay, but its plan {req.plan_id} came without replay tables")
    replay_to_version(plan.entries, tensors, req.replay, plan.replay_tables, ctx.buffers[req.replay.grad_buffer_id])
    if on_replay is not None:
        on_replay(True)


def _state_dict(req: p.PersistRequest, entries: list[TensorEntry], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """What DCP saves: the tensors (whole, or shards of the global ones) and the small state."""
    # The torchtitan layout saves the stateful objects as DCP items too, for TorchTitan's own manager.
    stateful = req.extra_state.get("stateful", {}) if req.key_layout == TORCHTITAN else None
    return build_state_dict(entries, [_part(e, t) for e, t in zip(entries, tensors)], req.small_state, req.key_layout, stateful)


def _prepare(
    group: WriterGroup | None,
    req: p.PersistRequest,
    entries: list[TensorEntry],
    tensors: list[torch.Tensor],
    sums: SnapshotChecksums,
    algorithm: str,
    global_shapes: dict[str, tuple[int, ...]],
    phases: PhaseClock,
    started: float,
    state_dict: dict[str, Any],
    saving: group_save.GroupSave | None,
) -> PreparedSnapshot:
    """DCP's state dict and the snapshot's manifest less its checksums (filled once the sections are known): once, for every tier."""
    # DCP stores these very bytes next: their checksums are not computed a second time (known_sums.py),
    # and a write that reaches a large entry before the hashing thread waits for that one.
    known = KnownChecksums(algorithm)
    for i, t in enumerate(tensors):
        known.add(t, functools.partial(_known_sum, sums, i))
    phases.lap("snapshot_checksums")
    extra_state = encode(req.extra_state, "extra_state")
    landing = sums.landing

    def own_section() -> RankSection:
        # Built when the manifest needs it (at the commit, or for the ranks' gather): after the
        # write where it can be, so that the hashing thread ran beside the write.
        if landing is not None:
            landing.wait_all()  # every byte landed, and the request holds the copy's figures (the manifest's)
        parts = {
            e.key: ItemRecord(
                dtype=dtype_name(e.dtype),
                shape=tuple(e.shape),
                checksum=checksum,
                offset=tuple(e.global_offset or (0,) * len(e.shape)),
            )
            for e, checksum in zip(entries, sums.all())
        }
        return RankSection(
            rank=0 if group is None else group.rank,
            nbytes=sum(e.nbytes for e in entries),
            items=parts,
            extra_state=extra_state,
            ledger=req.ledger,
            stats=req.stats,
        )

    # Until the sections are taken (tier_write.py), this rank's own facts: what CheckpointInfo needs.
    manifest = build_manifest(req, entries, global_shapes, None, group)
    return PreparedSnapshot(
        req, entries, global_shapes, manifest, algorithm, known, state_dict, phases, started, own_section, saving, landing=landing
    )


def _known_sum(sums: SnapshotChecksums, index: int) -> int:
    return int(sums.of(index), 16)


def _write_tiers(ctx: PersistContext, snapshot: PreparedSnapshot, purge_later: Retired) -> list[p.CommittedResponse]:
    """Each of the checkpoint's tiers, in order: written and committed, or answered as this run's commit there already."""
    req, group = snapshot.req, ctx.group
    answers: list[p.CommittedResponse] = []
    for tier in req.tiers:
        store = ctx.stores[tier]
        layout = node_layout(group) if tier == LOCAL_TIER else None  # a local tier on several nodes: replicated
        attempt = None
        if group is not None and layout is None:  # asked and begun in one broadcast
            attempt = held_or_begun(store, group, req, functools.partial(_held_here, store, req))
            held = attempt is None
        else:
            held = _held_already(store, group, req, layout)
        if held:  # this run committed it here (before a writer's death, or a local-only checkpoint)
            answers.append(_committed_already(store, tier, req, snapshot.started, purge_later, leads(group, layout)))
            continue
        answers.append(write_tier(ctx, tier, snapshot, layout, purge_later, attempt))
    return answers


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


def _held_already(store: CheckpointStore, group: WriterGroup | None, req: p.PersistRequest, layout: NodeLayout | None = None) -> bool:
    """Whether this run's checkpoint of this version is committed in ``store`` already (another run's: refused).

    A writer that died after a commit and before answering leaves one; so does a local-only
    checkpoint whose version a ``request()`` then asks of both tiers. In a distributed run
    the coordinator looks, and every rank learns its verdict (a collective every rank reaches).
    """
    verdict = _held_here(store, req) if leads(group, layout) else False
    if group is not None and layout is not None:
        return _held_on_every_node(group, layout, req, verdict)
    if group is not None:
        verdict = group.share_from_coordinator(verdict)
    if isinstance(verdict, str):
        raise CheckpointExistsError(verdict)
    return verdict


def _held_here(store: CheckpointStore, req: p.PersistRequest) -> str | bool:
    """What this writer sees in ``store``: True if this run committed this version there, the refusal if another run did, else False."""
    if not store.is_committed(req.name):
        return False
    try:
        manifest = parse_manifest(store.read_bytes(req.name, MANIFEST_NAME), store.checkpoint_url(req.name))
        if manifest.run_id == req.run_id and manifest.step == req.step:
            return True
    except Exception:  # noqa: BLE001 - unreadable: not provably this run's, so refused
        pass
    return str(already_committed(store, req.name))


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
        removed, warnings = after_commit(store, tier, req, purge_later)
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


def _part(entry: TensorEntry, tensor: torch.Tensor) -> Any:
    # A whole tensor is written as itself; a shard as a part of the global tensor.
    if entry.is_whole:
        return tensor
    return LocalShard(tensor, entry.global_shape, entry.global_offset)
