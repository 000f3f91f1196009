"""The record of one in-flight snapshot, its mode and its states.

A snapshot moves through these states (the engine drives them, in ``engine.py``)::

    COPYING ──(version V reached: every group enqueued or staged)──► AT_BOUNDARY
    AT_BOUNDARY ──(ckpt.step(), or the next pre-hook: boundary state captured)──► LANDING
    LANDING ──(every copy's event fired)──► SENT (the persist request is queued to the writer)
    SENT ──(the writer answered)──► removed: committed or failed; its host slot is free again

A stage-mode snapshot reaches V at once (groups 1..W-1 are staged on the device) and
goes on draining the staging area while AT_BOUNDARY or LANDING: ``next_group`` tells
how far the copies are; the snapshot leaves LANDING only when all are enqueued.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...format.tiers import ROOT_TIER
from ..copying.layout import StateLayout
from ..copying.plan import CopyPlan
from ..copying.slots import HostSlot
from ..copying.transfer import CopyTicket
from .ledger import CheckpointLedger, GroupRecord

if TYPE_CHECKING:
    from ...protocol import ReplayLog
    from .autowindow import WindowChoice


@dataclass(frozen=True)
class StartingRequest:
    """What the snapshot starting now answers."""

    requested_step: int  # the earliest pending request's step
    deferred: bool  # it waited for a free slot
    restarted_from: int | None  # the started step of a snapshot this one replaces
    scheduled_version: int | None = None  # every=N: the version it must hold (None: request())
    tiers: tuple[str, ...] = (ROOT_TIER,)  # where it goes (TierSettings.tiers_for): some versions go to the local tier alone

    @property
    def reaches_root(self) -> bool:
        return ROOT_TIER in self.tiers


@dataclass(frozen=True)
class SnapshotPlan:
    """What the snapshot starting now copies, and how: the layout, its copy plan, and the window choice behind it."""

    layout: StateLayout
    plan: CopyPlan
    plan_id: int  # the id the writer knows this (layout, window) plan by
    choice: WindowChoice | None  # window="auto": why this window (None: a fixed window)


class SnapshotMode(str, enum.Enum):
    """How a snapshot reaches one consistent version; the value is what the manifest records."""

    SINGLE_STEP = "single"  # window 1: the whole state copied after the requested step
    REPLAY = "replay"  # group j copied after step s+j, rolled forward to s+W-1 on the CPU
    STAGE = "stage"  # groups 1..W-1 cloned on the device at step s, drained over the window


class SnapshotState(enum.Enum):
    COPYING = "copying"
    AT_BOUNDARY = "at-boundary"
    LANDING = "landing"
    SENT = "sent"


@dataclass
class BoundaryState:
    """What is captured at the iteration boundary of the version: everything that is not a tracked tensor.

    ``param_groups`` and non-tensor optimizer entries (``optimizer_scalars``) belong to
    the optimizer's state dict; ``stateful`` and ``rng`` are the extra objects.
    """

    param_groups: list[dict[str, Any]]
    optimizer_scalars: dict[str, Any]
    stateful: dict[str, Any]
    rng: dict[str, Any]


@dataclass
class SnapshotStats:
    """One checkpoint's figures, built once and completed when the writer commits it."""

    step: int | None
    requested_step: int
    mode: str
    window: int
    nbytes: int
    copy_s: float = 0.0
    copied_nbytes: int = 0  # state, and replay's gradients
    device_waits_inserted: int = 0
    device_waits_in_flight: int = 0
    hook_host_s: float = 0.0
    deferred: bool = False
    waited_for_slot_s: float = 0.0  # distributed: blocked in a hook for a free slot (not deferred: same version)
    writer_restarts: int = 0  # writer processes replaced so far in this run, when this one was sent
    pipelined: bool = False  # sent while its copies still landed; the writer wrote each entry once it had (pipelined_persist.py)
    time_to_commit_s: float | None = None
    committed_at_unix_s: float | None = None
    persist_s: float | None = None
    persist_phases_s: dict[str, float] = field(default_factory=dict)  # where persist_s went, by phase (the writer's)
    path: str | None = None  # the last tier's directory (the root's, when it went there)
    tier_paths: dict[str, str] = field(default_factory=dict)  # each tier it committed in, with its directory
    writer_round_nodes: int = 1  # the nodes whose leaders carried the writers' rounds (1: one round among all ranks)
    ledger: dict[str, Any] | None = None


@dataclass
class Snapshot:
    """One checkpoint between its request and its commit.

    The ledger holds the facts the manifest records (requested and started step,
    window, groups); the snapshot reads them from there and holds only the rest.
    """

    request_id: int
    mode: SnapshotMode
    slot: HostSlot
    plan: CopyPlan
    plan_id: int  # the id the writer knows this (layout, window) plan by
    layout: StateLayout
    ledger: CheckpointLedger
    state: SnapshotState = SnapshotState.COPYING
    next_group: int = 0
    tickets: list[CopyTicket] = field(default_factory=list)
    # Copies enqueued by an earlier hook whose fence the compute stream has not yet got.
    unfenced: list[CopyTicket] = field(default_factory=list)
    # Stage mode: per entry, the staged tensor its drain reads (None: group 0, or copied at stage time).
    staged_views: list[Any] = field(default_factory=list)
    boundary: BoundaryState | None = None
    replay_log: ReplayLog | None = None  # replay mode: what the writer rolls the groups forward with
    requested_wall_s: float = field(default_factory=time.time)
    device_waits_inserted: int = 0
    device_waits_in_flight: int = 0
    hook_host_s: float = 0.0
    deferred: bool = False
    waited_for_slot_s: float = 0.0  # distributed: the hook blocked this long for a free slot before starting
    tiers: tuple[str, ...] = (ROOT_TIER,)  # where the writer persists it, in order (the local tier first)
    # Window 1 copied in batches in slot order, so the writer may write while they land (landing_page.py):
    # each batch's ticket and the slot bytes landed once it has. None: one copy per group.
    landing_batches: list[tuple[CopyTicket, int]] | None = None

    @classmethod
    def open(
        cls,
        request_id: int,
        request: StartingRequest,
        step: int,
        mode: SnapshotMode,
        slot: HostSlot,
        planned: SnapshotPlan,
    ) -> Snapshot:
        """A snapshot starting at ``step`` for ``request``, with its ledger."""
        plan, choice = planned.plan, planned.choice
        window = plan.window_steps
        ledger = CheckpointLedger(
            requested_step=request.requested_step,
            started_step=step,
            target_version=step if mode != SnapshotMode.REPLAY else step + window - 1,
            window=window,
            mode=mode.value,
            groups=[GroupRecord(index=g.index, nbytes=g.nbytes) for g in plan.groups],
            window_choice=None if choice is None else choice.to_json(),
            restarted_from=request.restarted_from,
            scheduled_version=request.scheduled_version,
        )
        return cls(
            request_id=request_id,
            mode=mode,
            slot=slot,
            plan=plan,
            plan_id=planned.plan_id,
            layout=planned.layout,
            ledger=ledger,
            deferred=request.deferred,
            tiers=request.tiers,
        )

    @property
    def reaches_root(self) -> bool:
        """Whether it goes to the root (not a version of the local tier's cadence alone)."""
        return ROOT_TIER in self.tiers

    @property
    def requested_step(self) -> int:
        """The step after which the checkpoint was requested."""
        return self.ledger.requested_step

    @property
    def started_step(self) -> int:
        """The step at which its copies started (later than requested when deferred)."""
        return self.ledger.started_step

    @property
    def window(self) -> int:
        return self.ledger.window

    @property
    def version(self) -> int | None:
        """The version it holds once reached (its ledger's target), None while its copies still run."""
        return None if self.state is SnapshotState.COPYING else self.ledger.target_version

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    @property
    def all_enqueued(self) -> bool:
        return self.next_group == len(self.plan.groups)

    def stats(self) -> SnapshotStats:
        return SnapshotStats(
            step=self.version,
            requested_step=self.requested_step,
            mode=self.mode.value,
            window=self.window,
            nbytes=self.nbytes,
            copy_s=sum(t.copy_s or 0.0 for t in self.tickets),
            copied_nbytes=sum(t.nbytes for t in self.tickets),
            device_waits_inserted=self.device_waits_inserted,
            device_waits_in_flight=self.device_waits_in_flight,
            hook_host_s=self.hook_host_s,
            deferred=self.deferred,
            waited_for_slot_s=self.waited_for_slot_s,
        )
