"""The writer process: maps the shared host slots and persists snapshots in DCP format.

It is started by :class:`overlapckpt.writer.WriterProcess` with
``python -m overlapckpt.writer_process FD`` and serves requests until it gets
``ShutdownRequest`` or the pipe closes (the training process exited). Every
failure is sent back as an ``ErrorResponse`` carrying the original exception; the
process keeps serving, so one failed write does not lose the next checkpoint.
"""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection
from typing import Any

import torch

from . import protocol as p
from .errors import OverlapCkptError
from .hostbuf import map_shared_file, view_bytes
from .manifest import FORMAT_VERSION, CheckpointInfo, dump_manifest, tensor_crc32
from .state import TensorEntry, build_state_dict
from .storage import CheckpointStore


class CheckpointExistsError(OverlapCkptError):
    """A committed checkpoint of the same version already exists; it is never overwritten."""


class _WriterState:
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.slots: dict[int, torch.Tensor] = {}
        self.layouts: dict[int, tuple[list[TensorEntry], tuple[int, ...]]] = {}

    def persist(self, req: p.PersistRequest) -> p.CommittedResponse:
        started = time.perf_counter()
        entries, offsets = self.layouts[req.layout_id]
        slot = self.slots[req.slot_id]
        tensors = [view_bytes(slot, off, e.dtype, e.shape) for e, off in zip(entries, offsets)]
        if req.replay is not None:
            from .replay import replay_to_version

            replay_to_version(entries, tensors, req.replay, self.slots[req.replay.grad_slot_id])
        items = {
            e.key: {"crc32": tensor_crc32(t), "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape)}
            for e, t in zip(entries, tensors)
        }
        from .extra_state import encode

        manifest = {
            "format_version": FORMAT_VERSION,
            "step": req.step,
            "requested_step": req.requested_step,
            "mode": req.mode,
            "window": req.window,
            "torch_version": torch.__version__,
            "created_at": time.time(),
            "nbytes": sum(e.nbytes for e in entries),
            "items": items,
            "extra_state": encode(req.extra_state, "extra_state"),
            "extra_state_index": sorted(req.extra_state.keys()),
            "ledger": req.ledger,
            "stats": req.stats,
        }
        store = self.store
        if store.is_committed(req.name):
            raise CheckpointExistsError(
                f"checkpoint {store.checkpoint_url(req.name)} is already committed; overlapckpt never "
                "overwrites a committed checkpoint: use a new path, or delete it first"
            )
        store.clear_uncommitted(req.name)
        state_dict = build_state_dict(entries, tensors, req.small_state)

        def write_manifest() -> None:
            manifest["created_at"] = time.time()
            store.write_manifest(req.name, dump_manifest(manifest))

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            # no_dist=True is deliberate: each writer saves its own process's snapshot.
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(state_dict, storage_writer=store.make_writer(req.name, before_commit=write_manifest), no_dist=True)
        store.write_latest(req.name)
        removed: list[str] = []
        if req.keep is not None:
            committed = store.committed_names()
            for old in committed[: max(0, len(committed) - req.keep)]:
                store.remove_checkpoint(old)
                removed.append(old)
        info = CheckpointInfo.from_manifest(manifest, store.checkpoint_url(req.name))
        return p.CommittedResponse(
            request_id=req.request_id,
            info=info,
            committed_at=time.time(),
            persist_s=time.perf_counter() - started,
            removed=removed,
        )


def _root_cause(e: BaseException) -> BaseException:
    """DCP wraps storage errors in CheckpointException (a BaseException) per rank: unwrap them."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return _root_cause(inner[0])
    return e


def _error_response(request_id: int | None, e: BaseException) -> p.ErrorResponse:
    e = _root_cause(e)
    exc: BaseException | None = e
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # an exception type that does not pickle travels as text only
        exc = None
    return p.ErrorResponse(
        request_id=request_id,
        exception=exc,
        type_name=f"{type(e).__module__}.{type(e).__qualname__}",
        message=str(e),
        traceback_text="".join(traceback.format_exception(e)),
    )


def _load_store(init: p.InitRequest) -> CheckpointStore:
    module_name, qualname = init.store_class
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj(init.root, init.storage_options)


def _send(conn: Connection, response: object) -> None:
    conn.send_bytes(pickle.dumps(response, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


def serve(conn: Connection) -> None:
    init = _recv(conn)
    try:
        if not isinstance(init, p.InitRequest):
            raise TypeError(f"the first request must be InitRequest, got {type(init).__name__}")
        sys.path[:] = init.sys_path
        state = _WriterState(_load_store(init))
    except BaseException as e:
        _send(conn, _error_response(None, e))
        return
    _send(conn, p.ReadyResponse(pid=os.getpid()))
    while True:
        try:
            req = _recv(conn)
        except EOFError:  # the training process is gone: nothing left to serve
            return
        request_id = getattr(req, "request_id", None)
        try:
            if isinstance(req, p.ShutdownRequest):
                return
            if isinstance(req, p.MapSlotRequest):
                state.slots[req.slot_id] = map_shared_file(req.path, req.nbytes)
                _send(conn, p.MappedResponse(slot_id=req.slot_id))
            elif isinstance(req, p.ReleaseSlotRequest):
                state.slots.pop(req.slot_id, None)
            elif isinstance(req, p.SetLayoutRequest):
                state.layouts[req.layout_id] = (req.entries, req.offsets)
            elif isinstance(req, p.PersistRequest):
                _send(conn, state.persist(req))
            else:
                raise TypeError(f"unknown request {type(req).__name__}")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException derives from BaseException
            _send(conn, _error_response(request_id, e))


# The writer is background work: a lower priority lets the training process's
# threads take a core back the moment they need it. Without it, on a 2-core machine,
# the writer's checksums and serialization stalled training steps by 0.4-0.9 s
# (benchmarks/, tiny size); the commit takes longer instead, which costs nothing.
WRITER_NICE_INCREMENT = 10
# Replay and checksums use at most a quarter of the cores this process may run on
# (1 to 4 threads), leaving the rest to training and its data loaders.
WRITER_MAX_THREADS = 4


def writer_thread_count() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(WRITER_MAX_THREADS, cores // 4))


def main(argv: list[str]) -> None:
    fd = int(argv[1])
    try:
        os.nice(WRITER_NICE_INCREMENT)
    except OSError:
        pass  # not permitted here: run at the training process's priority
    torch.set_num_threads(writer_thread_count())
    conn = Connection(fd)
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main(sys.argv)
