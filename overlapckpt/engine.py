"""The snapshot engine: optimizer hooks that copy state over W steps and hand it to the writer.

Per hook (host work only: enqueue copies, insert device-side fences, poll events):

* post-hook of step t: advance every open window (copy the group due at t, or
  drain a staged group), start a requested snapshot at version t, capture the
  provisional boundary state.
* ``ckpt.step()`` (end of the iteration): capture stateful objects and RNG for
  snapshots whose version was just reached.
* pre-hook of step t+1: fence the copies enqueued after step t (the compute
  stream waits on their events before the optimizer mutates the state), log the
  gradients and hyperparameters replay mode needs, close boundaries the user did
  not mark, and hand landed snapshots to the writer.

Snapshot states are described in ``snapshot.py``.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
from torch import nn

from . import protocol as p
from .autowindow import (
    AUTO_WINDOW,
    DEFAULT_MAX_WINDOW,
    FWD_BWD_END,
    FWD_BWD_START,
    OPT_END,
    OPT_START,
    WindowChoice,
    WindowTuner,
    copy_schedule,
    make_gap_timer,
)
from .errors import ConfigError, OverlapCkptError, WriterDiedError
from .gradlog import GradientStep, ReplayLog, capture_hyperparameters
from .hostbuf import view_bytes
from .ledger import CheckpointLedger, GroupRecord
from .manifest import CheckpointInfo, checkpoint_name
from .plan import CopyPlan, make_plan, staging_span
from .slots import SlotPool
from .snapshot import OPEN, SENT, HostSlot, Snapshot
from .state import (
    ROLE_BUFFER,
    StateLayout,
    build_layout,
    capture_small_state,
    live_fingerprint,
    optimizer_shape_signature,
)
from .transfer import make_copier
from .writer import WriterProcess, writer_error

_GRAD_SCALER_WARNING = (
    "overlapckpt: GradScaler drives this optimizer's fused step (it sets optimizer.grad_scale and "
    "found_inf): the step unscales gradients and skips infinite ones inside the kernel, which replay "
    "cannot follow. Checkpoints that would replay use window=1 instead (exact at the requested step); "
    "use consistency='stage' to spread the copy over a window."
)

_NEW_STATE_WARNING = (
    "overlapckpt: the optimizer gained state or parameters inside the replay window of the checkpoint "
    "requested at step {old} (a parameter unfrozen, or add_param_group), which that snapshot's layout "
    "lacks, so it was restarted at step {new}."
)

_BOUNDARY_WARNING = (
    "overlapckpt: ckpt.step() was not called after the optimizer step that a checkpoint holds, so "
    "stateful objects (LR schedulers, samplers) and RNG states were captured in the optimizer's "
    "post-step hook, before the rest of the iteration ran (e.g. before scheduler.step()). A resumed "
    "run then repeats that part of the iteration. Call ckpt.step() at the end of each iteration, "
    "after scheduler.step()."
)


def capture_extra_state(stateful: dict[str, Any]) -> dict[str, Any]:
    """Stateful objects and RNG states, deep-copied now (the boundary of the snapshot's version)."""
    rng: dict[str, Any] = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["torch_cuda"] = torch.cuda.get_rng_state_all()
    return {"stateful": {name: copy.deepcopy(obj.state_dict()) for name, obj in stateful.items()}, "rng": rng}


class SnapshotEngine:
    """Drives snapshots from the optimizer's step hooks; owns slots, copier and writer link."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        window: int | str,
        consistency: str,
        every: int | None,
        keep: int | None,
        stateful: dict[str, Any],
        writer: WriterProcess,
        max_inflight: int,
        stage_budget_bytes: int | None,
        max_window: int = DEFAULT_MAX_WINDOW,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.window_setting = window  # an int, or "auto": chosen per checkpoint by the tuner
        self.consistency = consistency
        self.every = every
        self.keep = keep
        self.stateful = stateful
        self.writer = writer
        self.stage_budget_bytes = stage_budget_bytes
        first = next(iter(model.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.copier = make_copier(self.device)
        self.slots = SlotPool(writer, pin=self.copier.is_async, max_inflight=max_inflight)
        self.tuner = WindowTuner(max_window) if window == AUTO_WINDOW else None
        self._restarted_from: int | None = None
        self._grad_scaler_seen = False  # GradScaler's fused path: replay cannot follow it
        self.gap_timer = make_gap_timer(self.device) if self.tuner is not None else None
        self.step_count = 0
        self._hook_serial = 0
        self._layout: StateLayout | None = None
        self._plans: dict[int, CopyPlan] = {}  # by window, for the current layout
        self._layout_ids: dict[int, int] = {}  # by window: the layout id the writer knows the plan by
        self._next_layout_id = 0
        self._next_request_id = 0
        self._snapshots: list[Snapshot] = []
        self._pending_requests = 0
        self._waiting_for_slot = False
        self._last_started_step: int | None = None
        self.deferrals = 0
        self._user_marks_boundary = False
        self._warned_boundary = False
        self._error: OverlapCkptError | None = None
        self.dead: WriterDiedError | None = None  # set once a writer death has been raised
        self._unreturned: list[CheckpointInfo] = []
        self.stats: list[dict[str, Any]] = []
        self._hooks: list[Any] = []
        self.install_hooks()

    def install_hooks(self) -> None:
        if not self._hooks:
            self._hooks = [
                self.optimizer.register_step_pre_hook(self._pre_hook),
                self.optimizer.register_step_post_hook(self._post_hook),
            ]

    # ---- hooks -------------------------------------------------------------------

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.dead is not None:
            return  # reported once; training goes on without checkpoints until close()
        if self.gap_timer is not None:
            # Before any fence below: forward+backward ends here, our waits are not part of it.
            self.gap_timer.mark(FWD_BWD_END)
        started = time.perf_counter()
        self._hook_serial += 1
        self._note_grad_scaler()
        for snap in self._snapshots:
            self._fence(snap)
            if snap.boundary_open:
                self._close_boundary(snap, provisional=True)
            if snap.mode == "replay" and snap.version is None:
                self._log_gradients(snap, step=self.step_count + 1)
        self._progress()
        self._charge(started)
        if self.gap_timer is not None:
            self.gap_timer.mark(OPT_START)
        self._raise_pending()

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.dead is not None:
            self.step_count += 1
            return
        if self.gap_timer is not None:
            # Before the fence below: the optimizer step ends here, the wait on the gradient copy is ours.
            self.gap_timer.mark(OPT_END)
        started = time.perf_counter()
        self._hook_serial += 1
        self.step_count += 1
        self._note_grad_scaler()
        self._restart_if_state_grew()
        for snap in self._snapshots:
            self._fence(snap)  # the gradient copies logged by this step's pre-hook
            if snap.state == OPEN:
                self._advance_window(snap)
        if self.every is not None and self.step_count % self.every == 0:
            self._pending_requests += 1
        self._start_pending()
        self._progress()
        self._charge(started)
        if self.gap_timer is not None:
            # Last, after our own copies and clones: what follows is the next iteration.
            self.gap_timer.mark(FWD_BWD_START)
        self._raise_pending()

    def mark_iteration_end(self) -> None:
        """``ckpt.step()``: the boundary where stateful objects are captured."""
        if self.dead is not None:
            return
        self._user_marks_boundary = True
        for snap in self._snapshots:
            if snap.boundary_open:
                self._capture_boundary(snap)
                snap.boundary_open = False
                snap.ledger.boundary = "step()"
        self._progress()
        self._raise_pending()

    def request(self) -> None:
        """Checkpoint the state of the last completed optimizer step, now or as soon as a slot frees."""
        if self.dead is not None:
            raise self.dead
        self._raise_pending()
        self._pending_requests += 1
        self._start_pending()
        self._progress()
        self._raise_pending()

    # ---- starting and advancing snapshots ------------------------------------------

    def _start_pending(self) -> None:
        if self._pending_requests == 0:
            return
        if self.step_count == 0 and not self.optimizer.state:
            self._pending_requests = 0
            raise ConfigError(
                "a checkpoint was requested before the first optimizer.step(): the optimizer has no "
                "state yet, and creating it would change training. Request it after the first step"
            )
        if self._last_started_step == self.step_count:
            # A snapshot requested at this very step is already under way: it answers this request too.
            self._pending_requests = 0
            return
        # All slots busy: wait, before any layout work (a fingerprint walks every tensor).
        slot = None
        if self.slots.may_have_free_slot():
            layout = self._current_layout()  # once per start: every plan below is for this layout
            window, choice = self._choose_window(layout)
            plan = self._registered_plan(layout, window)
            slot = self.slots.free_slot(plan)
        if slot is None:
            if not self._waiting_for_slot:
                # Counted once per request that has to wait, however many hooks it waits.
                self.deferrals += 1
                self._waiting_for_slot = True
            return
        deferred, self._waiting_for_slot = self._waiting_for_slot, False
        self._last_started_step = self.step_count
        self._pending_requests = 0
        self._start_snapshot(slot, deferred, layout, plan, choice)

    def _choose_window(self, layout: StateLayout) -> tuple[int, WindowChoice | None]:
        # Replay cannot follow GradScaler's fused step: window 1 instead, exact at the request.
        replay_blocked = self.consistency == "replay" and self._grad_scaler_seen
        if self.tuner is None:
            return (1 if replay_blocked else int(self.window_setting)), None
        if self.gap_timer is not None:
            for phase, seconds in self.gap_timer.collect():
                if phase == "fwd_bwd":
                    self.tuner.observe_compute_gap(seconds)
                else:
                    self.tuner.observe_optimizer_step(seconds)
        choice = self.tuner.choose(
            lambda w: copy_schedule(self._plan_for(layout, w), layout, self._mode_for(w)),
            lambda w: (w == 1 or not replay_blocked)
            and (self._mode_for(w) != "stage" or self._staging_fits(staging_span(self._plan_for(layout, w), layout)[1])),
        )
        return choice.window_steps, choice

    def _mode_for(self, window: int) -> str:
        return "window" if window == 1 else self.consistency

    def _current_layout(self) -> StateLayout:
        fp = live_fingerprint(self.model, self.optimizer)
        if self._layout is None or self._layout.fingerprint != fp:
            self._layout = build_layout(self.model, self.optimizer)
            self._plans = {}
            self._layout_ids = {}
        return self._layout

    def _plan_for(self, layout: StateLayout, window: int) -> CopyPlan:
        """The plan for ``window`` over ``layout``, the current layout (plans are dropped with it)."""
        if window not in self._plans:
            self._plans[window] = make_plan(layout.entries, window, layout.fingerprint)
        return self._plans[window]

    def _registered_plan(self, layout: StateLayout, window: int) -> CopyPlan:
        """The plan for ``window``, registered with the writer on first use."""
        plan = self._plan_for(layout, window)
        if window not in self._layout_ids:
            self._next_layout_id += 1
            self._layout_ids[window] = self._next_layout_id
            self.writer.send(p.SetLayoutRequest(self._next_layout_id, layout.entries, plan.offsets))
        return plan

    def _start_snapshot(
        self, slot: HostSlot, deferred: bool, layout: StateLayout, plan: CopyPlan, choice: WindowChoice | None
    ) -> None:
        window = plan.window_steps
        mode = self._mode_for(window)
        s = self.step_count
        self._next_request_id += 1
        ledger = CheckpointLedger(
            requested_step=s,
            target_version=s if mode != "replay" else s + window - 1,
            window=window,
            mode=mode,
            groups=[GroupRecord(index=g.index, nbytes=g.nbytes) for g in plan.groups],
            window_choice=None if choice is None else choice.to_json(),
            restarted_from=self._restarted_from,
        )
        self._restarted_from = None
        snap = Snapshot(
            request_id=self._next_request_id,
            requested_step=s,
            window=window,
            mode=mode,
            slot=slot,
            plan=plan,
            layout=layout,
            layout_id=self._layout_ids[window],
            ledger=ledger,
            deferred=deferred,
        )
        # First, so that a staging budget that is too small, or a gradient buffer that
        # cannot be allocated, raises before the snapshot is registered.
        if snap.mode == "stage":
            self._stage_later_groups(snap)
        if snap.mode == "replay":
            self.slots.prepare_gradient_views(slot, plan, layout)
        slot.busy = True
        self._snapshots.append(snap)
        if snap.mode == "replay":
            snap.replay_log = ReplayLog(
                optimizer_class=(type(self.optimizer).__module__, type(self.optimizer).__qualname__),
                grad_slot_id=slot.grad_buffer_id,
                grad_offsets=slot.grad_offsets,
                param_group_of={
                    fqn: gi for gi, fqns in enumerate(layout.group_param_fqns) for fqn in fqns
                },
                copy_group_of=plan.group_of_param(),
                base_step=s,
                group_versions=[None] * len(plan.groups),
            )
        self._enqueue_group(snap, 0)
        if snap.mode != "replay" or snap.next_group == len(plan.groups):
            # Window 1 and stage mode hold version s: every later group was staged above.
            self._reach_version(snap, s)

    def _advance_window(self, snap: Snapshot) -> None:
        """Post-hook of step t: copy (replay) or drain (stage) the group due now."""
        j = snap.next_group
        if j >= len(snap.plan.groups):
            return
        self._enqueue_group(snap, j)
        if snap.version is None and snap.next_group == len(snap.plan.groups):
            self._reach_version(snap, self.step_count)

    def close_window(self, snap: Snapshot) -> None:
        """Close an open window at the current step: copy what is missing now."""
        if snap.state != OPEN:
            return
        if snap.version is None and snap.next_group < len(snap.plan.groups):
            snap.ledger.closed_early_at = self.step_count
        while snap.next_group < len(snap.plan.groups):
            self._enqueue_group(snap, snap.next_group)
        if snap.version is None:
            self._reach_version(snap, self.step_count)

    def _reach_version(self, snap: Snapshot, version: int) -> None:
        snap.version = version
        snap.ledger.target_version = version
        # Provisional: ckpt.step() at the end of this iteration captures the boundary again.
        self._capture_boundary(snap)
        snap.boundary_open = True
        if snap.replay_log is not None:
            snap.replay_log.target_version = version

    def _enqueue_group(self, snap: Snapshot, j: int) -> None:
        plan, layout = snap.plan, snap.layout
        idx = plan.groups[j].entry_indices
        views = snap.slot.entry_views(plan, layout)
        dst = [views[i] for i in idx]
        from_staging = snap.mode == "stage" and j > 0
        if from_staging:
            src = [snap.slot.staged_views[i] for i in idx]
            keepalive: list[torch.Tensor] = []
        else:
            src = [layout.live_tensors[i] for i in idx]
            buffers = [k for k, i in enumerate(idx) if layout.entries[i].role == ROLE_BUFFER]
            keepalive = []
            if buffers and self.copier.is_async:
                # The next forward mutates buffers (BatchNorm running stats) before any
                # fence of ours runs: clone them on the compute stream now.
                clones = self.copier.stage([src[k] for k in buffers])
                for k, c in zip(buffers, clones):
                    src[k] = c
                keepalive = clones
        ticket = self.copier.copy_async(src, dst, keepalive=keepalive)
        ticket.group_index = j
        snap.tickets.append(ticket)
        if not from_staging:
            snap.unfenced.append(ticket)
            ticket.fence_after_hook = self._hook_serial
        else:
            snap.slot.staging_ready_tickets.append(ticket)
        version = snap.requested_step if snap.mode == "stage" else self.step_count
        snap.ledger.group_enqueued(j, version)
        if snap.replay_log is not None:
            snap.replay_log.group_versions[j] = version
        snap.next_group = j + 1

    def _stage_later_groups(self, snap: Snapshot) -> None:
        """Stage mode: clone groups 1..W-1 before step s+1 can mutate them."""
        plan, layout, slot = snap.plan, snap.layout, snap.slot
        later = [i for g in plan.groups[1:] for i in g.entry_indices]
        if not later:
            return
        base, needed = staging_span(plan, layout)
        if not self._staging_fits(needed):
            raise ConfigError(
                f"stage mode needs {needed} bytes of staging for window {snap.window} "
                f"(groups 1..{snap.window - 1} of {layout.nbytes} bytes of state), but "
                f"stage_budget_bytes={self.stage_budget_bytes}; raise stage_budget_bytes to at least "
                f"{needed}, use a smaller window, or use consistency='replay'"
            )
        for ticket in slot.staging_ready_tickets:
            # The previous snapshot's drains read this staging area on the side stream;
            # the compute stream must not overwrite it, nor reuse its memory once it is
            # freed below (the allocator hands it back on this stream), before they are done.
            self.copier.fence_compute(ticket)
        slot.staging_ready_tickets = []
        # Sized for this window; a narrower one (window="auto") shrinks it, and device
        # memory a budget reserved up front is kept.
        capacity = needed if self.stage_budget_bytes is None else max(needed, self.stage_budget_bytes)
        if slot.staging is None or slot.staging.numel() != capacity:
            slot.staging = None  # freed first, so the old and the new area are never both held
            slot.staging = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        staged = [None] * len(layout.entries)
        for i in later:
            staged[i] = view_bytes(slot.staging, plan.offsets[i] - base, layout.entries[i].dtype, layout.entries[i].shape)
        targets = [staged[i] for i in later]
        with torch.no_grad():
            # On the compute stream, in order after step s: the staged copy is version s.
            torch._foreach_copy_(targets, [layout.live_tensors[i].detach() for i in later])
        slot.staged_views = staged  # type: ignore[assignment]

    def _staging_fits(self, needed_bytes: int) -> bool:
        return self.stage_budget_bytes is None or needed_bytes <= self.stage_budget_bytes

    def _log_gradients(self, snap: Snapshot, step: int) -> None:
        """Pre-hook of step ``step`` inside a replay window: copy the gradients it will consume."""
        log: ReplayLog = snap.replay_log
        i = step - snap.requested_step
        copied = list(range(snap.next_group))
        if i < 1 or not copied:
            return
        by_fqn = dict(zip(snap.layout.param_fqns, snap.layout.params))
        srcs, dsts, none = [], [], []
        for j in copied:
            for fqn in snap.plan.groups[j].param_fqns:
                grad = by_fqn[fqn].grad
                if grad is None:
                    none.append(fqn)
                    continue
                srcs.append(grad)
                dsts.append(snap.slot.grad_views[(i, fqn)])
        ticket = self.copier.copy_async(srcs, dsts)
        if self.copier.is_async:
            for g in srcs:
                # zero_grad(set_to_none=True) frees the gradient after this step; keep the
                # allocator from handing its memory to the compute stream before the side
                # stream has read it.
                g.record_stream(self.copier.side_stream)  # type: ignore[union-attr]
        snap.tickets.append(ticket)
        if _step_writes_gradients(self.optimizer):
            # Fence 2 before this step: it writes the gradients in place (SGD's foreach
            # Nesterov update adds the momentum into them) while the side stream reads them.
            self.copier.fence_compute(ticket)
        else:
            # Fence 2 after the step: the next zero_grad(set_to_none=False) or backward may
            # write them in place.
            snap.unfenced.append(ticket)
            ticket.fence_after_hook = self._hook_serial
        log.steps.append(GradientStep(step=step, groups=copied, hyperparameters=capture_hyperparameters(self.optimizer), grad_none=none))
        snap.ledger.gradients_logged(step, copied)

    def _note_grad_scaler(self) -> None:
        if not self._grad_scaler_seen and hasattr(self.optimizer, "found_inf"):
            self._grad_scaler_seen = True
            if self.consistency == "replay" and self.window_setting != 1:
                warnings.warn(_GRAD_SCALER_WARNING, stacklevel=4)

    def _restart_if_state_grew(self) -> None:
        """Post-hook: a replay window whose layout lacks state this step created cannot reach its version."""
        signature = None
        for snap in list(self._snapshots):
            if snap.mode != "replay" or snap.version is not None:
                continue
            signature = signature or optimizer_shape_signature(self.optimizer)
            if signature != snap.layout.shape_signature:
                self._restart(snap, _NEW_STATE_WARNING, start_step=self.step_count)

    def _restart(self, snap: Snapshot, warning: str, start_step: int) -> None:
        """Replace a replay snapshot that cannot reach its version, by one started at ``start_step``."""
        for ticket in snap.tickets:
            # The slot may be released or regrown for the new layout: its host memory must
            # not be unmapped under copies still writing it. Rare (a layout change), so the
            # host waits here rather than tracking the old copies further.
            self.copier.wait(ticket)
        self._snapshots.remove(snap)
        snap.slot.busy = False
        self._restarted_from = snap.requested_step
        self._pending_requests += 1
        warnings.warn(warning.format(old=snap.requested_step, new=start_step), stacklevel=4)

    def _fence(self, snap: Snapshot) -> None:
        """Insert the device-side waits for copies enqueued by earlier hooks."""
        keep = []
        for ticket in snap.unfenced:
            if ticket.fence_after_hook >= self._hook_serial:
                keep.append(ticket)
                continue
            # Fence 2 (see transfer.py): the optimizer step (pre-hook) or the next
            # iteration's zero_grad/backward (post-hook) mutates what this copy reads.
            if self.copier.fence_compute(ticket):
                snap.device_waits_in_flight += 1
            if self.copier.is_async:
                snap.device_waits_inserted += 1
        snap.unfenced = keep

    def _capture_boundary(self, snap: Snapshot) -> None:
        # A scheduler sets the next step's lr between the optimizer step and the end of
        # the iteration: param_groups belong to the boundary, like stateful objects.
        snap.small_state = capture_small_state(snap.layout, self.optimizer)
        snap.extra_state = capture_extra_state(self.stateful)

    def _close_boundary(self, snap: Snapshot, provisional: bool) -> None:
        """Keep the boundary captured in the post-hook: ckpt.step() did not come."""
        snap.boundary_open = False
        snap.ledger.boundary = "post-hook"
        if provisional and not self._user_marks_boundary and not self._warned_boundary and self.stateful:
            self._warned_boundary = True
            warnings.warn(_BOUNDARY_WARNING, stacklevel=4)

    # ---- completion ----------------------------------------------------------------

    def _progress(self) -> None:
        """Poll copy events and the writer; hand landed snapshots to the writer. Never blocks."""
        for snap in self._snapshots:
            if self._ready_to_send(snap):
                if all(self.copier.poll(t) for t in snap.tickets):
                    self._send(snap)
        if not self._snapshots and not self.writer.awaiting_responses:
            # Nothing is due: a liveness check (one waitpid) instead of reading the pipe.
            try:
                self.writer.check_alive()
            except OverlapCkptError as e:
                self._fail(e)
            return
        try:
            responses = self.writer.poll()
        except OverlapCkptError as e:
            self._fail(e)
            return
        for response in responses:
            self._handle(response)

    @staticmethod
    def _ready_to_send(snap: Snapshot) -> bool:
        return (
            snap.state == OPEN
            and snap.version is not None
            and snap.next_group == len(snap.plan.groups)
            and not snap.boundary_open
        )

    def _send(self, snap: Snapshot) -> None:
        for g in snap.ledger.groups:
            landed = [t.landed_at_s or 0.0 for t in snap.tickets if t.group_index == g.index]
            if landed:
                g.landed_s = max(landed) - snap.ledger.requested_at
        snap.ledger.mark_complete()
        snap.state = SENT
        stats = self._stats_of(snap)
        if self.tuner is not None:  # every copy has landed: the bandwidth the next choice uses
            self.tuner.observe_copies(stats["copied_nbytes"], stats["copy_s"])
        self.writer.send(
            p.PersistRequest(
                request_id=snap.request_id,
                slot_id=snap.slot.slot_id,
                layout_id=snap.layout_id,
                name=checkpoint_name(snap.version),
                step=snap.version,
                requested_step=snap.requested_step,
                mode=snap.mode,
                window=snap.window,
                small_state=snap.small_state,
                extra_state=snap.extra_state,
                ledger=snap.ledger.to_json(),
                stats=stats,
                keep=self.keep,
                replay=snap.replay_log,
            )
        )

    def _stats_of(self, snap: Snapshot) -> dict[str, Any]:
        copy_s = sum(t.copy_s or 0.0 for t in snap.tickets)
        return {
            "step": snap.version,
            "requested_step": snap.requested_step,
            "mode": snap.mode,
            "window": snap.window,
            "nbytes": snap.nbytes,
            "copy_s": copy_s,
            "copied_nbytes": sum(t.nbytes for t in snap.tickets),  # state, and replay's gradients
            "device_waits_inserted": snap.device_waits_inserted,
            "device_waits_in_flight": snap.device_waits_in_flight,
            "hook_host_s": snap.hook_host_s,
            "deferred": snap.deferred,
        }

    def _handle(self, response: object) -> None:
        if isinstance(response, p.MappedResponse):
            self.slots.mapped(response.slot_id)
            return
        if isinstance(response, p.CommittedResponse):
            snap = self._pop_snapshot(response.request_id)
            stats = self._stats_of(snap) if snap else {}
            if snap is not None:
                stats["time_to_commit_s"] = response.committed_at - snap.requested_wall_s
                stats["committed_at_unix_s"] = response.committed_at
                stats["persist_s"] = response.persist_s
                stats["ledger"] = snap.ledger.to_json()
            stats["path"] = response.info.path
            self.stats.append(stats)
            self._unreturned.append(response.info)
            return
        if isinstance(response, p.ErrorResponse):
            snap = self._pop_snapshot(response.request_id) if response.request_id is not None else None
            what = (
                f"the writer failed to persist the checkpoint of step {snap.version}"
                if snap is not None
                else "the writer failed"
            )
            self._fail(writer_error(response, what))

    def _pop_snapshot(self, request_id: int | None) -> Snapshot | None:
        for snap in self._snapshots:
            if snap.request_id == request_id:
                self._snapshots.remove(snap)
                snap.slot.busy = False
                return snap
        return None

    def _fail(self, error: OverlapCkptError) -> None:
        if self._error is None:
            self._error = error

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, WriterDiedError):
                # In-flight snapshots are gone with the writer; their slots are unusable.
                self.dead = error
                self._snapshots.clear()
            raise error

    def _charge(self, started: float) -> None:
        spent = time.perf_counter() - started
        for snap in self._snapshots:
            snap.hook_host_s += spent

    # ---- blocking calls (never from a hook) ------------------------------------------

    def wait(self, timeout_s: float | None) -> list[CheckpointInfo]:
        """Finish every requested snapshot now and block until the writer committed each."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if self.dead is not None:
            raise self.dead
        self._raise_pending()
        while True:
            # A deferred request starts as soon as a slot is free, at the current step.
            self._start_pending()
            for snap in list(self._snapshots):
                if snap.state != OPEN:
                    continue
                self.close_window(snap)
                if snap.boundary_open:
                    self._close_boundary(snap, provisional=False)
                for t in snap.tickets:
                    self.copier.wait(t)
            self._progress()
            self._raise_pending()
            if not self._snapshots and not self._pending_requests:
                break
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(
                    f"checkpoints of steps {[s.version for s in self._snapshots]} were not committed within "
                    f"timeout_s={timeout_s}; pass a larger timeout_s or None"
                )
            try:
                response = self.writer.wait_response(remaining)
            except WriterDiedError as e:
                self._fail(e)  # _raise_pending below marks the engine dead and raises it
            else:
                self._handle(response)
            self._raise_pending()
        out, self._unreturned = self._unreturned, []
        return out

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def release(self) -> None:
        self.slots.release_all()


def _step_writes_gradients(optimizer: torch.optim.Optimizer) -> bool:
    """Whether this optimizer's step writes ``.grad`` in place (found by reading torch.optim)."""
    return isinstance(optimizer, torch.optim.SGD) and any(
        g.get("nesterov") and g.get("momentum") and g.get("foreach") is not False for g in optimizer.param_groups
    )
