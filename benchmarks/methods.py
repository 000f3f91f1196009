"""The ways of checkpointing the benchmark compares, each as a user would write it.

Every method sees the same loop::

    forward_backward(); method.before_optimizer_step(); optimizer_step()
    if it is a checkpoint step: method.save(step)
    method.end_of_iteration()

and records, per checkpoint, the host time its calls blocked the loop and the
wall time from request to commit. Commit means the files are complete on disk.
"""

from __future__ import annotations

import inspect
import os
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from workload import Workload

from overlapckpt import Checkpointer
from overlapckpt.seams import engine_of


@dataclass
class CheckpointRecord:
    step: int  # the loop's iteration whose state was asked for
    requested_at_unix_s: float = field(default_factory=time.time)
    blocking_s: float = 0.0  # host time the loop spent inside this checkpoint's calls
    committed_at_unix_s: float | None = None  # UNIX time: the writer process reports it too
    nbytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def request_to_commit_s(self) -> float | None:
        if self.committed_at_unix_s is None:
            return None
        return self.committed_at_unix_s - self.requested_at_unix_s


class _Blocking:
    """Adds the host time spent inside a ``with`` block to a record's blocking time."""

    def __init__(self, record: CheckpointRecord) -> None:
        self.record = record

    def __enter__(self) -> None:
        self._started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.record.blocking_s += time.perf_counter() - self._started


class Method:
    name = "base"
    label = "no checkpoint"

    def __init__(self) -> None:
        self.records: list[CheckpointRecord] = []
        self.workload: Workload | None = None
        self.directory = ""
        self.notes: dict[str, Any] = {}

    def start(self, workload: Workload, directory: str) -> None:
        self.workload = workload
        self.directory = directory
        os.makedirs(directory, exist_ok=True)

    def before_optimizer_step(self) -> None:
        pass

    def after_optimizer_step(self) -> None:
        pass

    def save(self, step: int) -> None:
        pass

    def end_of_iteration(self) -> None:
        pass

    def drain(self, timeout_s: float) -> None:
        """Wait until every checkpoint so far has committed, and keep going."""

    def finish(self, timeout_s: float) -> None:
        """Wait until every checkpoint has committed, and stop (after the timed loop)."""
        self.drain(timeout_s)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

    def _state_dict(self) -> dict[str, Any]:
        assert self.workload is not None
        return {"model": self.workload.model.state_dict(), "optimizer": self.workload.optimizer.state_dict()}


class NoCheckpoint(Method):
    name = "baseline"
    label = "no checkpoint (baseline)"


class TorchSave(Method):
    name = "torch_save"
    label = "torch.save"

    def save(self, step: int) -> None:
        rec = CheckpointRecord(step=step)
        path = os.path.join(self.directory, "state.pt")
        with _Blocking(rec):
            torch.save(self._state_dict(), path + ".tmp")
            os.replace(path + ".tmp", path)
        rec.committed_at_unix_s = time.time()
        rec.nbytes = os.path.getsize(path)
        self.records.append(rec)


def _dcp_state_dict(workload: Workload) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(workload.model, workload.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


class DcpSave(Method):
    name = "dcp_save"
    label = "dcp.save"

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        rec = CheckpointRecord(step=step)
        target = os.path.join(self.directory, f"step-{step}")
        with _Blocking(rec):
            dcp.save(_dcp_state_dict(self.workload), checkpoint_id=target)
        rec.committed_at_unix_s = time.time()
        self.records.append(rec)
        _keep_newest(self.directory, target)


def _keep_newest(directory: str, newest: str) -> None:
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if path != newest and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def _stager_closes_itself() -> bool:
    """True where DefaultStager empties its stager after every stage (torch 2.11), so it cannot be reused."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager

        return "_state_dict_stager.close()" in inspect.getsource(DefaultStager._stage)
    except (ImportError, OSError, TypeError, AttributeError):
        return True  # unknown: a fresh stager per save is always correct


def async_save_features() -> dict[str, bool]:
    """What this torch's ``dcp.async_save`` offers (the GPU machine runs another version)."""
    import torch.distributed.checkpoint as dcp

    params = inspect.signature(dcp.async_save).parameters
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

        stager = True
    except ImportError:
        stager = False
    return {
        "async_checkpointer_type": "async_checkpointer_type" in params,
        "async_stager": "async_stager" in params,
        "default_stager": stager,
    }


class DcpAsyncSave(Method):
    """``dcp.async_save`` with the THREAD or PROCESS checkpointer.

    PROCESS uses pinned, shared-memory staging where this torch has ``DefaultStager``
    (pinned only with CUDA). With ``overlap_staging`` (CUDA only) staging runs in
    DCP's background thread and the loop waits for it before the next optimizer
    step: DCP's own way to overlap the copy with forward and backward.
    """

    # The stager type, where this torch has DefaultStager (None: DefaultStager itself). The
    # multi-rank benchmark puts a subclass here that counts the bytes each stage copies.
    stager_type: type | None = None

    def __init__(self, kind: str, overlap_staging: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.overlap_staging = overlap_staging
        self.name = f"dcp_async_{kind.lower()}" + ("_overlap" if overlap_staging else "")
        self.label = f"dcp.async_save {kind}" + (" + async staging" if overlap_staging else "")
        self._upload: Future | None = None
        self._staging: Future | None = None
        self._stager: Any = None
        self._options: Any = None
        self._stager_per_save = False

    def start(self, workload: Workload, directory: str) -> None:
        super().start(workload, directory)
        features = async_save_features()
        self.notes["features"] = features
        cuda = workload.device.type == "cuda"
        if self.kind == "PROCESS" and features["async_stager"] and features["default_stager"]:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            options = StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=cuda and self.overlap_staging,
                use_non_blocking_copy=cuda,
            )
            self._options = options
            # torch 2.11's DefaultStager closes its own cache after each stage, so the second
            # save through it fails; there, each save gets its own (which is what 2.11 costs).
            self._stager_per_save = _stager_closes_itself()
            self._stager = (self.stager_type or DefaultStager)(options)
            self.notes["stager_per_save"] = self._stager_per_save
            self.notes["staging"] = {
                "pinned": options.use_pinned_memory,
                "shared": options.use_shared_memory,
                "async": options.use_async_staging,
                "non_blocking": options.use_non_blocking_copy,
            }
        elif self.kind == "PROCESS":
            self.notes["staging"] = "this torch has no DefaultStager: default staging"

    def before_optimizer_step(self) -> None:
        if self._staging is not None:
            # The staged copy reads parameters and moments; the step must not change them first.
            with _Blocking(self.records[-1]):
                self._staging.result()
            self._staging = None

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        rec = CheckpointRecord(step=step)
        kwargs: dict[str, Any] = {"checkpoint_id": os.path.join(self.directory, f"step-{step}")}
        if self.notes["features"]["async_checkpointer_type"]:
            kwargs["async_checkpointer_type"] = getattr(AsyncCheckpointerType, self.kind)
        if self._stager is not None:
            if self._stager_per_save and self.records:
                from torch.distributed.checkpoint.staging import DefaultStager

                self._stager = (self.stager_type or DefaultStager)(self._options)
            kwargs["async_stager"] = self._stager
        with _Blocking(rec):
            if self._upload is not None:
                self._upload.result()  # one checkpoint in flight, as DCP's docs recommend
            if self.overlap_staging and self.workload.device.type == "cuda":
                # DCP's staging stream does not wait on the compute stream: without this the
                # background copy could read the state before the optimizer step wrote it.
                torch.cuda.current_stream().synchronize()
            response = dcp.async_save(_dcp_state_dict(self.workload), **kwargs)
        if hasattr(response, "upload_completion"):
            self._staging, upload = response.staging_completion, response.upload_completion
        else:
            upload = response
        target = kwargs["checkpoint_id"]

        stager = self._stager if self._stager_per_save else None

        def committed(_: Future, rec: CheckpointRecord = rec) -> None:
            if rec.committed_at_unix_s is None:
                rec.committed_at_unix_s = time.time()
            _keep_newest(self.directory, target)
            if stager is not None:
                stager.close()  # this save's own stager: its upload has read the staged copy

        upload.add_done_callback(committed)
        self._upload = upload
        self.records.append(rec)

    def drain(self, timeout_s: float) -> None:
        if self._staging is not None:
            self._staging.result(timeout=timeout_s)
            self._staging = None
        if self._upload is not None:
            self._upload.result(timeout=timeout_s)
            # Done-callbacks run after result() wakes this thread: the commit time is
            # set here when the callback has not run yet (it keeps an earlier one).
            last = self.records[-1]
            if last.committed_at_unix_s is None:
                last.committed_at_unix_s = time.time()

    def finish(self, timeout_s: float) -> None:
        self.drain(timeout_s)
        pinned = self._stager is not None and self.notes["staging"]["pinned"]
        # DCP's stager page-locks a copy of every tensor it stages (all but those under 5 bytes).
        self.notes["host_pinned_bytes"] = self.workload.state_nbytes() if pinned else 0

    def close(self) -> None:
        if self._stager is not None and not self._stager_per_save:
            self._stager.close()
        super().close()


class TorchCheckpointingAsync(Method):
    """torch_checkpointing's asynchronous saver, as TorchTitan 0.3 builds it (``peer_torch_checkpointing``).

    Its staging copies the state in a background thread under a read-write lock; the
    library asks the loop to run ``optimizer.step()`` under ``manager.lock()``, which
    waits only while a capture is in progress. That wait is this method's blocking time,
    with the ``save`` call and the wait for the previous write (one in flight, as for DCP).
    """

    name = "torch_checkpointing_async"
    label = "torch_checkpointing async"

    def __init__(self) -> None:
        super().__init__()
        self._peer: Any = None
        self._write: Future | None = None
        self._step_lock: Any = None

    def start(self, workload: Workload, directory: str) -> None:
        import peer_torch_checkpointing as peer

        super().start(workload, directory)
        self._peer = peer.TorchCheckpointingAsync(directory)
        self.notes["direct_io"] = self._peer.direct_io

    def before_optimizer_step(self) -> None:
        self._step_lock = self._peer.manager.lock()
        if self.records:
            with _Blocking(self.records[-1]):  # waits while the last save's capture runs
                self._step_lock.__enter__()
        else:
            self._step_lock.__enter__()

    def after_optimizer_step(self) -> None:
        self._step_lock.__exit__(None, None, None)
        self._step_lock = None

    def save(self, step: int) -> None:
        rec = CheckpointRecord(step=step)
        with _Blocking(rec):
            if self._write is not None:
                self._write.result()
            self._write = self._peer.start_save(self.workload.model, self.workload.optimizer, step)

        def committed(_: Future, rec: CheckpointRecord = rec) -> None:
            if rec.committed_at_unix_s is None:
                rec.committed_at_unix_s = time.time()

        self._write.add_done_callback(committed)
        self.records.append(rec)

    def drain(self, timeout_s: float) -> None:
        if self._write is not None:
            self._write.result(timeout=timeout_s)
            last = self.records[-1]
            if last.committed_at_unix_s is None:  # the done-callback may not have run yet
                last.committed_at_unix_s = time.time()

    def close(self) -> None:
        if self._peer is not None:
            self._peer.close()
        super().close()


def torch_checkpointing_unavailable() -> str | None:
    """None if torch_checkpointing's asynchronous saver can run here, else why not."""
    try:
        import peer_torch_checkpointing as peer
    except ImportError as error:
        return f"benchmarks/peer_torch_checkpointing.py did not import: {error}"
    return peer.available()


class Overlapckpt(Method):
    def __init__(self, window: int | str, consistency: str = "replay") -> None:
        super().__init__()
        self.window = window
        self.consistency = consistency
        if window == 1:
            self.name, self.label = "overlapckpt_w1", "overlapckpt window=1"
        else:
            self.name = f"overlapckpt_w{window}_{consistency}"
            self.label = f"overlapckpt window={window} {consistency}"
        self.ckpt: Checkpointer | None = None

    def start(self, workload: Workload, directory: str) -> None:
        super().start(workload, directory)
        started = time.perf_counter()
        self.ckpt = Checkpointer(
            workload.model, workload.optimizer, directory, window=self.window, consistency=self.consistency, keep=1
        )
        # Outside the loop: what allocating (or starting to allocate) off the hooks costs up front.
        self.notes["construct_s"] = time.perf_counter() - started

    def save(self, step: int) -> None:
        rec = CheckpointRecord(step=step)
        rec.extra["engine_step"] = self.ckpt.step_count
        with _Blocking(rec):
            self.ckpt.request()
        self.records.append(rec)

    def end_of_iteration(self) -> None:
        self.ckpt.step()

    def drain(self, timeout_s: float) -> None:
        self.ckpt.wait(timeout_s=timeout_s)

    def finish(self, timeout_s: float) -> None:
        engine = engine_of(self.ckpt)
        host_bytes = engine.parts.slots.host_nbytes()
        self.notes["host_buffer_bytes"] = host_bytes
        # The emulated device registers host memory as CUDA would, but locks no page.
        self.notes["host_pinned_bytes"] = host_bytes if getattr(engine.parts.copier.device, "locks_pages", False) else 0
        self.ckpt.close(timeout_s=timeout_s)
        # A request is answered by the first snapshot started at or after it (a request
        # that had to wait for a free slot starts later, and may answer a later one too).
        stats_by_start = sorted(self.ckpt.stats, key=lambda s: s["requested_step"])
        # Per checkpoint, in order: the first is the warm-up's, which pays any one-time cost
        # left in the hooks (allocating, pinning); the report sets it against the later ones.
        self.notes["hook_host_s_by_checkpoint"] = [s["hook_host_s"] for s in stats_by_start]
        charged: set[int] = set()
        for rec in self.records:
            stats = next((s for s in stats_by_start if s["requested_step"] >= rec.extra["engine_step"]), None)
            if stats is None:
                continue
            rec.committed_at_unix_s = stats["committed_at_unix_s"]
            rec.nbytes = stats["nbytes"]
            if id(stats) not in charged:  # the hooks' host time belongs to the loop's blocking time too
                rec.blocking_s += stats["hook_host_s"]
                rec.extra["hook_host_s"] = stats["hook_host_s"]
                charged.add(id(stats))
            rec.extra.update(
                version=stats["step"],
                window=stats["window"],
                copy_s=stats["copy_s"],
                copied_nbytes=stats["copied_nbytes"],
                device_waits_in_flight=stats["device_waits_in_flight"],
                deferred=stats["deferred"],
                persist_s=stats.get("persist_s"),
            )
        self.notes["deferrals"] = self.ckpt.deferrals

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close(timeout_s=60)
        super().close()


def all_methods(cuda: bool, windows: tuple[int, ...] = (2, 4, 8)) -> list[Method]:
    methods: list[Method] = [
        NoCheckpoint(),
        TorchSave(),
        DcpSave(),
        DcpAsyncSave("THREAD"),
        DcpAsyncSave("PROCESS"),
    ]
    if cuda:
        methods.append(DcpAsyncSave("PROCESS", overlap_staging=True))
    if torch_checkpointing_unavailable() is None:
        methods.append(TorchCheckpointingAsync())
    methods.append(Overlapckpt(1))
    for mode in ("replay", "stage"):
        methods += [Overlapckpt(w, mode) for w in windows]
    return methods
