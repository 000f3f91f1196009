"""Requests and responses between the training process and its writer process.

Small dataclasses over a pipe; tensor data never travels here, only offsets into
shared host buffers that both processes map.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from .format.entries import TensorEntry
from .format.manifest import CheckpointInfo
from .format.manifest_records import GroupArithmetic

# How long a writer whose collective failed waits for a replacement writer to open the next
# generation of the writers' group before it reports the failure as it is (writer/group.py;
# capped there by the collective timeout); also the time a replacement takes to start, in
# WriterGroupSpec.regroup_join_timeout_s.
REGROUP_WAIT_S = 60.0



def new_store_key() -> bytes:
    """A fresh key for sealing the job store's values (writer/sealed_store.py), drawn on training rank 0 for one run."""
    return secrets.token_bytes(32)

@dataclass(frozen=True)
class WriterGroupSpec:
    """How a writer joins the writers' group (sent in its InitRequest)."""

    store_host: str
    store_port: int
    rank: int
    world_size: int
    timeout_s: float  # every collective of the writers' group, and joining it
    agreement_timeout_s: float  # how far apart in time ranks may reach the same checkpoint
    mesh_shape: tuple[int, ...]
    key_prefix: str = ""  # drawn at random on rank 0 for this run: the writers' keys live under it
    # Seals every value the writers write to the store (writer/sealed_store.py): drawn on rank 0,
    # shared over the training group, sent to the writer over its local socket pair only.
    store_key: bytes = b""
    restarted: bool = False  # a replacement for a dead writer: it opens the writers' next generation
    lost_names: tuple[str, ...] = ()  # a replacement's: checkpoints its rank had sent to the dead writer
    # Whether a dead writer is ever replaced (max_writer_restarts > 0, the same on every rank):
    # without, a writer whose collective a death broke reports it at once, waiting for no replacement.
    replaced_when_dead: bool = True
    # The node-local tier across nodes (format/peers.py): each rank's node index, by rank, and
    # how many partners on other nodes hold a copy of each rank's shard, sent at most this fast.
    node_of_rank: tuple[int, ...] = ()
    local_replicas: int = 0
    replica_bytes_per_s: float = 0.0
    # Each rank's node, by rank, in every distributed run: the writers' rounds go through each
    # node's leader where the ranks span nodes (writer/node_tree.py).
    round_nodes: tuple[int, ...] = ()

    @property
    def regroup_join_timeout_s(self) -> float:
        """How long a writer waits for every writer to join a generation after the first.

        A live writer leaves the old group when its collective there fails. A peer that
        died fails it at once, but a peer that already left may still hold its connections
        (its group not yet freed), and then the collective fails only at the collective
        timeout. So joiners wait two collective timeouts (the one in flight, and one more
        for a writer that had just started another) plus a replacement's start. A join that
        gave up sooner left the late writer alone, and every checkpoint after it failed.
        """
        return 2 * self.timeout_s + REGROUP_WAIT_S


@dataclass
class GradientStep:
    """What one optimizer step inside the window consumed."""

    step: int
    groups: list[int]  # copy groups whose gradients were logged
    hyperparameters: list[dict[str, Any]]  # per param_group, without "params"
    grad_none: list[str]  # FQNs of logged parameters that had no gradient (the optimizer skipped them)


@dataclass
class ReplayTables:
    """What a replay plan implies, the same for every snapshot under it: sent once, with the plan."""

    grad_offsets: dict[tuple[int, str], int]  # (window step index i, fqn) -> offset in the grad buffer
    grad_nbytes: int  # the gradient buffer a full window logs into
    param_group_of: dict[str, int]  # fqn -> index of its param_group
    copy_group_of: dict[str, int]  # fqn -> index of the copy group that holds it


@dataclass
class ReplayLog:
    """What one snapshot's window logged: with its plan's ``ReplayTables``, all the writer needs to roll each group forward."""

    optimizer_class: tuple[str, str]
    grad_buffer_id: int
    base_step: int  # the step s at which the snapshot was requested
    group_versions: list[int | None] = field(default_factory=list)
    steps: list[GradientStep] = field(default_factory=list)
    # How each param group is replayed (by its index in optimizer.param_groups), as the training
    # side measured it on the group's device: an emulation's name (device_adam_step.EMULATIONS),
    # or None: the CPU's own kernel, which CPU training ran. The manifest records them.
    group_arithmetics: list[GroupArithmetic] = field(default_factory=list)
    # The device's pow(beta, k) for the groups whose kernels compute their bias corrections on it
    # (beta_powers.BetaPowerTables.tables: float32 bits of beta -> float32 values for k = 1, 2, ...).
    beta_powers: dict[int, bytes] = field(default_factory=dict)

    def arithmetic_names(self) -> list[str | None]:
        """Each param group's arithmetic, by group index (None past the measured groups: the CPU's kernel)."""
        names: list[str | None] = [None] * (max((a.group for a in self.group_arithmetics), default=-1) + 1)
        for a in self.group_arithmetics:
            names[a.group] = a.arithmetic
        return names


@dataclass
class InitRequest:
    sys_path: list[str]
    root: str
    storage_options: dict[str, Any]
    store_class: tuple[str, str]  # (module, qualified name) of a CheckpointStore subclass
    group: WriterGroupSpec | None = None  # in a distributed run: the writers' group to join
    signing_key: bytes | None = None  # sign each manifest (format/signing.py); over the local socket pair only
    writer_threads: int | None = None  # the writer's threads (None: writer.process.writer_thread_count())
    local_root: str | None = None  # the node-local tier's directory (format/tiers.py), if the run has one
    replay_expected: bool = False  # replay with a window that may exceed 1: the writer warms replay up before Ready


@dataclass
class MapBufferRequest:
    """Followed on the socket by the buffer's file descriptor (SCM_RIGHTS)."""

    buffer_id: int
    nbytes: int


@dataclass
class WatchPreemptionRequest:
    """Distributed runs with save_on_signal: watch for a preemption and agree on its step (writer/preempt_watch.py).

    Followed on the socket by the control page's descriptor (SCM_RIGHTS), as MapBufferRequest.
    """

    nbytes: int
    agreement_timeout_s: float  # the longest the writers wait for every rank's step
    signals: tuple[int, ...] = ()  # save_on_signal: a signal posted in the store must be one of these


@dataclass
class ReleaseBufferRequest:
    buffer_id: int


@dataclass
class SetPlanRequest:
    plan_id: int  # names one (layout, window) pair
    entries: list[TensorEntry]  # this rank's share
    offsets: tuple[int, ...]
    # Every tensor of the checkpoint across all ranks, by DCP key: the coverage the writers check.
    global_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # A window of 2 or more: the tables its replay snapshots use (thousands of entries; sent once, not per snapshot).
    replay_tables: ReplayTables | None = None


EXPORT_FORMATS = ("hf_trainer",)  # framework files the writer can write next to DCP's (writer/exports.py)


@dataclass
class PersistRequest:
    request_id: int
    buffer_id: int  # the host slot the snapshot landed in
    plan_id: int
    name: str
    step: int
    requested_step: int
    mode: str
    window: int
    small_state: dict[str, Any]
    extra_state: dict[str, Any]
    ledger: dict[str, Any]
    stats: dict[str, Any]
    keep: int | None
    run_id: str  # this run's id: its manifests carry it, and keep= counts only its checkpoints
    restored_from: str | None = None  # the checkpoint this run continued from, if any
    # The runs this one descends from, nearest first: (run id, version continued from). keep= and
    # local_keep count their checkpoints up to those versions with this run's (writer/retention.py).
    ancestors: tuple[tuple[str, int], ...] = ()
    replay: ReplayLog | None = None  # a replay-mode snapshot: what the writer rolls its groups forward with
    proposed_next_window: int | None = None  # window="auto": this rank's choice for the next checkpoint
    root_leased: bool = False  # this run holds the root's lease: other runs' dead attempts are removed
    export_formats: tuple[str, ...] = ()  # framework files to write next to DCP's (writer/exports.py)
    key_layout: str = "get_state_dict"  # how the state is named inside DCP (format/key_layout.py)
    optimizer: str | None = None  # the optimizer class(es) by full name, checked when it is loaded
    tiers: tuple[str, ...] = ("root",)  # where it goes, in order (format/tiers.py): the local tier first
    local_keep: int | None = None  # the local tier's retention
    # Pipelined (landing_page.py): sent before its copies, the buffer id of the landing page that
    # says how much of the slot holds it; None: every byte was in the slot when it was sent.
    landing_buffer_id: int | None = None


@dataclass(frozen=True)
class FileCopy:
    """One file of a local-tier checkpoint, sent by the writer of rank ``source`` to that of rank ``target``."""

    source: int
    target: int
    filename: str
    nbytes: int


@dataclass
class FetchFilesRequest:
    """At a restore, every rank's writer at once: copy checkpoint ``name``'s missing files between nodes' tiers.

    The same ``copies`` on every rank (the restore works them out from every node's listing);
    a rank whose node lacks the checkpoint gets it published there once its files are in.
    """

    request_id: int
    name: str
    copies: tuple[FileCopy, ...]
    run_id: str


@dataclass
class FetchedResponse:
    request_id: int
    nbytes: int  # received by this rank's writer


@dataclass
class ShutdownRequest:
    pass


@dataclass
class ReadyResponse:
    pid: int


@dataclass
class MappedResponse:
    buffer_id: int


@dataclass
class CommittedResponse:
    request_id: int
    info: CheckpointInfo
    committed_at: float  # UNIX time
    persist_s: float
    removed: list[str] = field(default_factory=list)  # names deleted by retention
    # Where persist_s went (PhaseClock's laps, and the write's parts "write.*": StreamTimings).
    phases_s: dict[str, float] = field(default_factory=dict)
    # Failures after the commit (updating latest, retention): the checkpoint is committed all the same.
    warnings: list[str] = field(default_factory=list)
    agreed_next_window: int | None = None  # window="auto": the window every rank uses next
    # Each tier it committed in, in order, with its directory there (``info`` is the last one's).
    tier_paths: dict[str, str] = field(default_factory=dict)
    # How many nodes' leaders the writers' rounds went through (writer/node_tree.py): 1 where flat.
    round_node_count: int = 1


@dataclass(frozen=True)
class ReplayProgressNotice:
    """The writer is about to roll a snapshot's slot forward in place, or has: not an answer.

    Replay writes the shared slot in place. If the writer dies after it began, a successor
    must not replay the same log again (the groups would be stepped twice): the training
    side reads the last notice the dead writer sent before its end of the pipe closed.
    """

    request_id: int  # the persist request whose slot this is
    finished: bool  # False: replay is about to write the slot; True: the slot holds the version now


@dataclass
class ErrorResponse:
    request_id: int | None  # the persist request that failed, or None
    exception: BaseException | None  # the original exception, when it pickles
    type_name: str
    message: str
    traceback_text: str
