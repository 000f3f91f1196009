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
protocol ``BlockingCalls`` implements), the blocking calls read the writer's answers
through ``SnapshotCompletion``, and what completion and the blocking calls must start is
a callable the engine gives them, never an import. The state they all change is
``EngineState``: nothing shared lives anywhere else.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import WriterDiedError
from ..consistency.snapshot import Snapshot, SnapshotMode, SnapshotState
from ..warnings_text import BOUNDARY_WARNING

if TYPE_CHECKING:
    import torch

    from ..consistency.autowindow import PhaseTimer
    from ..consistency.gradlog import GradientLogger
    from ..consistency.replay_guard import ReplayMutationGuard
    from ..consistency.snapshot_copies import SnapshotCopies
    from ..consistency.stage_area import StagingArea
    from ..consistency.window_policy import WindowPolicy
    from ..copying.plan_cache import PlanCache
    from ..copying.slots import SlotPool
    from ..copying.transfer import Copier
    from ..writer_client.link import WriterLink
    from .dispatch import PersistDispatcher
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
    starting_pending: bool = False  # inside start_pending: a replaced writer does not start it again
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
