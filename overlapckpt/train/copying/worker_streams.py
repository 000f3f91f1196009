"""Streams on the CPU: in-order queues run by worker threads, with CUDA's stream and event semantics.

What both CPU backends of the copier share (``cpu_device.py``, the plain one CPU training
runs, and ``emulated_device.py``, the tests' adversarial CUDA model):

* **Streams** run asynchronously on worker threads (one per stream), in order, with
  CUDA's ``record``/``wait_event``/``wait_stream`` semantics. The stream that is current
  when nothing else is (the one training runs on, here the host itself) is synchronous:
  a device-side wait on it blocks the host until the event, which is what CUDA's
  compute stream would do to the kernels queued after the wait.
* **Schedules.** ``"async"``: a worker runs each op as soon as it can. ``"held"`` (the
  adversarial one, for tests): an op runs only once something waits for an event after
  it (a fence, a synchronize), the latest moment a real stream could run it. ``"eager"``:
  an op runs as it is queued, the earliest moment.
* **Errors** are sticky, as a CUDA error is: raised at the next query or synchronization.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ...errors import CopyStreamStuckError

SCHEDULES = ("async", "held", "eager")
# A wait longer than this means a stream is stuck (its worker died, or a wait can never end).
STREAM_STUCK_S = 600.0


class WorkerEvent:
    """A point in one stream's queue: done once every op queued before it has run."""

    def __init__(self, stream: WorkerStream, seq: int) -> None:
        self.stream = stream
        self.seq = seq
        self.time_s: float | None = None  # when the stream reached it

    def query(self) -> bool:
        return self.stream.done_through(self.seq)


@dataclass(eq=False)
class _Op:
    seq: int
    run: Callable[[], object]
    host_ranges: tuple[tuple[int, int], ...]  # host memory the op writes: (address, bytes)


class WorkerStream:
    """An in-order queue of ops; the host's own stream runs them at once, others on a worker."""

    def __init__(self, name: str, schedule: str, synchronous: bool = False) -> None:
        self.name = name
        self.synchronous = synchronous
        self.schedule = "eager" if synchronous else schedule
        self._cv = threading.Condition()
        self._ops: collections.deque[_Op] = collections.deque()
        self._running: _Op | None = None
        self._next_seq = 0
        self._done_seq = -1
        self._released_seq = -1  # "held": ops up to here may run
        self.error: BaseException | None = None  # sticky, as a CUDA error is
        self._worker: threading.Thread | None = None
        self._closing = False
        self._closed = False  # after close(), ops run on the caller (a late free's poison, say)
        self._inline = threading.RLock()  # eager ops run one at a time, in order (an op may queue another)

    def enqueue(self, run: Callable[[], object], host_ranges: tuple[tuple[int, int], ...] = ()) -> int:
        with self._inline:
            with self._cv:
                seq = self._next_seq
                self._next_seq += 1
                op = _Op(seq, run, host_ranges)
                if self.schedule != "eager" and not self._closed:
                    self._ops.append(op)
                    self._ensure_worker()
                    self._cv.notify_all()
                    return seq
            # Eager: in order, on the calling thread (nothing is ever queued ahead of it).
            self._execute(op)
            return seq

    def done_through(self, seq: int) -> bool:
        with self._cv:
            return self._done_seq >= seq

    def release_through(self, seq: int) -> None:
        """The held schedule: ops up to ``seq`` may run now (someone waits for them)."""
        with self._cv:
            if seq > self._released_seq:
                self._released_seq = seq
                self._cv.notify_all()

    def wait_through(self, seq: int, timeout_s: float = STREAM_STUCK_S) -> None:
        self.release_through(seq)
        with self._cv:
            if not self._cv.wait_for(lambda: self._done_seq >= seq, timeout=timeout_s):
                raise CopyStreamStuckError(
                    f"stream {self.name!r} did not reach op {seq} within {timeout_s} s "
                    f"(done through {self._done_seq}); its worker is stuck"
                )

    def wait_done(self, seq: int, timeout_s: float) -> bool:
        """Whether op ``seq`` ran within ``timeout_s``; releases nothing (a watcher must not hurry the held schedule)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._done_seq >= seq, timeout=timeout_s)

    def last_seq(self) -> int:
        with self._cv:
            return self._next_seq - 1

    def pending_host_ranges(self) -> list[tuple[int, int]]:
        with self._cv:
            ops = list(self._ops) + ([self._running] if self._running is not None else [])
        return [r for op in ops for r in op.host_ranges]

    def close(self) -> None:
        with self._cv:
            worker, self._worker = self._worker, None
            self._closed = True
            if worker is None:
                return
            self._released_seq = self._next_seq
            self._closing = True
            self._cv.notify_all()
        worker.join(timeout=STREAM_STUCK_S)

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._closing = False
            # A daemon, joined by close(): a script that never closes its Checkpointer still exits.
            self._worker = threading.Thread(target=self._work, name=f"overlapckpt-stream-{self.name}", daemon=True)
            self._worker.start()

    def _runnable(self) -> bool:
        if not self._ops:
            return self._closing
        return self.schedule == "async" or self._ops[0].seq <= self._released_seq

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._runnable)
                if not self._ops:
                    return
                op = self._ops.popleft()
                self._running = op
            self._execute(op)

    def _execute(self, op: _Op) -> None:
        try:
            if self.error is None:
                with torch.no_grad():
                    op.run()
        except BaseException as e:  # raised at the next query or synchronize, as CUDA reports a failed kernel
            self.error = e
        with self._cv:
            self._running = None
            self._done_seq = max(self._done_seq, op.seq)
            self._cv.notify_all()


class WorkerStreams:
    """The stream and event calls of a ``StreamDevice`` (``device.py``), on worker streams.

    A subclass sets ``schedule`` and calls ``__init__``; it may refine ``_host_sync`` and
    ``_runtime_call``.
    """

    def __init__(self, schedule: str) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is invalid; use one of {SCHEDULES}")
        self.schedule = schedule
        self.host_stream = WorkerStream("host", schedule, synchronous=True)
        self._streams: list[WorkerStream] = []
        self._local = threading.local()

    def new_stream(self, schedule: str | None = None) -> WorkerStream:
        self._runtime_call()
        stream = WorkerStream(f"stream-{len(self._streams) + 1}", schedule or self.schedule)
        self._streams.append(stream)
        return stream

    def current_stream(self) -> WorkerStream:
        return getattr(self._local, "stream", None) or self.host_stream

    @contextlib.contextmanager
    def stream_context(self, stream: WorkerStream) -> Iterator[WorkerStream]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def record_event(self, stream: WorkerStream) -> WorkerEvent:
        event = WorkerEvent(stream, -1)

        def mark() -> None:
            event.time_s = time.perf_counter()

        event.seq = stream.enqueue(mark)  # nothing queries the event before it is returned
        return event

    def wait_event(self, stream: WorkerStream, event: WorkerEvent) -> None:
        if event.query():
            return
        if stream.synchronous:
            # What follows on this stream is the host's own work: it waits here.
            event.stream.wait_through(event.seq)
            return
        stream.enqueue(lambda: event.stream.wait_through(event.seq))

    def wait_stream(self, waiter: WorkerStream, waitee: WorkerStream) -> None:
        if waitee.synchronous:
            return  # everything queued on the host's stream has already run
        self.wait_event(waiter, self.record_event(waitee))

    def event_done(self, event: WorkerEvent) -> bool:
        done = event.query()
        if done and event.stream.error is not None:
            raise event.stream.error
        return done

    def synchronize_event(self, event: WorkerEvent) -> None:
        self._host_sync("synchronize an event")
        event.stream.wait_through(event.seq)
        if event.stream.error is not None:
            raise event.stream.error

    def await_event(self, event: WorkerEvent, timeout_s: float) -> bool:
        return event.stream.wait_done(event.seq, timeout_s)

    def synchronize_stream(self, stream: WorkerStream) -> None:
        if not stream.synchronous and stream.last_seq() >= 0:
            self.synchronize_event(self.record_event(stream))

    def elapsed_s(self, start: WorkerEvent, end: WorkerEvent) -> float:
        if start.time_s is None or end.time_s is None:
            return 0.0
        return end.time_s - start.time_s

    def _host_sync(self, what: str) -> None:
        """A host synchronization is about to happen (the emulated device may refuse it, as CUDA's sync debug mode does)."""

    def _runtime_call(self) -> None:
        """A runtime call is about to happen (the emulated device records the calling thread's device)."""


    def close(self) -> None:
        for stream in self._streams:
            stream.close()
