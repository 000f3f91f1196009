"""Files and directories another user of the node must not be able to plant, swap or read.

A node-local tier under ``/dev/shm`` and the native helpers' build cache live where every
user and container of the node can create names. What they hold decides what a restore
loads and what code runs, so both are treated as ssh treats ``~/.ssh``:

- a directory is used only when it is a real directory (not a symlink), owned by this
  user, and writable by nobody else; one made here is made ``0700``, and an existing one
  of ours with wider read bits is narrowed to ``0700``;
- a small file (a lease, a manifest, ``latest``, a marker) is read through
  :func:`read_regular_file`: opened without following a symlink and without blocking (a
  FIFO would hang the reader), refused unless it is a regular file, and refused above a
  size cap before a byte is read (a link to ``/dev/zero`` would fill memory);
- a file written here is created ``0600``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from ..errors import UnsafeFileError, UntrustedPathError

# A lease, ``latest``, a claim or a tier's marker: a few hundred bytes each.
RECORD_MAX_BYTES = 64 << 10
# A manifest or ``.metadata``: a record per tensor. 256 MiB is far above what a model's
# metadata takes (about 200 bytes per tensor) and far below what would hurt to allocate.
SMALL_FILE_MAX_BYTES = 256 << 20
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def refusal_of_directory(path: str) -> str | None:
    """Why ``path`` may not hold this user's private files, or None when it may (or does not exist)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (to {os.readlink(path)!r})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & _OTHERS_WRITE:
        return f"{path} is writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_dir(path: str, what: str, fix: str) -> None:
    """Create ``path`` ``0700`` (its parents as usual) or check the one there; UntrustedPathError naming ``what`` and ``fix``.

    An existing directory of this user's that others could read is narrowed to ``0700``.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    refusal = refusal_of_directory(path)
    if refusal is not None:
        raise UntrustedPathError(f"{what}: {refusal}; another user could have planted or could change what it holds. {fix}")
    if stat.S_IMODE(os.lstat(path).st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE, follow_symlinks=False)


def _open_regular(path: str, max_bytes: int) -> tuple[int, int]:
    """(descriptor, size) of the regular file at ``path``, opened without following a link or blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(errno.ELOOP, "a symbolic link: refused unread", path) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(errno.EINVAL, "not a regular file (a FIFO, a device or a directory): refused unread", path)
        if st.st_size > max_bytes:
            raise UnsafeFileError(errno.EFBIG, f"holds {st.st_size} bytes, above the {max_bytes} this file may hold: refused unread", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular_file(path: str, max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; OSError for a link, a FIFO, a device or a larger file.

    FileNotFoundError when it does not exist. A symlink fails with ``ELOOP`` (``O_NOFOLLOW``).
    """
    fd, size = _open_regular(path, max_bytes)
    try:
        chunks = []
        left = size + 1  # one byte more: a file that grew since fstat is refused, not cut
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > size:
        raise UnsafeFileError(errno.EFBIG, "grew while it was read: refused", path)
    return data


def open_regular_file(path: str, max_bytes: int = 1 << 62) -> tuple[BinaryIO, int]:
    """``(file object, size)`` of a regular file opened as :func:`read_regular_file` opens it, for streamed reads."""
    fd, size = _open_regular(path, max_bytes)
    return os.fdopen(fd, "rb"), size


@contextmanager
def open_regular(path: str, max_bytes: int = 1 << 62) -> Iterator[tuple[BinaryIO, int]]:
    """:func:`open_regular_file` as a context manager that closes it."""
    f, size = open_regular_file(path, max_bytes)
    with f:
        yield f, size


def create_private_file(path: str) -> int:
    """A descriptor of ``path``, created ``0600`` for writing; FileExistsError if it exists. Never follows a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE)


def recreate_private_file(path: str) -> int:
    """:func:`create_private_file` after removing what is there (a partial file a killed writer left).

    Removed, not truncated: an existing file would keep its mode and owner.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return create_private_file(path)


def narrow_tree(directory: str) -> None:
    """Make every directory under ``directory`` ``0700`` and every regular file ``0600``; links are left as they are."""
    for parent, dirs, files in os.walk(directory):
        os.chmod(parent, PRIVATE_DIR_MODE, follow_symlinks=False)
        for name in files:
            path = os.path.join(parent, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                os.chmod(path, PRIVATE_FILE_MODE, follow_symlinks=False)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(parent, d))]
