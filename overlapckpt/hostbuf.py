"""Host buffers shared by the training process and the writer process.

A buffer is a file in a shared-memory filesystem (``/dev/shm``), mapped with
``MAP_SHARED`` by both processes, so the writer reads the snapshot in place: no
tensor data ever passes through a pipe. Where CUDA is present the training side
page-locks its mapping with ``cudaHostRegister``, so device-to-host copies into it
are truly asynchronous DMA.

Lifecycle: the training process creates the file and maps it; the writer maps the
same path; then the training process unlinks the path. The memory lives while
either mapping does, so nothing is left in ``/dev/shm`` if either process is
killed. Buffers are allocated once per Checkpointer and reused for every
checkpoint (DCP's stager leaked and broke on reuse in torch 2.9 to 2.12).
"""

from __future__ import annotations

import errno
import os
import tempfile
import uuid

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


def map_existing_file(path: str, nbytes: int) -> torch.Tensor:
    """Map ``path`` like ``map_shared_file``, but raise FileNotFoundError instead of creating it.

    The writer maps a buffer some time after the training process announced it; if
    the training side released (unlinked) it meanwhile, creating the file again here
    would leave it in /dev/shm for good.
    """
    fd = os.open(path, os.O_RDWR)  # no O_CREAT
    try:
        return map_shared_file(f"/proc/self/fd/{fd}", nbytes) if os.path.isdir("/proc/self/fd") else map_shared_file(path, nbytes)
    finally:
        os.close(fd)


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


class SharedHostBuffer:
    """One slot of host memory for one snapshot, shared with the writer process."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        if nbytes <= 0:
            raise ConfigError(f"host buffer size {nbytes} bytes is invalid; it must be positive")
        directory = shared_memory_dir()
        self.path = os.path.join(directory, f"overlapckpt-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: on tmpfs a plain ftruncate succeeds past the
            # filesystem's size, and the first copy into the hole then dies of SIGBUS.
            _reserve(fd, nbytes)
        except OSError as e:
            os.close(fd)
            os.unlink(self.path)
            raise ConfigError(
                f"cannot allocate a {nbytes}-byte host buffer in {directory}: {e}; enlarge the "
                "shared-memory filesystem or point OVERLAPCKPT_SHM_DIR at one with room"
            ) from e
        os.close(fd)
        self.tensor = map_shared_file(self.path, nbytes)
        self._unlinked = False
        self._pinned = False
        if pin:
            self._pin()

    def _pin(self) -> None:
        # cudaHostRegister page-locks the existing mapping, so the DMA engine can copy
        # into it without a staging bounce and without blocking the host.
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            raise ConfigError(
                f"cudaHostRegister of a {self.nbytes}-byte host buffer failed (cudaError {int(err)}); "
                "raise the locked-memory limit (ulimit -l) or lower the checkpoint's size"
            )
        self._pinned = True

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The slot bytes at ``offset`` seen as a tensor of ``dtype`` and ``shape``."""
        return view_bytes(self.tensor, offset, dtype, shape)

    def unlink(self) -> None:
        """Remove the file name once every process that needs the memory has mapped it."""
        if not self._unlinked:
            self._unlinked = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def release(self) -> None:
        """Unpin and drop this process's mapping (the caller drops its views first)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._pinned = False
        self.unlink()
        self.tensor = torch.empty(0, dtype=torch.uint8)


def view_bytes(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = buffer[offset : offset + numel * itemsize]
    return raw.view(dtype).reshape(shape)
