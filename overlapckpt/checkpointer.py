"""The public ``Checkpointer``: wrap a model and optimizer, checkpoint without stopping training."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from .control_page import PAGE_BYTES, OwnedControlPage
from .errors import ConfigError
from .format.key_layout import GET_STATE_DICT
from .format.lease import RootLease
from .format.manifest import CheckpointInfo, name_style_for
from .format.signing import resolve_key
from .format.storage import CheckpointStore
from .loading import load
from .options import check_export_formats, check_optimizer_for_mode, check_options, check_stateful
from .protocol import WatchPreemptionRequest
from .restore_marks import take_restore_mark
from .train.autowindow import AUTO_WINDOW, DEFAULT_MAX_WINDOW, PhaseTimer, make_gap_timer
from .train.distributed import DistributedRun, is_distributed, set_up_distributed
from .train.engine import SnapshotEngine
from .train.layout import CheckpointScope, check_optimizer_matches_model
from .train.lineage import Lineage
from .train.optimizer_group import torch_optimizers
from .train.preemption import PreemptionGuard, default_grace_s
from .train.run_start import agreed_run_id, take_root_lease
from .train.step_hooks import unwrap_optimizer
from .train.transfer import Copier, make_copier
from .train.warnings_text import KEEP_STAGING_WARNING
from .train.writer_handle import WriterProcess
from .train.writer_link import DEFAULT_MAX_WRITER_RESTARTS, WriterLink

log = logging.getLogger("overlapckpt")


class _ExitOrderAnchor:
    pass


# atexit runs last-registered first. weakref registers its own exit hook (which runs the host
# buffers' finalizers: unmap, unregister) at its first finalizer; made here, at import, it is
# registered before any Checkpointer's exit commit, so it runs after it, never under it.
_EXIT_ORDER_ANCHOR = _ExitOrderAnchor()
weakref.finalize(_EXIT_ORDER_ANCHOR, lambda: None)


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
        store_class: a ``CheckpointStore`` subclass the writer process uses to reach storage.
        max_window: with ``window="auto"``, the widest window it may choose.
        keep_staging: accepted for compatibility; stage mode's staging region is now always kept
            (allocated once, outside the checkpoints' hooks: a region freed after each checkpoint was
            allocated again inside ``optimizer.step()``, where it could run out of memory or
            synchronize). ``False`` warns.
        copier: how bytes reach host memory (``overlapckpt.train.transfer``): by default a
            ``StreamCopier`` over the device (a side CUDA stream on GPU; on CPU the emulated device,
            whose side stream is a worker thread on a spare core); pass ``CpuCopier()`` to copy
            inside the hooks instead.
        phase_timer: with ``window="auto"``, what times forward+backward and the optimizer step
            (default: CUDA events on GPU, the host clock on CPU).
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
            were signalled, checkpoint it together and all exit with the signal (train/preemption.py).
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

    Host buffers are allocated on a background thread as soon as the state's size is known
    (here if the optimizer has state, else right after the first ``optimizer.step()``), so no
    checkpoint's hooks pay for allocating or pinning them.

    Call ``ckpt.step()`` at the end of each iteration (after ``scheduler.step()``): it is
    the boundary at which stateful objects and RNG states are captured.
    """

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
        max_inflight: int = 1,
        store_class: type[CheckpointStore] = CheckpointStore,
        max_window: int = DEFAULT_MAX_WINDOW,
        keep_staging: bool | None = None,
        copier: Copier | None = None,
        phase_timer: PhaseTimer | None = None,
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
    ) -> None:
        check_options(
            window=window,
            max_window=max_window,
            every=every,
            keep=keep,
            max_writer_restarts=max_writer_restarts,
            max_inflight=max_inflight,
            consistency=consistency,
            stage_budget_bytes=stage_budget_bytes,
            store_class=store_class,
            collective_timeout_s=collective_timeout_s,
            agreement_timeout_s=agreement_timeout_s,
            writer_threads=writer_threads,
            key_layout=key_layout,
        )
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model is a {type(model).__name__}; pass a torch.nn.Module")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigError(f"path={path!r} is invalid; pass the checkpoint root, a directory path or a URL such as s3://bucket/prefix")
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if on_meta:
            raise ConfigError(
                f"the model's {on_meta[:3]}{' ...' if len(on_meta) > 3 else ''} are on the meta device (no data to "
                "checkpoint): materialize the model first (model.to_empty(device=...) and initialize or load its "
                "weights), then build the Checkpointer"
            )
        # Accelerate's and Lightning's wrappers step the torch optimizer they hold: hook and replay that one.
        optimizer = unwrap_optimizer(optimizer)
        check_optimizer_matches_model(model, optimizer)
        check_optimizer_for_mode(optimizer, window, consistency)
        stateful = dict(stateful or {})
        check_stateful(stateful)
        check_export_formats(export_formats, path, process_group)
        self._signing_key = resolve_key(signing_key)
        self.path = os.fspath(path)
        self.storage_options = dict(storage_options or {})
        self._distributed: DistributedRun | None = None
        if is_distributed(process_group):
            settings = {
                "path": self.path,
                "window": window,
                "consistency": consistency,
                "every": every,
                "keep": keep,
                "max_inflight": max_inflight,
                "max_window": max_window,
                "stage_budget_bytes": stage_budget_bytes,
                "keep_staging": keep_staging,
                "stateful": sorted(stateful),
                "store_class": f"{store_class.__module__}.{store_class.__qualname__}",
                "copier": None if copier is None else type(copier).__qualname__,
                "key_layout": key_layout,
                # Agreed: the other ranks' writers wait for a replacement only if one may come.
                "max_writer_restarts": max_writer_restarts,
            }
            self._distributed = set_up_distributed(model, process_group, settings, collective_timeout_s, agreement_timeout_s)
        store = store_class(self.path, self.storage_options)
        store.prepare_root()
        self._store = store
        self._lineage = Lineage(agreed_run_id(self._distributed), names=name_style_for(key_layout, tuple(export_formats)), root=self.path)
        self._lease: RootLease | None = None
        self._lineage.note_existing(store.committed_names(), own=set())
        self._lineage_starts_at = 0  # the first of self.stats in the current lineage (see continued_from)
        self.model = model
        self.optimizer = optimizer
        self.stateful = stateful
        self.window = window
        self.consistency = consistency
        self.exit_timeout_s = float(exit_timeout_s)
        self._closed = False
        def start_writer(restarted: bool = False) -> WriterProcess:
            spec = None if self._distributed is None else self._distributed.writer_spec
            if spec is not None and restarted:
                # It opens the writers' next generation, and tells them which checkpoints this rank
                # had sent to the dead writer: they are lost on every rank.
                spec = dataclasses.replace(spec, restarted=True, lost_names=tuple(self._engine.dispatcher.sent_names()))
            return WriterProcess(
                self.path,
                self.storage_options,
                (store_class.__module__, store_class.__qualname__),
                group=spec,
                signing_key=self._signing_key,
                writer_threads=writer_threads,
            )

        grace_s = default_grace_s() if signal_grace_s is None else float(signal_grace_s)
        writer = start_writer()
        try:
            # Ready before the first request (in a distributed run: every rank's writer has joined the
            # writers' group). A writer still starting held the first checkpoint's slot for its start-up
            # (0.9-2 s, a fresh interpreter importing torch), and requests made meanwhile were merged.
            writer.wait_ready()
        except BaseException:
            writer.close()
            raise
        # A dead writer is replaced; in a distributed run its replacement re-forms the writers' group.
        link = WriterLink(writer, lambda: start_writer(restarted=True), max_writer_restarts, distributed=self._distributed is not None)
        self._preemption: PreemptionGuard | None = None
        self._control_page: OwnedControlPage | None = None
        if save_on_signal:
            if self._distributed is not None:
                # The ranks agree on the step through their writers (writer/preempt_watch.py), read
                # from this page at each boundary: no collective in a hook.
                page = self._control_page = OwnedControlPage()
                watch = WatchPreemptionRequest(nbytes=PAGE_BYTES, agreement_timeout_s=grace_s / 2, signals=tuple(save_on_signal))
                writer.send_with_fd(watch, page.fd)
                link.on_replaced(lambda new_writer: new_writer.send_with_fd(watch, page.fd))
            self._preemption = PreemptionGuard(
                tuple(save_on_signal),
                grace_s,
                self._save_now,
                page=self._control_page,
                current_step=lambda: self._engine.step_count,
            )
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        if keep_staging is False:
            warnings.warn(KEEP_STAGING_WARNING, DeprecationWarning, stacklevel=2)
        if window == AUTO_WINDOW and phase_timer is None:
            phase_timer = make_gap_timer(device)
        try:
            self._engine = SnapshotEngine(
                model,
                optimizer,
                window=window,
                consistency=consistency,
                every=every,
                keep=keep,
                stateful=stateful,
                link=link,
                max_inflight=max_inflight,
                stage_budget_bytes=stage_budget_bytes,
                max_window=max_window,
                copier=copier if copier is not None else make_copier(device),
                gap_timer=phase_timer if window == AUTO_WINDOW else None,
                scope=CheckpointScope() if self._distributed is None else self._distributed.scope,
                lineage=self._lineage,
                at_boundary=None if self._preemption is None else self._preemption.at_boundary,
                on_commit=on_commit,
                export_formats=tuple(export_formats),
                key_layout=key_layout,
            )
        except BaseException:
            link.close(timeout_s=30.0)  # nothing may outlive a constructor that raised
            if self._preemption is not None:
                self._preemption.uninstall()
            raise
        try:
            # Last: a refusal then tears down what was built, and nothing touched the root's checkpoints.
            self._lease = take_root_lease(store, self._lineage.run_id, self._distributed) if lease else None
            self._lineage.root_leased = self._lease is not None
        except BaseException:
            self._engine.shut_down(writer_timeout_s=30.0)
            if self._preemption is not None:
                self._preemption.uninstall()
            raise
        # Never closed: at interpreter exit, commit what is complete, say what was lost, release the lease.
        self._exit_commit = functools.partial(_commit_at_exit, weakref.ref(self))
        atexit.register(self._exit_commit)
        # Resumed with load(): continue that checkpoint's version count and lineage, as restore() does.
        resumed = take_restore_mark(model, optimizer, torch_optimizers(optimizer))
        if resumed is not None:
            same_root = self._store.checkpoint_url(os.path.basename(resumed.path.rstrip("/"))) == resumed.path
            self.continued_from(resumed if same_root else resumed.step)
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
            if self._engine.dead is not None:
                return []  # the death was raised already; nothing is left to finish
            return self._engine.wait(timeout_s)
        finally:
            self._tear_down(writer_timeout_s=30.0)

    def _tear_down(self, writer_timeout_s: float) -> None:
        """Remove the hooks, stop the writer, release host buffers (after the copies into them)."""
        exit_commit = getattr(self, "_exit_commit", None)
        if exit_commit is not None:
            atexit.unregister(exit_commit)
        self._engine.shut_down(writer_timeout_s)
        page: OwnedControlPage | None = getattr(self, "_control_page", None)
        if page is not None:
            page.buffer.release()  # after the writer, the page's other user, stopped
        if self._lease is not None:
            self._lease.release()

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
            if self._engine.dead is None:
                self._engine.abandon(self.exit_timeout_s)
        except Exception as e:  # never mask the exception that is unwinding
            warnings.warn(f"overlapckpt: closing after an error failed: {e}", stacklevel=3)
        finally:
            self._tear_down(writer_timeout_s=min(30.0, self.exit_timeout_s))

    # ---- inspection and restore ------------------------------------------------------

    @property
    def stats(self) -> list[dict[str, Any]]:
        """Per committed checkpoint: step, bytes, copy time, device-side waits, time to commit, ledger."""
        return [asdict(s) for s in self._engine.stats]

    @property
    def deferrals(self) -> int:
        """Requests that had to wait for a free host slot."""
        return self._engine.deferrals

    @property
    def step_count(self) -> int:
        """Optimizer steps taken, continued from the restored checkpoint after ``restore()``."""
        return self._engine.step_count

    @property
    def writer_pid(self) -> int:
        return self._engine.writer_pid

    @property
    def writer_restarts(self) -> int:
        """Times a dead writer process was replaced by a new one."""
        return self._engine.writer_restarts

    @property
    def snapshots_dropped(self) -> int:
        """Snapshots still being copied when their writer died (their requests may be made again)."""
        return self._engine.snapshots_dropped

    def restore(self, step: int | None = None) -> CheckpointInfo:
        """Load this Checkpointer's newest (or ``step``'s) checkpoint and continue its step count."""
        with self.steps_not_counted():
            info = load(
                self.path,
                self.model,
                self.optimizer,
                self.stateful,
                step,
                self.storage_options,
                process_group=self.process_group,
                signing_key=self._signing_key,
            )
        self.continued_from(info)
        return info

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
        self._engine.remove_hooks()
        try:
            yield
        finally:
            self._engine.install_hooks()

    def continued_from(self, info: CheckpointInfo | int) -> None:
        """The state now equals checkpoint ``info``, restored by a framework's own resume: continue from it.

        The next update makes version ``info.step + 1``; retention and ``latest`` treat
        this run as the one that continued from ``info`` (as after ``restore()``). An int
        is a version restored from elsewhere (a framework's own checkpoint): only the
        count continues.
        """
        self._check_open()
        if isinstance(info, int):
            self._engine.continue_from(info)
            return
        self._engine.continue_from(info.step)
        committed = self._store.committed_names()
        # This run's own checkpoints of its current lineage (a restore before starts a new one).
        own = {os.path.basename(s.path.rstrip("/")) for s in self._engine.stats[self._lineage_starts_at :] if s.path}
        run_before = self._lineage.run_id
        self._lineage.restored(os.path.basename(info.path.rstrip("/")), info.step, committed, own & set(committed))
        if self._lineage.run_id != run_before:
            self._lineage_starts_at = len(self._engine.stats)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed; create a new one to keep checkpointing")

    def _close_at_exit(self) -> None:
        """The interpreter exits with this Checkpointer open: commit what is complete, warn, release everything."""
        if self._closed:
            return
        open_windows = self._engine.unfinished_versions()
        dropped_before = self._engine.snapshots_dropped
        self._closed = True
        if self._preemption is not None:
            self._preemption.uninstall()
        committed: list[CheckpointInfo] = []
        try:
            if self._engine.dead is None:
                committed = self._engine.abandon(self.exit_timeout_s)
        finally:
            self._tear_down(writer_timeout_s=min(30.0, self.exit_timeout_s))
        lost = self._engine.snapshots_dropped - dropped_before
        if committed or lost:
            warnings.warn(
                f"overlapckpt: the Checkpointer of {self.path} was never closed. At interpreter exit "
                + (f"the checkpoint(s) of step(s) {[i.step for i in committed]} committed" if committed else "nothing committed")
                + (f"; {lost} still being copied (of {[v for v in open_windows if v is not None] or 'open windows'}) "
                   "were lost" if lost else "")
                + ". Call ckpt.close() at the end of training, or use `with Checkpointer(...) as ckpt:`",
                stacklevel=2,
            )


def _commit_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is not None:
        ckpt._close_at_exit()
