"""What the engine's collaborators share: one record of mutable state, and the units they use.

``SnapshotEngine`` (``engine.py``) owns the hooks and orchestrates; four collaborators do
its work, each given the ``EngineParts`` and, through its constructor, the one or two
others it calls:

* ``SnapshotStarts`` (``starting.py``): sizing host slots, choosing a window, starting snapshots;
* ``SnapshotCompletion`` (``completion.py``): handing landed snapshots to the writer, its
  answers, a dead writer's replacement;
* ``BlockingCalls`` (``blocking.py``): ``wait``, ``close``, leaving on an error, and the
  one wait a hook may do (for a host slot at a scheduled step);
* ``SnapshotRestarts`` (``snapshot_restarts.py``): dropping and restarting a snapshot that cannot
  reach its version.

The calls go one way: a start may wait for a slot through ``SlotWaits`` (a narrow
protocol ``BlockingCalls`` implements), and the blocking calls read the writer's answers
through ``SnapshotCompletion``. Completion holds no reference to the starts: it answers
whether a dead writer was replaced, and starts on the new writer only what its caller hands
it at that call (the engine: the pending requests; ``wait()``: what is due; else nothing). The
state they all change is ``EngineState``: nothing shared lives anywhere else.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import WriterDiedError
from ...optimizers import update_rule_name
from ...settings import AUTO_INFLIGHT, CheckpointerSettings
from ..consistency.autowindow import PhaseTimer
from ..consistency.gradlog import GradientLogger
from ..consistency.replay_guard import ReplayMutationGuard
from ..consistency.snapshot import Snapshot, SnapshotMode, SnapshotState
from ..consistency.snapshot_copies import SnapshotCopies
from ..consistency.stage_area import StagingArea
from ..consistency.window_policy import WindowPolicy
from ..copying import tensor_passes
from ..copying.layout import CheckpointScope
from ..copying.plan_cache import PlanCache
from ..copying.slots import SlotPool
from ..copying.transfer import Copier
from ..run.lineage import Lineage
from ..warnings_text import BOUNDARY_WARNING
from ..writer_client.link import WriterLink
from .dispatch import PersistDispatcher, PersistOptions
from .requests import CheckpointSchedule, RequestQueue
from .step_hooks import StepPoint


@dataclass
class EngineState:
    """The engine's mutable state: the step count, the snapshots under way, what was warned."""

    has_stateful: bool  # stateful objects were given: a boundary the loop does not mark is worth a warning
    step_count: int = 0  # optimizer steps taken (continued from a restored checkpoint)
    hook_serial: int = 0  # one per hook call: tells copies enqueued by an earlier hook from this one's
    next_request_id: int = 0
    snapshots: list[Snapshot] = field(default_factory=list)  # started and not yet sent, in start order
    dead: WriterDiedError | None = None  # set once a writer death has been raised
    snapshots_dropped: int = 0  # incomplete snapshots lost with a dead writer
    hook_host_total_s: float = 0.0  # host time in the step hooks, ckpt.step() and request(), since construction
    hook_cpu_total_s: float = 0.0  # of which the training thread ran (time.thread_time: no waits, no preemption)
    slot_wait_s: float = 0.0  # hook time the next snapshot waited for a free slot (in its stats)
    prepared_fingerprint: int | None = None  # the layout the host slots were sized for
    user_marks_boundary: bool = False  # the loop calls ckpt.step()
    warned: set[str] = field(default_factory=set)

    def warn_once(self, key: str, text: str, stacklevel: int = 6) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(text, stacklevel=stacklevel)

    def charge(self, started: float) -> None:
        """Add the host time since ``started`` to every snapshot in flight (``hook_host_s``)."""
        spent = time.perf_counter() - started
        for snap in self.snapshots:
            snap.hook_host_s += spent

    def close_boundary(self, snap: Snapshot, provisional: bool) -> None:
        """Keep the boundary captured in the post-hook: ckpt.step() did not come."""
        snap.state = SnapshotState.LANDING
        snap.ledger.boundary = "post-hook"
        if provisional and not self.user_marks_boundary and self.has_stateful:
            self.warn_once("boundary", BOUNDARY_WARNING)

    def open_replay_windows(self) -> list[Snapshot]:
        """Replay snapshots that have not reached their version yet (a copy: restarting edits the list)."""
        return [s for s in self.snapshots if s.mode == SnapshotMode.REPLAY and s.version is None]


@dataclass(eq=False)
class EngineParts:
    """The units one engine is made of, and its shared state."""

    state: EngineState
    optimizer: torch.optim.Optimizer
    consistency: SnapshotMode
    stateful: dict[str, Any]
    distributed: bool  # every rank must start each snapshot at the same step
    copier: Copier
    copies: SnapshotCopies
    dispatcher: PersistDispatcher
    link: WriterLink
    plans: PlanCache
    slots: SlotPool
    staging: StagingArea
    windows: WindowPolicy
    gradients: GradientLogger
    requests: RequestQueue
    schedule: CheckpointSchedule
    step_point: StepPoint
    replay_guard: ReplayMutationGuard
    gap_timer: PhaseTimer | None


@dataclass(frozen=True)
class BuiltUnits:
    """What the builder made for the engine (``builder.py``), which the engine uses but does not own."""

    link: WriterLink  # the writer process, replaced when it dies
    copier: Copier  # how bytes reach host memory
    gap_timer: PhaseTimer | None  # window="auto": what times the step's phases; else None
    scope: CheckpointScope  # this rank's part of the state
    lineage: Lineage  # the run's checkpoint names


@dataclass(frozen=True)
class RunCallbacks:
    """The engine's calls into the run around it."""

    at_boundary: Callable[[], None] | None = None  # each iteration boundary (save on a preemption signal: preemption.py)
    on_commit: Callable[[dict[str, Any]], None] | None = None  # the user's, with each commit's figures


def assemble_parts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    stateful: dict[str, Any],
    settings: CheckpointerSettings,
    units: BuiltUnits,
    step_point: StepPoint,
    on_commit: Callable[[dict[str, Any]], None] | None,
) -> EngineParts:
    """Every unit of one engine, from the checked settings and what the builder made."""
    win, cadence, key_layout = settings.overlap, settings.cadence, settings.storage.key_layout
    mode = SnapshotMode(win.consistency)
    copier, link = units.copier, units.link
    # Distributed: every rank must start each snapshot at the same step, so a request
    # that finds no free slot waits for one instead of starting later on some ranks.
    distributed = units.scope.world_size > 1
    windows = WindowPolicy(win.window, mode, win.max_window, units.gap_timer, gradients_fenced=not copier.clone_is_cheap, distributed=distributed)
    inflight = None if cadence.max_inflight == AUTO_INFLIGHT else int(cadence.max_inflight)
    slots = SlotPool(link, copier, max_inflight=inflight, distributed=distributed)
    staging = StagingArea(copier, win.stage_budget_bytes)
    gradients = GradientLogger(optimizer, copier)
    if mode is SnapshotMode.REPLAY:
        # A fused optimizer on a GPU: which CPU arithmetic replays its steps, measured now (a
        # small step on the device and a sync), not inside the first snapshot's hook.
        gradients.prepare()
    # The hooks' native passes loaded here, if built: not inside the first snapshot's hook (about 2 ms).
    tensor_passes.passes()
    persist_options = PersistOptions(
        keep=cadence.keep, local_keep=settings.tier.local_keep, export_formats=tuple(settings.writer.export_formats),
        key_layout=key_layout, optimizer=update_rule_name(optimizer),
    )
    return EngineParts(
        state=EngineState(has_stateful=bool(stateful)),
        optimizer=optimizer,
        consistency=mode,
        stateful=stateful,
        distributed=distributed,
        copier=copier,
        copies=SnapshotCopies(optimizer, stateful, copier, staging, gradients),
        dispatcher=PersistDispatcher(link, slots, units.lineage, persist_options, on_commit, unsolicited_errors=distributed),
        link=link,
        plans=PlanCache(model, optimizer, link, units.scope, key_layout),
        slots=slots,
        staging=staging,
        windows=windows,
        gradients=gradients,
        requests=RequestQueue(lambda version, on_request: settings.tier.tiers_for(cadence.every, version, on_request)),
        schedule=CheckpointSchedule(cadence.every, settings.tier.local_every),
        step_point=step_point,
        replay_guard=ReplayMutationGuard(step_point.other_pre_hook_names),
        gap_timer=units.gap_timer,
    )
