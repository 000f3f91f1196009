"""The public ``Checkpointer``: wrap a model and optimizer, checkpoint without stopping training."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any, Literal, overload

from torch import nn

from .builder import LiveObjects, Seams, build
from .errors import ConfigError
from .exit_commit import ExitCommit
from .format.key_layout import GET_STATE_DICT
from .format.manifest import CheckpointInfo
from .format.signing import resolve_key
from .format.storage import CheckpointStore
from .optimizers import torch_optimizers, unwrap_optimizer
from .protocol import FileCopy
from .restore.pipeline import LoadOptions, LoadTargets, load_fetching_replicas
from .restore.tiers import RestoreReport
from .restore_marks import take_restore_mark
from .settings import (
    AUTO_INFLIGHT,
    DEFAULT_LOCAL_KEEP,
    DEFAULT_LOCAL_REPLICAS,
    DEFAULT_MAX_WINDOW,
    DEFAULT_MAX_WRITER_RESTARTS,
    DEFAULT_REPLICA_MIB_PER_S,
    CadenceSettings,
    CheckpointerSettings,
    DistributedSettings,
    OverlapSettings,
    PreemptionSettings,
    StorageSettings,
    TierSettings,
    WriterSettings,
    check_export_is_one_process,
    check_model,
    check_optimizer_for_mode,
    check_optimizer_matches_model,
    check_path,
    check_stateful,
)
from .train.run.preemption import PreemptionGuard
from .user_log import say_closed

log = logging.getLogger("overlapckpt")


class Checkpointer:
    """Checkpoints a model and optimizer from the optimizer's step hooks.

    Args:
        model: the module whose parameters the optimizer updates.
        optimizer: a ``torch.optim.Optimizer`` over ``model``'s parameters, or a wrapper that steps one
            (Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``, anything exposing
            it as ``.optimizer`` / ``._optimizer``): the torch optimizer inside is hooked and replayed.
        path: a local directory or fsspec URL (``s3://bucket/prefix``); created if missing.
        window: optimizer steps to spread the device-to-host copy over (1 = exact at the requested step),
            or ``"auto"``: per checkpoint, the smallest window whose copies fit inside the measured step
            phases, else the one with the least estimated stall (the choice and its inputs are in each
            checkpoint's ledger).
        every: start a checkpoint after every ``every``-th optimizer step (None: only on ``request()``).
        keep: keep only the newest ``keep`` committed checkpoints (None: keep all).
        stateful: name -> object with ``state_dict()``/``load_state_dict()`` (schedulers, samplers, ...).
        storage_options: passed to fsspec (``endpoint_url``, ``key``, ``secret``, ...).
        consistency: with ``window > 1``: ``"replay"`` (version s+W-1, replayed on the CPU, no extra
            GPU memory) or ``"stage"`` (version s, exact, needs staging memory on the device).
        stage_budget_bytes: the most device memory stage mode may use (None: what the window needs).
        max_inflight: snapshots in flight at once; each holds one host slot of the state's size.
            ``"auto"``: two (double buffering, so a persist slower than ``every`` steps does not
            cut the next window) where one slot is at most 256 MiB in one process; else one.
            A distributed run gets one: the ranks' state sizes differ and every rank must
            start a checkpoint at the same step (pass ``max_inflight=2`` on every rank for two).
        store_class: a ``CheckpointStore`` subclass the writer process uses to reach storage.
        max_window: with ``window="auto"``, the widest window it may choose.
        max_writer_restarts: a writer process that dies is replaced by a new one, which persists the
            snapshots complete in host memory, at most this many times an hour; the next death is raised
            as WriterDiedError (at once in a distributed run, whose writers share a group).
        exit_timeout_s: leaving ``with Checkpointer(...)`` on an exception commits the snapshots
            already complete in host memory within this many seconds, abandons open windows, and lets
            the exception through.
        save_on_signal: signals (e.g. ``(signal.SIGTERM,)``) on which to close open windows at the
            current step, checkpoint that step if nothing covers it, commit within ``signal_grace_s``,
            then exit as the signal would (or chain to the handler installed before). Installed from
            the main thread. Under torch.distributed, the ranks agree on one step, whichever of them
            were signalled, checkpoint it together and all exit with the signal (train/run/preemption.py).
        signal_grace_s: seconds from the signal to the commit; None: 5 s less than torchrun's
            SIGTERM-to-SIGKILL window (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default), so 25 s.
        process_group: under torch.distributed, the ranks that checkpoint together (default: the
            world). Construct the Checkpointer on every rank of it, with the same settings.
        collective_timeout_s: distributed: the timeout of every collective of the writers' group (a
            dead writer or rank surfaces as an error within it).
        agreement_timeout_s: distributed: how far apart in time the ranks may reach the same
            checkpoint before the request counts as one that other ranks did not make.
        signing_key: sign every manifest (HMAC-SHA256, with a SHA-256 of ``.metadata``); None reads
            ``OVERLAPCKPT_SIGNING_KEY``. ``restore`` then refuses unsigned or forged checkpoints.
            See docs/security.md for what the signature covers.
        lease: take the root's lease at construction (released at close), so that a second
            job on the same root is refused by name (``RootLeaseError``); see ``format/lease.py``.
        on_commit: called in the training process with each commit's figures, a dict with
            units in the names (``time_to_commit_s``, ``state_bytes``, ...), at the hook or
            call that learns of the commit. Exceptions it raises are logged, never raised.
        export_formats: framework files the writer also writes into each checkpoint, from
            the same snapshot: ``("hf_trainer",)`` for what Hugging Face's Trainer resumes
            from (one process, local root; set by ``overlapckpt.hf.OverlapCallback``).
        writer_threads: the writer process's threads (replay kernels; DCP writes one shard file
            per thread); None: a quarter of the usable cores, 1 to 4.
        key_layout: how the state is named inside DCP (``format/key_layout.py``):
            ``"get_state_dict"`` (torch's recipe: ``model.<fqn>``, ``optimizer.*``) or
            ``"torchtitan"`` (TorchTitan's manager: model FQNs at the top level, flat
            ``param_groups``, stateful objects as DCP items, ``step-N`` directories; set by
            ``overlapckpt.titan``).
        local_every: the node-local tier (docs/tiers.md): a checkpoint every ``local_every`` steps
            into ``local_dir``; None: no tier.
        local_keep: the tier's newest checkpoints kept.
        local_dir: the tier's directory on each node (default under ``/dev/shm``).
        local_replicas: on several nodes, the partner ranks on other nodes that also hold each
            rank's local-tier shard (``format/peers.py``), so a lost node loses none; a local-tier
            checkpoint commits once every shard and its replicas are in place.
        replica_mib_per_s: the most each writer sends to its partners per second (its copy is
            spread out, never a burst on the training's network).

    Host buffers are allocated on a background thread as soon as the state's size is known
    (here if the optimizer has state, else right after the first ``optimizer.step()``), so no
    checkpoint's hooks pay for allocating or pinning them.

    Call ``ckpt.step()`` at the end of each iteration (after ``scheduler.step()``): it is
    the boundary at which stateful objects and RNG states are captured.
    """

    # The device's own copier and phase timer; ``overlapckpt.seams.Checkpointer`` sets those a test passes.
    _seams = Seams()

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        path: str | os.PathLike[str],
        window: int | str = 1,
        every: int | None = None,
        keep: int | None = None,
        stateful: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        consistency: str = "replay",
        stage_budget_bytes: int | None = None,
        max_inflight: int | str = AUTO_INFLIGHT,
        store_class: type[CheckpointStore] = CheckpointStore,
        max_window: int = DEFAULT_MAX_WINDOW,
        max_writer_restarts: int = DEFAULT_MAX_WRITER_RESTARTS,
        exit_timeout_s: float = 60.0,
        save_on_signal: tuple[int, ...] = (),
        signal_grace_s: float | None = None,
        process_group: Any = None,
        collective_timeout_s: float = 300.0,
        agreement_timeout_s: float = 120.0,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        lease: bool = True,
        signing_key: str | bytes | None = None,
        export_formats: tuple[str, ...] = (),
        writer_threads: int | None = None,
        key_layout: str = GET_STATE_DICT,
        local_every: int | None = None,
        local_keep: int = DEFAULT_LOCAL_KEEP,
        local_dir: str | os.PathLike[str] | None = None,
        local_replicas: int = DEFAULT_LOCAL_REPLICAS,
        replica_mib_per_s: float = DEFAULT_REPLICA_MIB_PER_S,
    ) -> None:
        settings = CheckpointerSettings(
            storage=StorageSettings(path, dict(storage_options or {}), store_class, key_layout, lease),  # type: ignore[arg-type]
            overlap=OverlapSettings(window, consistency, max_window, stage_budget_bytes),
            cadence=CadenceSettings(every, keep, max_inflight),
            tier=TierSettings(
                local_every, local_keep, os.fspath(local_dir) if isinstance(local_dir, os.PathLike) else local_dir, local_replicas, replica_mib_per_s
            ),
            writer=WriterSettings(max_writer_restarts, writer_threads, float(exit_timeout_s), tuple(export_formats)),
            distributed=DistributedSettings(collective_timeout_s, agreement_timeout_s),
            preemption=PreemptionSettings(tuple(save_on_signal), signal_grace_s),
        )
        self._open(_checked(settings, stateful), model, optimizer, stateful or {}, process_group, on_commit, signing_key)

    @classmethod
    def from_settings(
        cls,
        model: nn.Module,
        optimizer: Any,
        settings: CheckpointerSettings,
        *,
        stateful: dict[str, Any] | None = None,
        process_group: Any = None,
        on_commit: Callable[[dict[str, Any]], None] | None = None,
        signing_key: str | bytes | None = None,
    ) -> Checkpointer:
        """A Checkpointer from one settings record (``overlapckpt.settings``), beside the keyword constructor.

        The record is built by keyword, a part per concern, and checked here as the keywords are::

            settings = CheckpointerSettings(
                storage=StorageSettings(path="/ckpt"), overlap=OverlapSettings(window=4), cadence=CadenceSettings(every=100),
            )
            ckpt = Checkpointer.from_settings(model, optimizer, settings)

        The live objects (model, optimizer, stateful objects, process group, callback, key) are no
        settings: they come as arguments, as to the constructor.
        """
        if not isinstance(settings, CheckpointerSettings):
            raise ConfigError(f"settings={settings!r} is not a CheckpointerSettings; build one from overlapckpt.settings, by keyword")
        ckpt = cls.__new__(cls)
        ckpt._open(_checked(settings, stateful), model, optimizer, stateful or {}, process_group, on_commit, signing_key)
        return ckpt

    def _open(
        self,
        settings: CheckpointerSettings,
        model: Any,
        optimizer: Any,
        stateful: Any,
        process_group: Any,
        on_commit: Callable[[dict[str, Any]], None] | None,
        signing_key: str | bytes | None,
    ) -> None:
        """Check the live objects, build every part (``builder.py``), continue a restored run."""
        check_model(model)
        # Accelerate's and Lightning's wrappers step the torch optimizer they hold: hook and replay that one.
        optimizer = unwrap_optimizer(optimizer)
        check_optimizer_matches_model(model, optimizer)
        check_optimizer_for_mode(optimizer, settings.overlap.window, settings.overlap.consistency)
        stateful = check_stateful(stateful)
        check_export_is_one_process(settings.writer.export_formats, process_group)
        self.settings = settings
        self._signing_key = resolve_key(signing_key)
        self.path = settings.storage.path
        self.storage_options = dict(settings.storage.storage_options)
        self.model, self.optimizer, self.stateful = model, optimizer, stateful
        self.window, self.consistency = settings.overlap.window, settings.overlap.consistency
        self.exit_timeout_s = settings.writer.exit_timeout_s
        self._closed = False
        live = LiveObjects(model, optimizer, stateful, process_group, on_commit, self._signing_key)
        built = build(settings, live, seams=self._seams, save_now=self._save_now)
        self._built = built
        self._store, self._lineage, self._engine = built.store, built.lineage, built.engine
        self._distributed, self._preemption, self._control_page, self._lease = (
            built.distributed, built.preemption, built.control_page, built.lease,
        )
        self._lineage_starts_at = 0  # the first of self.stats in the current lineage (see continued_from)
        self._restore_figures: dict[str, Any] | None = None  # the last restore()'s (restore_figures)
        # Never closed: at interpreter exit, commit what is complete, say what was lost, release the lease.
        # It holds the parts, not the Checkpointer: a script may drop that (a local of its main()).
        self._exit_commit = ExitCommit(built, self.path, self.exit_timeout_s)
        atexit.register(self._exit_commit)
        # Resumed with load(): continue that checkpoint's version count and lineage, as restore() does.
        resumed = take_restore_mark(model, optimizer, torch_optimizers(optimizer))
        if resumed is not None:
            self._continue_after_load(resumed)
            log.info("continuing from %s: the next optimizer step makes version %d", resumed.path, resumed.step + 1)

    # ---- training loop ---------------------------------------------------------------

    def request(self) -> None:
        """Checkpoint the state as of the last completed optimizer step (deferred while no slot is free)."""
        self._check_open()
        self._engine.request()

    def before_update(self) -> None:
        """Fence the copies in flight now, right before the optimizer's update (idempotent).

        The step hooks already fence right before the update, after the closure if
        ``step`` takes one (``step_hooks.py``). This is for frameworks with their own
        "right before the update" callback; calling it is never needed for exactness.
        """
        self._check_open()
        self._engine.fence_copies()

    def step(self) -> None:
        """Mark the end of a training iteration: the boundary for stateful objects and RNG states."""
        self._check_open()
        self._engine.mark_iteration_end()

    def wait(self, timeout_s: float | None = None) -> list[CheckpointInfo]:
        """Finish every requested checkpoint and block until each has committed.

        Open windows are closed at the current step. Returns the checkpoints committed
        since the previous ``wait()``; raises the writer's error, or ``CheckpointTimeoutError``
        (a ``TimeoutError``).
        """
        self._check_open()
        return self._engine.wait(timeout_s)

    def _save_now(self, timeout_s: float) -> list[CheckpointInfo]:
        """Close open windows at the current step, checkpoint it unless covered, commit within ``timeout_s``."""
        if not self._engine.covers_current_step():
            self._engine.request()
        return self._engine.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> list[CheckpointInfo]:
        """Finish what is in flight, stop the writer and remove the hooks."""
        if self._closed:
            return []
        self._closed = True
        preemption: PreemptionGuard | None = getattr(self, "_preemption", None)
        if preemption is not None:
            preemption.uninstall()
        try:
            if self._engine.state.dead is not None:
                return []  # the death was raised already; nothing is left to finish
            committed = self._engine.wait(timeout_s)
        finally:
            self._tear_down(writer_timeout_s=30.0)
        say_closed(self.path, self.stats)
        return committed

    def _tear_down(self, writer_timeout_s: float) -> None:
        """Remove the hooks, stop the writer, release host buffers (after the copies into them), the page, the lease."""
        atexit.unregister(self._exit_commit)
        self._built.writer_timeout_s = writer_timeout_s
        self._built.teardown.close()  # in the reverse order of building (builder.py)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        # The loop raised: the user's exception goes on, delayed by at most exit_timeout_s.
        self._close_after_error()

    def _close_after_error(self) -> None:
        """Commit what is complete in host memory within ``exit_timeout_s``, abandon open windows, never raise."""
        if self._closed:
            return
        self._closed = True
        if self._preemption is not None:
            self._preemption.uninstall()
        try:
            if self._engine.state.dead is None:
                self._engine.abandon(self.exit_timeout_s)
        except Exception as e:  # never mask the exception that is unwinding
            warnings.warn(f"overlapckpt: closing after an error failed: {e}", stacklevel=3)
        finally:
            self._tear_down(writer_timeout_s=min(30.0, self.exit_timeout_s))

    # ---- inspection and restore ------------------------------------------------------

    @property
    def stats(self) -> list[dict[str, Any]]:
        """Per committed checkpoint: step, bytes, copy time, device-side waits, time to commit, ledger.

        ``persist_phases_s`` splits the writer's ``persist_s``: agreeing and replaying, the
        snapshot's checksums, the write (with its parts ``write.to_storage``,
        ``write.checksums``, ``write.writeback_hints`` and ``write.fsync``, summed over the
        shard files and their threads), the manifest and the commit (on the rank that
        commits: the coordinator of a distributed run). In a distributed run, ``plan_round``
        appears at the first checkpoint of each layout only: the writers' plan round, which
        later checkpoints of that layout skip.
        """
        return [asdict(s) for s in self._engine.parts.dispatcher.stats]

    @property
    def deferrals(self) -> int:
        """Requests that had to wait for a free host slot."""
        return self._engine.parts.requests.deferrals

    @property
    def hook_host_s(self) -> float:
        """Host seconds spent in overlapckpt's step hooks, ``step()`` and ``request()`` since construction.

        What the training loop waits for on our account: on a GPU the copies themselves
        are asynchronous, this host time is not (benchmarks/hook_scaling.py reports it per step).
        """
        return self._engine.state.hook_host_total_s

    @property
    def hook_cpu_s(self) -> float:
        """The CPU time the training thread spent in those same hooks (``time.thread_time``).

        ``hook_host_s`` less what the thread waited for (a slot, a fence the device runs on the
        host in the emulated device) or lost to other threads and processes on a busy machine.
        """
        return self._engine.state.hook_cpu_total_s

    @property
    def step_count(self) -> int:
        """Optimizer steps taken, continued from the restored checkpoint after ``restore()``."""
        return self._engine.state.step_count

    @property
    def writer_pid(self) -> int:
        return self._engine.parts.link.writer.pid

    @property
    def writer_restarts(self) -> int:
        """Times a dead writer process was replaced by a new one."""
        return self._engine.parts.link.restarts.count

    @property
    def snapshots_dropped(self) -> int:
        """Snapshots still being copied when their writer died (their requests may be made again)."""
        return self._engine.state.snapshots_dropped

    @overload
    def restore(
        self, step: int | None = ..., *, missing_ok: Literal[False] = ..., into: LoadTargets | None = ...
    ) -> CheckpointInfo: ...

    @overload
    def restore(self, step: int | None = ..., *, missing_ok: bool, into: LoadTargets | None = ...) -> CheckpointInfo | None: ...

    def restore(self, step: int | None = None, *, missing_ok: bool = False, into: LoadTargets | None = None) -> CheckpointInfo | None:
        """Load this Checkpointer's newest (or ``step``'s) checkpoint into its objects and continue its step count.

        ``ckpt.restore(missing_ok=True)`` is the one line a restartable script needs: it
        resumes the newest verified checkpoint of either tier, or returns None, touching
        nothing, when there is none yet (a first run). Any other failure raises, and leaves
        the live objects as they were.

        ``load()`` is the way to load; this is ``load()`` on this Checkpointer's own root,
        objects and key, plus what only a live Checkpointer can do: continue its version
        count and lineage from the restored checkpoint (a rollback inside one run starts a
        new lineage, ``train/run/lineage.py``), with its hooks off while the load may step the
        optimizer to create its state.

        ``into``: load into these objects instead of the Checkpointer's own (a framework's
        resume that excludes some of them, or holds its model in parts); the version count and
        lineage continue all the same.
        """
        targets = into if into is not None else LoadTargets(self.model, self.optimizer, self.stateful)
        with self.steps_not_counted():
            # load() on this Checkpointer's objects; across nodes, a node that lacks the local tier's
            # newest files gets them from a partner's replica through the writers (restore/tiers.py).
            report = RestoreReport()
            info = load_fetching_replicas(
                self._fetch_replicas, self.path, targets,
                LoadOptions(step, self.storage_options, process_group=self.process_group, signing_key=self._signing_key,
                            local_dir=self.local_dir, missing_ok=missing_ok),
                report,
            )
        if info is None:
            return None
        self._continue_after_load(info, report)
        return info

    def _fetch_replicas(self, name: str, copies: tuple[FileCopy, ...]) -> None:
        # Every writer copies and then agrees (replicas.py): within two collective timeouts or dead.
        timeout_s = 2 * self.settings.distributed.collective_timeout_s
        self._engine.parts.dispatcher.fetch_replicas(name, copies, self._lineage.run_id, timeout_s)

    @property
    def store(self) -> CheckpointStore:
        """The root's store: its committed checkpoints (``committed_names()``), their URLs, its files."""
        return self._store

    @property
    def signed(self) -> bool:
        """Whether this Checkpointer signs its checkpoints and refuses unsigned ones (a signing key is set)."""
        return self._signing_key is not None

    @property
    def local_dir(self) -> str | None:
        """The node-local tier's directory (``local_every``), or None without one."""
        local = self._built.local_store
        return None if local is None else local.root

    def _continue_after_load(self, info: CheckpointInfo, report: RestoreReport | None = None) -> None:
        """Continue from a loaded checkpoint: its lineage when it is the root's or the local tier's, else its count only.

        With ``report``: its figures go to ``on_commit`` with the next commit's (``restore_figures``).
        """
        name = os.path.basename(info.path.rstrip("/"))
        local = self._built.local_store
        ours = self._store.checkpoint_url(name) == info.path or (local is not None and local.checkpoint_url(name) == info.path)
        self.continued_from(info if ours else info.step)
        if report is not None:
            self._report_restore(report, info.step)

    def _report_restore(self, report: RestoreReport, step: int) -> None:
        """A restore's figures: ``restore_figures`` now, and to ``on_commit`` with the next commit's."""
        self._restore_figures = report.figures(step)
        self._engine.parts.dispatcher.figures_for_next_commit.update(self._restore_figures)

    @property
    def restore_figures(self) -> dict[str, Any] | None:
        """The last ``restore()``'s figures: its source (``"local tier"``, ``"partner replicas"``, ``"root"``), version,
        and seconds per part (``restore_choose_s``, ``restore_fetch_s``, ``restore_read_s``, ``restore_s``), fetched
        files and bytes; None before one. ``on_commit`` receives them too, with the next commit's figures."""
        return self._restore_figures

    @property
    def process_group(self) -> Any:
        """The ranks that checkpoint together (None in one process)."""
        return None if self._distributed is None else self._distributed.group

    @contextlib.contextmanager
    def steps_not_counted(self) -> Iterator[None]:
        """Optimizer steps inside are no training steps: not counted, never checkpointed (hooks removed).

        For a load: ``get_state_dict`` (and TorchTitan's ``init_optim_state``) may run one
        zero-gradient step to create the optimizer's state. Checkpoints in flight commit first.
        """
        self._check_open()
        self._engine.wait(None)
        self._engine.parts.step_point.remove()
        try:
            yield
        finally:
            self._engine.parts.step_point.install()

    def continued_from(self, info: CheckpointInfo | int, report: RestoreReport | None = None) -> None:
        """The state now equals checkpoint ``info``, restored by a framework's own resume: continue from it.

        The next update makes version ``info.step + 1``; retention and ``latest`` treat
        this run as the one that continued from ``info`` (as after ``restore()``). An int
        is a version restored from elsewhere (a framework's own checkpoint): only the
        count continues. ``report``: that resume's figures, for ``restore_figures`` and the
        next commit's ``on_commit``, as ``restore()`` gives them.
        """
        self._check_open()
        if report is not None:
            self._report_restore(report, info if isinstance(info, int) else info.step)
        if isinstance(info, int):
            self._engine.continue_from(info)
            return
        self._engine.continue_from(info.step)
        # Both tiers' names: a version the local tier holds from an earlier run is taken as the root's are.
        local = self._built.local_store
        committed = self._store.committed_names() + ([] if local is None else local.committed_names())
        # This run's own checkpoints of its current lineage (a restore before starts a new one).
        own = {os.path.basename(s.path.rstrip("/")) for s in self._engine.parts.dispatcher.stats[self._lineage_starts_at :] if s.path}
        run_before = self._lineage.run_id
        lineage = (((info.run_id, info.step),) if info.run_id else ()) + tuple(info.ancestors)
        self._lineage.restored(os.path.basename(info.path.rstrip("/")), info.step, committed, own & set(committed), lineage)
        if self._lineage.run_id != run_before:
            self._lineage_starts_at = len(self._engine.parts.dispatcher.stats)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed; create a new one to keep checkpointing")


def _checked(settings: CheckpointerSettings, stateful: Any) -> CheckpointerSettings:
    """The record both constructors open with: the path as a string, the stateful objects' names, every value checked."""
    names = tuple(sorted(stateful)) if isinstance(stateful, dict) else ()
    storage = dataclasses.replace(settings.storage, path=check_path(settings.storage.path))
    return dataclasses.replace(settings, storage=storage, stateful_names=names).checked()
