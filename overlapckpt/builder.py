"""Building a Checkpointer from its settings: each part in order, each teardown registered as it is built.

``Checkpointer.__init__`` checks its arguments into a ``CheckpointerSettings`` and calls
``build``. The parts come up in the order they depend on one another: the distributed
run (settings agreed across ranks), the store, the run's lineage, the writer (ready
before the first request), its link, the preemption guard and its control page, the
engine, and last the root's lease, so that a refusal tears down what was built and
nothing has touched the root's checkpoints. Each teardown goes on one
``contextlib.ExitStack`` as its part is built: a failure unwinds exactly what exists, in
reverse order, and a built Checkpointer's ``close()`` unwinds the same stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .control_page import PAGE_BYTES, OwnedControlPage
from .errors import InternalError
from .format.lease import RootLease, sweep_dead_tiers
from .format.manifest import name_style_for
from .format.peers import NodeLayout
from .format.storage import CheckpointStore
from .format.tiers import default_local_dir, prepare_tier
from .protocol import WatchPreemptionRequest
from .settings import AUTO_WINDOW, CheckpointerSettings
from .train.consistency.autowindow import PhaseTimer, make_gap_timer
from .train.copying.layout import CheckpointScope
from .train.copying.stream_copier import make_copier
from .train.copying.transfer import Copier
from .train.lifecycle.engine import SnapshotEngine
from .train.lifecycle.engine_parts import BuiltUnits, RunCallbacks
from .train.run.distributed import DistributedRun, is_distributed, set_up_distributed
from .train.run.lineage import Lineage
from .train.run.preemption import PreemptionGuard, default_grace_s
from .train.run.run_identity import agreed_run_id, take_root_lease
from .train.writer_client.client import WriterClient, WriterTargets
from .train.writer_client.link import WriterLink

log = logging.getLogger("overlapckpt")


@dataclass(frozen=True)
class Seams:
    """What tests and benchmarks inject in place of the device's own (``overlapckpt.seams``); users pass none."""

    copier: Copier | None = None  # how bytes reach host memory (default: the device's StreamCopier)
    phase_timer: PhaseTimer | None = None  # window="auto": what times the step's phases


@dataclass
class BuiltCheckpointer:
    """A Checkpointer's parts, and the stack that tears them down in reverse order."""

    store: CheckpointStore
    lineage: Lineage
    engine: SnapshotEngine
    distributed: DistributedRun | None
    preemption: PreemptionGuard | None
    control_page: OwnedControlPage | None
    lease: RootLease | None
    teardown: contextlib.ExitStack
    local_store: CheckpointStore | None = None  # the node-local tier (format/tiers.py), if the run has one
    # How long the writer may take to stop at teardown (close(): 30 s; leaving on an error: exit_timeout_s).
    writer_timeout_s: float = 30.0


@dataclass(frozen=True)
class LiveObjects:
    """What a Checkpointer is built over and no settings record holds: the live objects of the run."""

    model: nn.Module
    optimizer: Any  # the torch optimizer, already unwrapped and checked
    stateful: dict[str, Any]  # the other stateful objects, by key
    process_group: Any  # None, or the group a distributed run checkpoints over
    on_commit: Callable[[dict[str, Any]], None] | None
    signing_key: bytes | None


def build(settings: CheckpointerSettings, live: LiveObjects, *, seams: Seams, save_now: Callable[[float], Any]) -> BuiltCheckpointer:
    """Every part of a Checkpointer over ``live``'s model and optimizer (already unwrapped and checked)."""
    s = settings
    with contextlib.ExitStack() as stack:
        # The lease is taken last, and released last: its release goes on the stack first.
        lease_box: list[RootLease] = []

        def release_lease() -> None:
            for held in lease_box:
                held.release()

        stack.callback(release_lease)
        distributed = None
        if is_distributed(live.process_group):
            distributed = set_up_distributed(
                live.model, live.process_group, s.agreed(), s.distributed.collective_timeout_s,
                s.distributed.agreement_timeout_s, replaced_when_dead=s.writer.max_writer_restarts > 0,
            )
        store = s.storage.store_class(s.storage.path, dict(s.storage.storage_options))
        store.prepare_root()
        local_store = _local_tier(s, distributed)
        lineage = Lineage(
            agreed_run_id(distributed), names=name_style_for(s.storage.key_layout, s.writer.export_formats), root=s.storage.path
        )
        # Versions earlier runs hold in either tier get lineage names: a restore below the local tier's
        # newest then never meets its own name there (CheckpointExistsError from optimizer.step()).
        lineage.note_existing(store.committed_names() + ([] if local_store is None else local_store.committed_names()), own=set())
        # Filled in once the engine exists: a replacement writer is told which checkpoints its rank lost.
        engine_box: list[SnapshotEngine] = []
        start_writer = _WriterStarter(s, distributed, local_store, live.signing_key, engine_box)
        writer = start_writer()
        # Until the link owns it: a writer that cannot get ready is closed on the way out.
        stack.callback(lambda: None if engine_box else writer.close())
        # Ready before the first request (in a distributed run: every rank's writer has joined the
        # writers' group). A writer still starting held the first checkpoint's slot for its start-up
        # (0.9-2 s, a fresh interpreter importing torch), and requests made meanwhile were merged.
        writer.wait_ready()
        # A dead writer is replaced; in a distributed run its replacement re-forms the writers' group.
        link = WriterLink(writer, lambda: start_writer(restarted=True), s.writer.max_writer_restarts, distributed=distributed is not None)
        preemption, control_page = _preemption_guard(s, writer, link, distributed, save_now, lambda: engine_box[0].state.step_count, stack)
        units = _engine_units(s, live.model, link, seams, lineage, distributed)
        try:
            callbacks = RunCallbacks(at_boundary=None if preemption is None else preemption.at_boundary, on_commit=live.on_commit)
            engine = SnapshotEngine(live.model, live.optimizer, s, stateful=live.stateful, units=units, callbacks=callbacks)
        except BaseException:
            link.close(timeout_s=30.0)  # nothing may outlive a constructor that raised
            raise
        engine_box.append(engine)
        built = BuiltCheckpointer(
            store=store, lineage=lineage, engine=engine, distributed=distributed, preemption=preemption,
            control_page=control_page, lease=None, teardown=stack, local_store=local_store,
        )
        # The engine goes before the preemption guard and the control page (registered above):
        # the writer, the page's other user, stops first, then the page is released.
        stack.callback(lambda: engine.shut_down(built.writer_timeout_s))
        # Last: a refusal then tears down what was built, and nothing touched the root's checkpoints.
        built.lease = _take_leases(s, store, local_store, lineage, distributed, lease_box)
        built.teardown = stack.pop_all()
        return built
    raise InternalError("the builder's ExitStack swallowed an exception")  # it never does: nothing returns True


class _WriterStarter:
    """Starts this rank's writer process; called again with ``restarted=True`` when a dead one is replaced."""

    def __init__(
        self,
        s: CheckpointerSettings,
        distributed: DistributedRun | None,
        local_store: CheckpointStore | None,
        signing_key: bytes | None,
        engine_box: list[SnapshotEngine],
    ) -> None:
        self.s, self.distributed, self.local_store, self.signing_key = s, distributed, local_store, signing_key
        self.engine_box = engine_box  # the engine, once it exists

    def __call__(self, restarted: bool = False) -> WriterClient:
        s = self.s
        spec = None if self.distributed is None else self.distributed.writer_spec
        if spec is not None and restarted:
            # It opens the writers' next generation, and tells them which checkpoints this rank
            # had sent to the dead writer: they are lost on every rank.
            spec = dataclasses.replace(spec, restarted=True, lost_names=tuple(self.engine_box[0].parts.dispatcher.sent_names()))
        return WriterClient(
            WriterTargets(
                s.storage.path,
                dict(s.storage.storage_options),
                (s.storage.store_class.__module__, s.storage.store_class.__qualname__),
                local_root=None if self.local_store is None else self.local_store.root,
            ),
            group=spec,
            signing_key=self.signing_key,
            writer_threads=s.writer.writer_threads,
            replay_expected=s.overlap.consistency == "replay" and s.overlap.window != 1,
        )


def _engine_units(
    s: CheckpointerSettings, model: nn.Module, link: WriterLink, seams: Seams, lineage: Lineage, distributed: DistributedRun | None
) -> BuiltUnits:
    """The copier and phase timer for the model's device (or the seams' own), with the link, scope and lineage."""
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    auto = s.overlap.window == AUTO_WINDOW
    phase_timer = seams.phase_timer if seams.phase_timer is not None or not auto else make_gap_timer(device)
    return BuiltUnits(
        link=link,
        copier=seams.copier if seams.copier is not None else make_copier(device),
        gap_timer=phase_timer if auto else None,
        scope=CheckpointScope() if distributed is None else distributed.scope,
        lineage=lineage,
    )


def _take_leases(
    s: CheckpointerSettings,
    store: CheckpointStore,
    local_store: CheckpointStore | None,
    lineage: Lineage,
    distributed: DistributedRun | None,
    lease_box: list[RootLease],
) -> RootLease | None:
    """The root's lease (and the local tier's), each added to ``lease_box`` for release; the root's, or None."""
    lease = take_root_lease(store, lineage.run_id, distributed) if s.storage.lease else None
    if lease is not None:
        lease_box.append(lease)
    local_lease = None
    if local_store is not None and s.storage.lease:
        # The local tier is leased as a root is: one job per directory, and a dead job's
        # attempts there are removed by the next one's. Siblings a dead job left go too.
        local_lease = take_root_lease(local_store, lineage.run_id, distributed)
        if local_lease is not None:
            lease_box.append(local_lease)
        if distributed is None or distributed.scope.rank == 0:
            sweep_dead_tiers(local_store.root)
    lineage.root_leased = lease is not None and (local_store is None or local_lease is not None)
    return lease


def _local_tier(s: CheckpointerSettings, distributed: DistributedRun | None) -> CheckpointStore | None:
    """The node-local tier's store (created), or None without ``local_every``.

    Across nodes, the writers' group spec learns each rank's node and the replica count
    (``format/peers.py``): each node's tier holds its ranks' shards and its partners' copies.
    """
    if not s.tier.enabled:
        return None
    local_dir = s.tier.local_dir if s.tier.local_dir is not None else default_local_dir(s.storage.path)
    if distributed is not None:
        layout = NodeLayout(distributed.writer_spec.round_nodes)  # every rank's node, learnt at the set-up
        layout.check_replicas(s.tier.local_replicas)
        if layout.node_count > 1:
            if s.tier.local_replicas == 0:
                log.warning(
                    "overlapckpt: local_replicas=0 on %d nodes: a lost node takes its ranks' local-tier shards with it, "
                    "and a restart after it reads the root", layout.node_count,
                )
            distributed.writer_spec = dataclasses.replace(
                distributed.writer_spec,
                node_of_rank=layout.node_of_rank,
                local_replicas=s.tier.local_replicas,
                replica_bytes_per_s=s.tier.replica_mib_per_s * 2**20,
            )
    # Made 0700 and marked as this root's, or refused by name (format/tiers.py).
    return prepare_tier(local_dir, s.storage.path)


def _preemption_guard(
    s: CheckpointerSettings,
    writer: WriterClient,
    link: WriterLink,
    distributed: DistributedRun | None,
    save_now: Callable[[float], Any],
    current_step: Callable[[], int],
    stack: contextlib.ExitStack,
) -> tuple[PreemptionGuard | None, OwnedControlPage | None]:
    """The signal handlers for ``save_on_signal``, and (distributed) the page the writers agree through."""
    signals = tuple(s.preemption.save_on_signal)
    if not signals:
        return None, None
    grace_s = default_grace_s() if s.preemption.signal_grace_s is None else float(s.preemption.signal_grace_s)
    page = None
    if distributed is not None:
        # The ranks agree on the step through their writers (writer/preempt_watch.py), read
        # from this page at each boundary: no collective in a hook.
        page = OwnedControlPage()
        stack.callback(page.buffer.release)  # after the writer, the page's other user, stopped
        watch = WatchPreemptionRequest(nbytes=PAGE_BYTES, agreement_timeout_s=grace_s / 2, signals=signals)
        writer.send_with_fd(watch, page.fd)
        link.on_replaced(lambda new_writer: new_writer.send_with_fd(watch, page.fd))
    guard = PreemptionGuard(signals, grace_s, save_now, page=page, current_step=current_step)
    stack.callback(guard.uninstall)
    return guard, page
