"""The writer process: maps the shared host slots and persists snapshots in DCP format.

It is started by :class:`overlapckpt.train.writer_client.client.WriterClient` (``python -I``,
its own session, a lifeline to the trainer; see there) and serves requests until it gets
``ShutdownRequest`` or the pipe closes (the training process exited). Every
failure is sent back as an ``ErrorResponse`` carrying the original exception; the
process keeps serving, so one failed write does not lose the next checkpoint.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import socket
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection

import torch

from .. import protocol as p
from ..control_page import ControlPage
from ..cores import usable_cores
from ..errors import ForgedStoreValueError, WritersRegroupedError
from ..format import tensor_blob
from ..format.storage import CheckpointStore, dcp_root_cause
from ..format.tiers import LOCAL_TIER, ROOT_TIER, tier_store
from ..hostbuf import fd_path, map_shared_file
from ..qualname import import_qualified
from .group import WriterGroup
from .persist import persist_snapshot
from .persist_context import PersistContext
from .preempt_watch import PreemptionWatch
from .replay import warm_up
from .replicas import fetch_into_tier
from .slot_views import SlotViews
from .store_polling import IDLE_POLL_S, IDLE_REQUESTS_PER_POLL, poll_interval_s

# What a store request raises when the store cannot be reached (DistNetworkError, DistStoreError,
# and before torch 2.3 a bare RuntimeError), or a sealed counter was forged.
_STORE_ERRORS = (RuntimeError, OSError, ForgedStoreValueError)

logger = logging.getLogger("overlapckpt")


class _WriterState:
    def __init__(
        self,
        store: CheckpointStore,
        group: WriterGroup | None,
        signing_key: bytes | None = None,
        threads: int = 1,
        local_store: CheckpointStore | None = None,
    ) -> None:
        self.signing_key = signing_key
        self.threads = threads
        self.store = store
        self.local_store = local_store  # the node-local tier, if the run has one
        self.group = group
        self.buffers: dict[int, torch.Tensor] = {}
        self.preemption: PreemptionWatch | None = None
        self.control_page: torch.Tensor | None = None  # the mapping the watch reads and writes
        self.plans: dict[int, p.SetPlanRequest] = {}
        self.views = SlotViews()  # each slot's tensors, made at its first persist

    def persist(self, req: p.PersistRequest, conn: Connection, purge_later: list[tuple[CheckpointStore, str]]) -> p.CommittedResponse:
        plan = self.plans[req.plan_id]
        ctx = PersistContext(self.tier_stores(), self.group, self.buffers, self.signing_key, self.threads, self.preempting, self.views)
        return persist_snapshot(
            ctx, plan, req, on_replay=lambda finished: _send(conn, p.ReplayProgressNotice(req.request_id, finished)), purge_later=purge_later
        )

    def preempting(self) -> bool:
        """A preemption is under way: the replicas of its checkpoint go at full speed (replicas.py)."""
        return self.preemption is not None and self.preemption.under_way()

    def tier_stores(self) -> dict[str, CheckpointStore]:
        stores = {ROOT_TIER: self.store}
        if self.local_store is not None:
            stores[LOCAL_TIER] = self.local_store
        return stores


def _error_response(request_id: int | None, e: BaseException) -> p.ErrorResponse:
    e = dcp_root_cause(e)
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


# The collector's third threshold during a persist: more collections of the middle
# generation than any persist makes, so no full collection starts.
NO_FULL_COLLECTION_THRESHOLD = 1 << 30


@contextmanager
def _full_collections_paused() -> Iterator[None]:
    """No full collection by Python's cyclic garbage collector from a persist's start to its answer.

    A persist allocates an object or more per tensor (views, DCP's write items and plans,
    blobs, manifest records), and each full collection walks every live object: at 30,000
    tensors they took 1.1-1.9 s of a 4.1-4.9 s DCP save (in-process, 2-core VM). The young
    generations are still collected, and they walk only what is new: the cycles a persist
    leaves (each real torch.save leaves one, about 2.6 KB) are freed as it goes.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTION_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def _persist(conn: Connection, state: _WriterState, req: p.PersistRequest) -> None:
    """Persist and answer; in a distributed run, through a replacement of some rank's writer.

    A checkpoint still being agreed on when the group moves has written nothing: it is
    agreed on again in the new group, unless the replaced rank lost it (it had sent it to
    the dead writer). One whose collectives the dead writer broke is lost on every rank.
    """
    group = state.group
    while True:
        if group is not None and group.was_lost(req.name):
            _send(conn, _error_response(req.request_id, _lost(req.name, group.generation, "the replaced writer's rank lost it")))
            return
        purge_later: list[tuple[CheckpointStore, str]] = []
        lost_because: str | None = None
        try:
            with _full_collections_paused():
                _send(conn, state.persist(req, conn, purge_later))
            return
        except BaseException as e:
            cause = dcp_root_cause(e)
            if group is None:
                raise
            if not isinstance(cause, WritersRegroupedError):  # moved while agreeing: nothing is written yet
                if not group.regroups_after(cause):
                    raise
                group.mark_lost(req.name)  # before regrouping: the replacement refuses it too
                lost_because = f"{type(e).__name__}: {e}"
            # ``cause`` outlives the except block (``e`` does not): its traceback holds the
            # frames that hold the old group. Dropped, the group is freed in regroup() below.
            del cause
        finally:
            # Retired before the answer (uncommitted, out of the listing), deleted now, whatever
            # happened after: unlinking them is not the commit's time, and never skipped.
            _purge(purge_later)
        # Out of the except block: the old group's exception is gone, so regroup() frees the
        # old group and its connections close at once (group.py, regroup).
        group.regroup()
        if lost_because is None:
            continue  # agreed again in the new group
        _send(conn, _error_response(req.request_id, _lost(req.name, group.generation, lost_because)))
        return


def _purge(retired: list[tuple[CheckpointStore, str]]) -> None:
    for store, leftover in retired:
        try:
            store.purge_retired(leftover)
        except Exception as e:  # noqa: BLE001 - uncommitted already: only space is lost, until the next sweep
            logger.warning("overlapckpt: deleting %s, retired by retention, failed: %s: %s", leftover, type(e).__name__, e)


def _map_sent_memory(fd_sock: socket.socket, nbytes: int) -> torch.Tensor:
    """Map the shared memory whose descriptor follows the request on the socket (SCM_RIGHTS)."""
    _, fds, _, _ = socket.recv_fds(fd_sock, 1, 1)
    try:
        return map_shared_file(fd_path(fds[0]), nbytes)
    finally:
        for fd in fds:
            os.close(fd)  # the mapping keeps the memory


def _lost(name: str, generation: int, cause: str) -> WritersRegroupedError:
    return WritersRegroupedError(
        f"checkpoint {name} was lost: a writer of the run died while it was in flight and was replaced (the "
        f"writers' group is now generation {generation}); nothing of it is listed, and the next checkpoint commits "
        f"on every rank. The cause: {cause}"
    )


def _load_store(init: p.InitRequest) -> CheckpointStore:
    store_class: type[CheckpointStore] = import_qualified(*init.store_class)
    return store_class(init.root, init.storage_options)


def _send(conn: Connection, response: object) -> None:
    conn.send_bytes(pickle.dumps(response, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> object:
    return pickle.loads(conn.recv_bytes())


def serve(conn: Connection, fd_sock: socket.socket) -> None:
    init = _recv(conn)
    try:
        if not isinstance(init, p.InitRequest):
            raise TypeError(f"the first request must be InitRequest, got {type(init).__name__}")
        sys.path[:] = init.sys_path
        # Joining the writers' group blocks until every rank's writer has joined (or times out).
        group = WriterGroup(init.group) if init.group is not None else None
        threads = init.writer_threads or writer_thread_count()
        torch.set_num_threads(threads)  # the replay's optimizer kernels
        # The local tier is a directory of this node: the plain store, whatever the root's class.
        local_store = None if init.local_root is None else tier_store(init.local_root)
        state = _WriterState(_load_store(init), group, init.signing_key, threads, local_store)
    except BaseException as e:
        _send(conn, _error_response(None, e))
        return
    if init.replay_expected:
        # Before Ready, so before the Checkpointer's constructor returns: after it, a first replay
        # checkpoint soon after the start waited for the rest (198 ms median against 49 here,
        # benchmarks/results/small-checkpoint/). Runs that never replay (window 1, stage) skip it.
        try:
            warm_up()
        except Exception:  # noqa: BLE001 - a failure here is the first replay's to report, with its checkpoint
            logger.exception("warming replay up failed; the first replay checkpoint pays its imports")
    _send(conn, p.ReadyResponse(pid=os.getpid()))
    try:
        _serve_requests(conn, fd_sock, state)
    finally:
        if state.group is not None:
            state.group.close()


def idle_poll(conn: Connection, group: WriterGroup) -> None:
    """An idle writer of a distributed run: follow a replaced writer into its group, refuse unmatched claims.

    A store error here is no checkpoint's failure: it is logged and the next poll connects
    again. Uncaught, it ended the writer, and with it both ranks (exit 1), when another
    client of the store poisoned a counter the writers read.
    """
    try:
        if group.generation_moved():
            group.regroup()  # another rank's writer was replaced: follow it into the new group
            return
        # Has another rank claimed a checkpoint this one has not?
        mismatch = group.missing_claim()
    except _STORE_ERRORS as e:
        logger.warning("overlapckpt: the writer of rank %d lost the job's store while idle (%s: %s); reconnecting", group.rank, type(e).__name__, e)
        try:
            group.reconnect()
        except _STORE_ERRORS as again:
            logger.warning("overlapckpt: reconnecting to the job's store failed (%s); trying again at the next poll", again)
        return
    if mismatch is not None:
        _send(conn, _error_response(None, mismatch))


def _serve_requests(conn: Connection, fd_sock: socket.socket, state: _WriterState) -> None:
    while True:
        try:
            # An idle writer of a distributed run looks for a new generation and other ranks' claims this
            # often: every half second, less often past the world size the store's server can take.
            group = state.group
            if group is not None and not conn.poll(poll_interval_s(group.world_size, IDLE_POLL_S, IDLE_REQUESTS_PER_POLL)):
                idle_poll(conn, group)
                continue
            req = _recv(conn)
        except (EOFError, ConnectionResetError):  # the training process is gone: nothing left to serve
            return
        request_id = getattr(req, "request_id", None)
        try:
            if isinstance(req, p.ShutdownRequest):
                return
            if isinstance(req, p.MapBufferRequest):
                state.views.forget_buffer(req.buffer_id)  # a slot mapped again under its id: the old mapping's views go
                state.buffers[req.buffer_id] = _map_sent_memory(fd_sock, req.nbytes)
                _send(conn, p.MappedResponse(buffer_id=req.buffer_id))
            elif isinstance(req, p.WatchPreemptionRequest):
                state.control_page = _map_sent_memory(fd_sock, req.nbytes)
                if state.group is None:
                    raise TypeError("WatchPreemptionRequest is for the writers of a distributed run")
                page = ControlPage(state.control_page.data_ptr())
                state.preemption = PreemptionWatch(page, state.group.spec, req.agreement_timeout_s, req.signals)
            elif isinstance(req, p.ReleaseBufferRequest):
                state.views.forget_buffer(req.buffer_id)
                state.buffers.pop(req.buffer_id, None)
            elif isinstance(req, p.SetPlanRequest):
                state.views.forget_plan(req.plan_id)
                state.plans[req.plan_id] = req
            elif isinstance(req, p.PersistRequest):
                _persist(conn, state, req)
            elif isinstance(req, p.FetchFilesRequest):
                if state.group is None or state.local_store is None:
                    raise TypeError("FetchFilesRequest is for the writers of a distributed run with a local tier")
                received = fetch_into_tier(state.group, state.local_store, req.name, req.copies, req.run_id)
                _send(conn, p.FetchedResponse(request_id=req.request_id, nbytes=received))
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
# The writer's default threads (Checkpointer(writer_threads=) overrides it): at most a
# quarter of the cores this process may run on (1 to 4), leaving the rest to training
# and its data loaders. They run the replay's optimizer kernels, and DCP writes one
# shard file per thread. Measured (benchmarks/durable.py --writer-threads, 768 MiB on
# the 2-core machine): see docs/benchmarks.md; on 2 cores the default is 1.
WRITER_MAX_THREADS = 4


def writer_thread_count() -> int:
    return max(1, min(WRITER_MAX_THREADS, usable_cores() // 4))


def _exit_with_the_trainer(lifeline_fd: int) -> None:
    """Exit when the training process dies: its lifeline pipe's write end closes, and this read sees EOF.

    An idle writer also notices a dead trainer by EOF on its request pipe, but one
    blocked inside a storage write (a hung NFS or S3 call) never reads that pipe again;
    this thread does nothing but wait for the EOF. It follows the training *process*:
    the pipe closes only when every descriptor of it in the trainer is gone.
    """

    def watch() -> None:
        while True:
            try:
                if os.read(lifeline_fd, 1) == b"":
                    os._exit(0)  # nothing to flush: uncommitted work is garbage by design
            except InterruptedError:
                continue
            except OSError:
                os._exit(0)

    threading.Thread(target=watch, name="overlapckpt-lifeline", daemon=True).start()


def _serialize_for_our_checksums() -> None:
    """torch.save's own zip CRC-32 per record off: redundant here, every stored byte has our checksum (format/blobsums.py).

    It was 41 of torch.save's 98 ms per 96 MiB on one core. Files written without it load
    with torch.load and stock dcp.load alike (torch >= 2.4 has the switch; older ones keep it).
    """
    set_crc32_options = getattr(torch.serialization, "set_crc32_options", None)
    if set_crc32_options is not None:
        set_crc32_options(False)
    # Without the CRCs a small tensor's blob is a fixed frame around its bytes: written from
    # a template, checked against torch.save's own output first (format/tensor_blob.py).
    # OVERLAPCKPT_TENSOR_TEMPLATES=0 leaves every blob to torch.save (the benchmark's "before").
    if os.environ.get("OVERLAPCKPT_TENSOR_TEMPLATES", "1") != "0":
        tensor_blob.install()


def main(argv: list[str]) -> None:
    """``argv``: [package dir, request socket fd, lifeline fd] (see ``train/writer_client/launcher.py``: the bootstrap, or the fork server)."""
    fd = int(argv[1])
    _exit_with_the_trainer(int(argv[2]))
    try:
        os.nice(WRITER_NICE_INCREMENT)
    except OSError:
        pass  # not permitted here: run at the training process's priority
    torch.set_num_threads(1)  # until InitRequest says how many (serve)
    _serialize_for_our_checksums()
    # The host buffers' descriptors arrive as ancillary data on the same socket.
    fd_sock = socket.socket(fileno=os.dup(fd))
    conn = Connection(fd)
    try:
        serve(conn, fd_sock)
    finally:
        conn.close()
        fd_sock.close()


if __name__ == "__main__":
    raise SystemExit("the writer process is started by overlapckpt's WriterClient, not run directly")
