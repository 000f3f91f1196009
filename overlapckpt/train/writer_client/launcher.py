"""Starting writer processes: forked by this training process's fork server, or as a fresh interpreter.

``WriterClient`` asks ``start_writer_process`` for a process and gets an object with
``Popen``'s interface (``pid``, ``poll``, ``wait``, ``kill``). Where Linux gives
pidfds, it comes from the fork server (``writer/fork_server.py``), one per training
process, started at the first writer and kept for the process's life: a writer is
then forked in milliseconds with torch and DCP imported, where a fresh interpreter
took about 3 s (2.9 s measured on the 2-core CI machine) before it could answer. Elsewhere,
or if the server cannot be reached, the writer is a ``subprocess.Popen`` as before.

The fork server is started exactly as a writer is (``python -I``, only this package's
directory on ``sys.path``, its own session, a lifeline pipe whose write end only this
process holds), so a writer forked from it keeps every property the writer had:
nothing from the working directory, no signal from the job's process group, and an
exit when the training process dies (each writer has its own lifeline too).

A forked writer is not this process's child: its exit is seen through a pidfd (which
also guards ``kill`` against a reused pid), and its exit status comes from the server,
which reaps it only when asked, after the exit, so the pid is never reused before.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Protocol

log = logging.getLogger("overlapckpt")

# Run by ``python -I -c``: argv is [-c, package parent dir, fd, lifeline fd].
WRITER_BOOTSTRAP = "import sys; sys.path.insert(0, sys.argv[1]); from overlapckpt.writer.process import main; main(sys.argv[1:])"
_SERVER_BOOTSTRAP = "import sys; sys.path.insert(0, sys.argv[1]); from overlapckpt.writer.fork_server import main; main(sys.argv[1:])"
# How long the fork server may take to import torch and DCP and answer its first request.
_SERVER_ANSWER_TIMEOUT_S = 120.0
# Set to "0" to start every writer as a fresh interpreter (the fork server's fallback, made the rule).
FORK_SERVER_ENV = "OVERLAPCKPT_WRITER_FORK_SERVER"


class WriterProcessHandle(Protocol):
    """What ``WriterClient`` uses of a process: ``subprocess.Popen``'s interface."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def package_parent_dir() -> str:
    """The directory that holds the ``overlapckpt`` package this module was imported from.

    Found from the package itself (``overlapckpt.__file__``), not by counting folders up
    from this file. From a plain source checkout (``PYTHONPATH=.``, nothing installed)
    it is the only place the writer can import the package from.
    """
    package = sys.modules[__name__.partition(".")[0]]  # imported already: this module is inside it
    return os.path.dirname(os.path.dirname(os.path.abspath(str(package.__file__))))


def writer_environment() -> dict[str, str]:
    env = dict(os.environ)
    # The writer works on host memory only; hiding the GPUs keeps it from creating a CUDA context.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join([package_parent_dir(), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _start_interpreter(bootstrap: str, fds: list[int]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-I", "-c", bootstrap, package_parent_dir(), *(str(fd) for fd in fds)],
        pass_fds=fds,
        env=writer_environment(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


class ForkedWriter:
    """A writer the fork server forked: ``Popen``'s interface over a pidfd and the server's reaping."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self._close_pidfd = weakref.finalize(self, os.close, self._pidfd)  # once, here or when dropped
        self.returncode: int | None = None

    def _exited(self, timeout_s: float | None) -> bool:
        if self._pidfd < 0:
            return True
        readable, _, _ = select.select([self._pidfd], [], [], timeout_s)
        return bool(readable)

    def _collect(self) -> int | None:
        if self._pidfd >= 0:
            self._close_pidfd()
            self._pidfd = -1
            self.returncode = self._server.reap(self.pid)
        return self.returncode

    def poll(self) -> int | None:
        if self._pidfd >= 0 and not self._exited(0):
            return None
        code = self._collect()
        return -int(signal.SIGKILL) if code is None else code  # reaped elsewhere: gone, its status unknown

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited(timeout):
            raise subprocess.TimeoutExpired(f"writer {self.pid}", timeout or 0.0)
        code = self.poll()
        return -int(signal.SIGKILL) if code is None else code

    def kill(self) -> None:
        if self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _ForkServer:
    """The fork server of this training process, and the socket to it (one request at a time)."""

    def __init__(self) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        lifeline_read, self._lifeline = os.pipe()  # the write end stays here, unwritten, for our lifetime
        try:
            self._proc = _start_interpreter(_SERVER_BOOTSTRAP, [theirs.fileno(), lifeline_read])
        finally:
            theirs.close()
            os.close(lifeline_read)
        self._lock = threading.Lock()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _ask(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        with self._lock:
            socket.send_fds(self._sock, [json.dumps(message).encode()], fds)
            deadline = time.monotonic() + _SERVER_ANSWER_TIMEOUT_S
            while True:
                readable, _, _ = select.select([self._sock], [], [], 0.5)
                if readable:
                    break
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise OSError(f"the writers' fork server (pid {self._proc.pid}) did not answer")
            answer = self._sock.recv(1 << 16)
        if not answer:
            raise OSError(f"the writers' fork server (pid {self._proc.pid}) closed its socket")
        reply: dict[str, Any] = json.loads(answer)
        return reply

    def spawn(self, fds: list[int]) -> ForkedWriter:
        reply = self._ask({"spawn": {"env": writer_environment()}}, fds)
        return ForkedWriter(self, int(reply["pid"]))

    def reap(self, pid: int) -> int | None:
        try:
            code = self._ask({"reap": pid}, [])["code"]
        except OSError:
            return None  # the server is gone: the writer was reparented and reaped elsewhere
        return None if code is None else int(code)

    def close(self) -> None:
        self._sock.close()
        os.close(self._lifeline)  # the server reads EOF and exits
        try:
            self._proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()


_server: _ForkServer | None = None
_server_lock = threading.Lock()


def _fork_server_wanted() -> bool:
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and os.environ.get(FORK_SERVER_ENV, "1") != "0"


def start_writer_process(fds: list[int]) -> WriterProcessHandle:
    """A writer process serving the request socket ``fds[0]`` with lifeline ``fds[1]`` (both stay open here)."""
    global _server
    if _fork_server_wanted():
        with _server_lock:
            for attempt in range(2):
                if _server is None or not _server.alive():
                    _server = _ForkServer()
                try:
                    return _server.spawn(fds)
                except OSError as e:
                    log.warning("overlapckpt: the writers' fork server failed (%s); %s", e, "starting a new one" if attempt == 0 else "starting the writer on its own")
                    _server.close()
                    _server = None
    return _start_interpreter(WRITER_BOOTSTRAP, fds)
