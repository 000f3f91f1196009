"""The writers' fork server: one process per training process that has imported torch and DCP once, and forks writers.

A writer started as a fresh interpreter spends about 3 s importing torch and DCP (2.9 s
measured on the 2-core CI machine) before it can answer. Every Checkpointer paid that,
and so did every replacement of a dead writer. This process pays it once: the training
process starts it like a writer (``python -I``, its own session, a lifeline; see
``train/writer_client/launcher.py``) and then asks it for writers, which ``fork()`` gives in
milliseconds, with the modules already imported and shared copy-on-write.

It is single-threaded, so a fork copies no lock held by another thread; the writer
starts its own threads after the fork.

The conversation, over a ``SOCK_SEQPACKET`` socket pair (one message per datagram):

* ``{"spawn": {"env": ...}}`` with two descriptors (the writer's request socket and
  its lifeline's read end, SCM_RIGHTS): fork a writer in a session of its own, with
  the training process's environment of now (a test's or a job's settings reach it),
  and answer ``{"pid": N}``;
* ``{"reap": N}``: once the training process saw writer N exit (its pidfd), collect
  its exit status and answer ``{"code": C}`` (Popen's convention: ``-9`` for SIGKILL).
  Exited writers stay zombies until then, so their pid is never reused before the
  training process is done with it.

Messages are JSON, never pickle. The server exits when its lifeline or its socket
reports EOF: the training process is gone.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys
from typing import Any

# One message: the spawn request's environment fits in far less.
_MAX_MESSAGE_BYTES = 1 << 20
# The environment a writer never takes from the training process: it works on host memory only.
_WRITER_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _fork_writer(control: socket.socket, lifeline_fd: int, package_dir: str, env: dict[str, str], fds: list[int]) -> int:
    settled_read, settled_write = os.pipe()
    pid = os.fork()
    if pid != 0:
        for fd in fds:
            os.close(fd)  # the writer holds them now
        os.close(settled_write)
        os.read(settled_read, 1)  # answer once it is in its own session (or gone): never a pid still in ours
        os.close(settled_read)
        return pid
    # The writer: nothing of the server's but the imported modules.
    code = 1
    try:
        control.close()
        os.close(lifeline_fd)
        os.close(settled_read)
        os.setsid()  # a session of its own: the job's process-group signals do not reach it
        os.close(settled_write)
        os.environ.clear()
        os.environ.update({**env, **_WRITER_ENV})
        from .process import main

        main([package_dir, str(fds[0]), str(fds[1])])
        code = 0
    except BaseException:  # noqa: BLE001 - a writer's failure is reported to its trainer by the writer itself
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never return into the server's loop
    return 0  # unreachable


def serve(package_dir: str, control_fd: int, lifeline_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    while True:
        readable, _, _ = select.select([control.fileno(), lifeline_fd], [], [])
        if lifeline_fd in readable and os.read(lifeline_fd, 1) == b"":
            return  # the training process is gone
        if control.fileno() not in readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, _MAX_MESSAGE_BYTES, 2)
        if not message:
            return
        request = json.loads(message)
        if "spawn" in request and len(fds) == 2:
            env = {str(k): str(v) for k, v in request["spawn"]["env"].items()}
            _send(control, {"pid": _fork_writer(control, lifeline_fd, package_dir, env, fds)})
        elif "reap" in request:
            for fd in fds:
                os.close(fd)
            try:
                _, status = os.waitpid(int(request["reap"]), 0)
                _send(control, {"code": os.waitstatus_to_exitcode(status)})
            except ChildProcessError:
                _send(control, {"code": None})
        else:
            for fd in fds:
                os.close(fd)
            _send(control, {"error": f"unknown request {sorted(request)}"})


def main(argv: list[str]) -> None:
    """``argv``: [package dir, control socket fd, lifeline fd] (see ``train/writer_client/launcher.py``)."""
    from . import process  # noqa: F401 - imported once here, before any fork: what the writers share

    serve(argv[0], int(argv[1]), int(argv[2]))


if __name__ == "__main__":
    raise SystemExit("the fork server is started by overlapckpt's writer launcher, not run directly")
