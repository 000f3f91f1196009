"""The training side of the writer process: start it, talk to it, notice if it dies.

The writer is a plain subprocess, not a ``multiprocessing`` spawn: spawn re-imports
the user's ``__main__``, which reruns a training script that lacks an ``if __name__ ==
"__main__"`` guard. It starts as ``python -I -c BOOTSTRAP`` (forked from this process's fork server, itself
started that way, where it can: ``writer_client/launcher.py``): isolated mode puts
neither the working directory nor ``PYTHONPATH`` on ``sys.path`` (``python -m`` would
put the cwd first, and a planted ``overlapckpt/`` there would run), and the bootstrap
adds only the directory this package was imported from.

It runs in a session of its own, so the signals a scheduler or a terminal sends to
the training job's process group (SLURM, systemd, Ctrl-C) do not reach it: the
training process decides, and its writer finishes the preemption checkpoint. It is
tied to the training *process* by a lifeline pipe whose write end only the trainer
holds: when the trainer dies, however it dies, the writer reads EOF and exits
(``PR_SET_PDEATHSIG`` would follow the thread that started the writer instead).

No thread runs here: hooks poll the pipe without blocking, and every blocking wait
has a timeout and checks that the process is still alive. The parent closes its
copy of the child's end of the socket pair, so a dead writer shows up as EOF on
the pipe at once, never as a hang.
"""

from __future__ import annotations

import errno
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from ... import protocol as p
from ...errors import CheckpointWriteError, OverlapCkptError, WriterDiedError
from .launcher import start_writer_process

# How long one blocking wait may go without news before it checks the process again.
_LIVENESS_POLL_S = 0.5

def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class WriterTargets:
    """Where the writer persists: the root tier's store, and the node-local tier's directory if the run has one."""

    root: str
    storage_options: dict[str, Any]
    store_class: tuple[str, str]  # (module, qualified name) of a CheckpointStore subclass
    local_root: str | None = None


class WriterClient:
    """One long-lived writer process and the pipe to it."""

    def __init__(
        self,
        targets: WriterTargets,
        startup_timeout_s: float = 120.0,
        group: Any = None,
        signing_key: bytes | None = None,
        writer_threads: int | None = None,
        replay_expected: bool = False,
    ) -> None:
        self.startup_timeout_s = startup_timeout_s
        parent_sock, child_sock = socket.socketpair()
        lifeline_read, self._lifeline = os.pipe()  # the write end stays here, unwritten, for our lifetime
        try:
            # Forked by this process's fork server where it can (writer_client/launcher.py), else a new interpreter.
            self._proc = start_writer_process([child_sock.fileno(), lifeline_read])
        finally:
            # Close our copy of the child's end: when the child dies, its end closes and
            # our reads see EOF immediately.
            child_sock.close()
            os.close(lifeline_read)
        # A second handle on the same socket, for the host buffers' descriptors (SCM_RIGHTS).
        self._fd_sock = socket.socket(fileno=os.dup(parent_sock.fileno()))
        self._conn = Connection(parent_sock.detach())
        self._ready = False
        self._dead: WriterDiedError | None = None
        self.awaiting_responses = 1  # requests the writer answers and has not yet answered
        self._send_now(
            p.InitRequest(
                # Where the store class's module may live; "" (the cwd) is never searched.
                sys_path=[entry for entry in sys.path if entry],
                root=targets.root, storage_options=targets.storage_options, store_class=targets.store_class, group=group,
                signing_key=signing_key, writer_threads=writer_threads, local_root=targets.local_root, replay_expected=replay_expected,
            )
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def send(self, request: object) -> None:
        self._raise_if_dead()
        try:
            self._send_now(request)
        except (BrokenPipeError, ConnectionResetError, OSError) as e:
            raise self._died("while sending a request") from e
        if isinstance(request, _ANSWERED_REQUESTS):
            self.awaiting_responses += 1

    def send_with_fd(self, request: object, fd: int) -> None:
        """Send ``request`` and then the descriptor ``fd``, which the writer reads right after it."""
        self.send(request)
        try:
            # One byte carries the descriptor; the writer takes it with recv_fds once it has
            # read the request, so the framed stream stays in step.
            socket.send_fds(self._fd_sock, [b"F"], [fd])
        except OSError as e:
            raise self._died("while sending a host buffer") from e

    def _send_now(self, request: object) -> None:
        # Plain pickle, not multiprocessing's: its reducers would share tensors through
        # file descriptors and a side channel; small CPU tensors travel inline instead.
        self._conn.send_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))

    def poll(self) -> list[object]:
        """Every response that has arrived, without blocking; raises WriterDiedError if it died."""
        self._raise_if_dead()
        out: list[object] = []
        while True:
            try:
                if not self._conn.poll(0):
                    break
                out.append(self._receive())
            except (EOFError, OSError) as e:
                self._dead = self._died("while checkpoints were in flight")
                if out:  # hand over what did arrive; the death is raised on the next call
                    return out
                raise self._dead from e
        if not out and self._proc.poll() is not None:
            raise self._died("while checkpoints were in flight")
        return out

    def last_words(self) -> list[object]:
        """After its death: every message the writer sent that was not read yet (its socket buffer).

        The death may be noticed by a send or a liveness check before the pipe is read;
        what it said before it died (a commit, how far a replay went) still decides what
        its successor must do.
        """
        out: list[object] = []
        try:
            while self._conn.poll(0):
                out.append(self._receive())
        except (EOFError, OSError, pickle.UnpicklingError):
            pass  # the end of what it said
        return out

    def wait_ready(self) -> None:
        """Block until the writer has started (in a distributed run: joined the writers' group)."""
        while not self._ready:
            try:
                response = self.wait_response(self.startup_timeout_s)
            except TimeoutError as e:
                raise WriterDiedError(
                    f"the writer process (pid {self._proc.pid}) did not start within startup_timeout_s="
                    f"{self.startup_timeout_s}; in a distributed run, check that every rank constructs its Checkpointer"
                ) from e
            if not isinstance(response, p.ReadyResponse):
                raise WriterDiedError(f"the writer process answered {type(response).__name__} before it was ready")

    def check_alive(self) -> None:
        """Raise WriterDiedError if the process has exited (one waitpid, no pipe read)."""
        self._raise_if_dead()
        if self._proc.poll() is not None:
            raise self._died("while no checkpoint was in flight")

    def wait_response(self, timeout_s: float | None) -> object:
        """Block for the next response, up to ``timeout_s``; check liveness as it waits."""
        self._raise_if_dead()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no answer from the writer process within {timeout_s} s")
            step_s = _LIVENESS_POLL_S if remaining is None else min(_LIVENESS_POLL_S, remaining)
            if wait([self._conn], timeout=step_s):
                try:
                    return self._receive()
                except (EOFError, OSError) as e:
                    raise self._died("while a checkpoint was being persisted") from e
            if self._proc.poll() is not None:
                raise self._died("while a checkpoint was being persisted")

    def _receive(self) -> object:
        response = pickle.loads(self._conn.recv_bytes())
        if isinstance(response, (*_ANSWERS, p.ErrorResponse)):
            # An error answers the request that failed; one that answers none (a failed
            # layout or release) can only make the count low, which costs the next
            # answer a few hooks' delay: it is read once a snapshot is in flight.
            self.awaiting_responses = max(0, self.awaiting_responses - 1)
        if isinstance(response, p.ReadyResponse):
            self._ready = True
        elif isinstance(response, p.ErrorResponse) and response.request_id is None and not self._ready:
            raise writer_error(response, "the writer process failed to start")
        return response

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _died(self, when: str) -> WriterDiedError:
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        self._dead = WriterDiedError(
            f"the writer process (pid {self._proc.pid}) {_describe_exit(code)} {when}; checkpoints not yet "
            "committed are lost, committed ones are intact. Check the writer's stderr, host memory "
            "(an OOM kill shows as SIGKILL) and the storage path"
        )
        return self._dead

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the writer to stop; kill it if it does not exit in ``timeout_s``."""
        if self._proc.poll() is None:
            try:
                self._send_now(p.ShutdownRequest())
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=timeout_s)
        self._conn.close()
        self._fd_sock.close()
        if self._lifeline >= 0:
            os.close(self._lifeline)  # a writer still alive now reads EOF and exits
            self._lifeline = -1


# Requests the writer answers, and the answers: the engine polls the pipe only while
# one is outstanding or a snapshot is in flight (an idle poll costs ~13 us per hook).
_ANSWERED_REQUESTS = (p.MapBufferRequest, p.PersistRequest, p.FetchFilesRequest)
_ANSWERS = (p.ReadyResponse, p.MappedResponse, p.CommittedResponse, p.FetchedResponse)


def writer_error(response: p.ErrorResponse, what: str) -> OverlapCkptError:
    """The training-side error for a writer failure, with the original exception chained."""
    cause = response.exception
    if isinstance(cause, OverlapCkptError):
        # One of ours (ranks that disagree, a commit refused): raised with its own type.
        named = type(cause)(f"{what}: {cause}")
        named.__cause__ = cause
        return named
    fix = ""
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        fix = "; the storage is full: the attempt's files were removed, free space there and the next checkpoint commits"
    error = CheckpointWriteError(
        f"{what}: {response.type_name}: {response.message}{fix}\n--- writer traceback ---\n{response.traceback_text}"
    )
    error.__cause__ = cause
    return error
