"""Host buffers shared by the training process and the writer process.

A buffer is anonymous shared memory (``memfd_create``), mapped with ``MAP_SHARED``
by both processes, so the writer reads the snapshot in place: no tensor data ever
passes through a pipe. Where CUDA is present the training side page-locks its
mapping with ``cudaHostRegister``, so device-to-host copies into it are truly
asynchronous DMA.

The memory has no name: the training process hands the writer its file descriptor
over their socket (``SCM_RIGHTS``), so there is nothing in ``/dev/shm`` to leak,
whatever the moment a process is killed; the memory goes when the last mapping and
descriptor close. Where ``memfd_create`` is missing, or ``OVERLAPCKPT_SHM_DIR``
names a directory, a file there is created and unlinked at once, keeping only the
descriptor. Buffers are allocated once per Checkpointer and reused for every
checkpoint (DCP's stager leaked and broke on reuse in torch 2.9 to 2.12).
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid
import weakref
from typing import Any, Protocol

import torch

from .errors import ConfigError


def shared_memory_dir() -> str:
    """The directory for buffer files: ``OVERLAPCKPT_SHM_DIR``, else ``/dev/shm``, else the temp dir."""
    configured = os.environ.get("OVERLAPCKPT_SHM_DIR")
    if configured:
        return configured
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def map_shared_file(path: str, nbytes: int) -> torch.Tensor:
    """Map ``path`` (already ``nbytes`` long) as a shared uint8 tensor."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _reserve(fd: int, nbytes: int) -> None:
    if not hasattr(os, "posix_fallocate"):  # macOS
        os.ftruncate(fd, nbytes)
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: the size, unreserved


def _anonymous_fd(nbytes: int) -> tuple[int, str]:
    """A descriptor of ``nbytes`` of shared memory with no name left anywhere, and where it lives."""
    directory = os.environ.get("OVERLAPCKPT_SHM_DIR")
    if directory is None and hasattr(os, "memfd_create"):
        # The name shows only in /proc/<pid>/maps ("/memfd:overlapckpt-..."), never in a filesystem.
        name = f"overlapckpt-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        return os.memfd_create(name, os.MFD_CLOEXEC), "anonymous shared memory (memfd)"
    directory = directory or shared_memory_dir()
    if hasattr(os, "O_TMPFILE"):
        try:
            # An unnamed file in that filesystem: no moment at which a kill leaves a name behind.
            return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600), directory
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    path = os.path.join(directory, f"overlapckpt-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)  # the descriptor keeps the memory; the name goes at once (a kill in between leaves it)
    return fd, directory


def fd_path(fd: int) -> str:
    """A path that opens the file behind ``fd`` (Linux's /proc/self/fd)."""
    return f"/proc/self/fd/{fd}"


# cudaHostRegister's error for a range that overlaps one already registered.
_HOST_MEMORY_ALREADY_REGISTERED = 712


class HostPinner(Protocol):
    """What page-locks host memory for a device's DMA (the device seam's CUDA runtime calls)."""

    def register_host(self, ptr: int, nbytes: int) -> int: ...

    def unregister_host(self, ptr: int) -> int: ...


def _release_host_memory(pinner: HostPinner | None, mapping: torch.Tensor, fd: int) -> None:
    # Unregister before the mapping can go: a registration outliving its memory makes the
    # next cudaHostRegister at a reused address fail.
    if pinner is not None:
        pinner.unregister_host(mapping.data_ptr())
    os.close(fd)


class SharedHostBuffer:
    """One slot of host memory for one snapshot, shared with the writer process by descriptor.

    ``release()`` unregisters and unmaps it. A buffer dropped without it (a Checkpointer
    never closed) is released by a finalizer when it is collected, or at interpreter exit.
    """

    def __init__(self, nbytes: int, pin: HostPinner | None) -> None:
        if nbytes <= 0:
            raise ConfigError(f"host buffer size {nbytes} bytes is invalid; it must be positive")
        self.nbytes = nbytes
        self.fd, where = _anonymous_fd(nbytes)
        try:
            # Reserve the pages now: on tmpfs (and memfd) a plain ftruncate succeeds past
            # what is free, and the first copy into the hole then dies of SIGBUS.
            _reserve(self.fd, nbytes)
        except OSError as e:
            os.close(self.fd)
            raise ConfigError(
                f"cannot allocate a {nbytes}-byte host buffer in {where}: {e}; free host memory, enlarge the "
                "shared-memory filesystem, or point OVERLAPCKPT_SHM_DIR at one with room"
            ) from e
        self.tensor = map_shared_file(fd_path(self.fd), nbytes)
        if pin is not None:
            self._pin(pin)
        self._finalizer = weakref.finalize(self, _release_host_memory, pin, self.tensor, self.fd)

    def _pin(self, pinner: HostPinner) -> None:
        # cudaHostRegister page-locks the existing mapping, so the DMA engine can copy
        # into it without a staging bounce and without blocking the host.
        err = pinner.register_host(self.tensor.data_ptr(), self.nbytes)
        if err == 0:
            return
        self.tensor = torch.empty(0, dtype=torch.uint8)
        os.close(self.fd)
        if err == _HOST_MEMORY_ALREADY_REGISTERED:
            raise ConfigError(
                f"cudaHostRegister of a {self.nbytes}-byte host buffer failed: its address range is already "
                "registered (cudaErrorHostMemoryAlreadyRegistered), by code that page-locked this memory and "
                "never unregistered it; release such memory with cudaHostUnregister before it is unmapped"
            )
        raise ConfigError(
            f"cudaHostRegister of a {self.nbytes}-byte host buffer failed (cudaError {err}); "
            "raise the locked-memory limit (ulimit -l) or lower the checkpoint's size"
        )

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot bytes at ``offset`` seen as a tensor of ``dtype`` and ``shape``."""
        return view_bytes(self.tensor, offset, dtype, shape)

    def release(self) -> None:
        """Unpin and drop this process's mapping and descriptor (the caller drops its views first)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self.fd = -1
        self._finalizer()  # once: a second call, or the collection later, does nothing


def view_bytes(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = buffer[offset : offset + numel * itemsize]
    return raw.view(dtype).reshape(shape)


def exact_view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """``view_bytes``, as a tensor whose storage is exactly its own bytes of ``buffer`` (no copy).

    DCP's writer clones any tensor whose storage is larger than the tensor (so that
    ``torch.save`` does not write the whole storage), and every plain view into a host
    slot is one: 72 ms per 96 MiB on one core. A storage made over just these bytes
    (``torch.frombuffer`` on the slot's memory) is written in place.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    flat: Any = buffer.numpy()  # the mapped bytes, shared with ``buffer`` (kept alive through it)
    return torch.frombuffer(memoryview(flat)[offset : offset + numel * itemsize], dtype=dtype).view(shape)
