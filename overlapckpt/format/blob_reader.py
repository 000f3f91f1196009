"""One read of every blob a load needs, each checked as it arrives: DCP's reader with the manifest's checksums.

Runs in the process that loads (the training process). ``load(verify=True)`` used to
read the shards twice: once to verify every blob, once more in DCP's reader to decode
them, then a third pass to check the decoded tensors. Here each blob is read once into
memory, its checksum compared with the manifest's before anything decodes it, then
decoded (weights only) and the decoded tensor compared with the checksum of the host
snapshot it was saved from; only then does it become (or is it copied into) the tensor
being loaded.

A tensor's blob is read into a buffer of its own and decoded in place: the tensor is a
view of the bytes read (``tensor_decode.py``), so a load makes one copy of the state
(storage to memory) where stock DCP makes three. A large one is hashed once, in three
spans combined (``crc_combine.py``): the blob's checksum, and the data span's, which is
the tensor's, since the tensor is those very bytes.

Blobs are read on several threads (the file reads, the checksums and the copies
release the GIL). A blob several reads need (a resharded load) is read once.

What is checked, and what is not:

- every blob this load reads, before it is decoded, and every whole tensor (or rank
  part) decoded, against the host snapshot;
- before reading (``verify_checkpoint(read_blobs=False)``): the manifest,
  ``.metadata``'s bytes, and every shard's kind and size;
- blobs that no rank of this load reads (the optimizer's, when ``optimizer=None``) are
  not read: ``overlapckpt verify`` reads every stored byte.

A failure raises CorruptCheckpointError inside DCP's ``read_data``; DCP hands it to
every rank, and ``load`` raises it before any live object changes.

This module decides which blobs are read, on which thread, and where their tensors go;
the checks of one blob are ``blob_checks.py``'s, against ``expected_sums.py``'s records.
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..cores import usable_cores
from ..errors import CorruptCheckpointError
from .blob_checks import checked_blob, checked_bytes, checked_tensor, place_direct
from .expected_sums import ExpectedSums
from .known_framing import stored_chunk
from .manifest import DATA_FILE_RE
from .safe_unpickle import load_byte_item

# Threads that read and check blobs in a load: training is not running then, so up to 8,
# one per two cores (a page-cache read, a CRC32C and a copy each release the GIL). Reads
# from the page cache are bound by memory bandwidth, not by cores: on a 2-core VM a second
# thread made a 768 MiB load vary from 0.35 to 0.73 s, where one took 0.35 to 0.40 s.
MAX_READ_THREADS = 8
# Blobs of one file are read in batches of about this size, one open file per batch:
# large enough that small blobs (param_groups, step counters) share an open, small
# enough that a shard's large tensors spread over the threads.
READ_BATCH_BYTES = 32 << 20

# What a reader does with the blobs of a load (``expect(mode=...)``):
ADOPT = "adopt"  # read each into a buffer of its own and hand the decoded tensor to the load (host tensors it allocated)
CHECK = "check"  # read and check each, place nothing: the first of a load's two passes over local files
PLACE = "place"  # into the load's own tensors: large data straight into them (direct_read.py), the rest copied
MODES = (ADOPT, CHECK, PLACE)


def read_thread_count() -> int:
    return max(1, min(MAX_READ_THREADS, usable_cores() // 2))


def check_thread_count() -> int:
    """Threads of a CHECK pass: one per core. It hashes local files through a map of the page
    cache (no fault in a buffer of ours, no allocation) with a checksum that releases the GIL,
    so it is bound by the cores alone, where a read into fresh memory is bound by its faults."""
    return max(1, min(MAX_READ_THREADS, usable_cores()))


class VerifiedReading:
    """What ``verified_reader_class`` adds to a DCP file-system reader: ``expect()``, and a ``read_data`` that checks each blob.

    A mixin ahead of the reader class in the order of bases: ``super()`` is the reader's own
    ``read_data``, used as it is until ``expect()`` was called.
    """

    # The base reader's (DCP's FileSystemReader and its fsspec twin): the file system, the
    # checkpoint's path, and each blob's place from .metadata.
    fs: Any
    path: Any
    storage_data: Any

    _active = False
    _expected: ExpectedSums | None = None
    _threads: int = 1
    _mode: str = ADOPT
    _checked_files: dict[str, FileIdentity] | None = None

    def expect(
        self,
        expected: ExpectedSums | None,
        threads: int | None = None,
        mode: str = ADOPT,
        checked_files: dict[str, FileIdentity] | None = None,
    ) -> None:
        """Read each blob once, on ``threads`` threads; with ``expected``, check each as it arrives.

        ``mode`` (``ADOPT``, ``CHECK`` or ``PLACE``) says what becomes of the bytes read.
        ``checked_files``: the ``files_read`` of a ``CHECK`` pass over the same blobs. A
        file found the same (device, inode, size, modification time) is not checked
        again; one that changed since is refused.
        """
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if mode == CHECK and expected is None:
            raise ValueError("mode=CHECK reads to check, and needs the sums to check against: pass expected")
        self._active = True
        self._expected = expected
        self._threads = threads or (check_thread_count() if mode == CHECK else read_thread_count())
        self._mode = mode
        self._checked_files = checked_files
        self.files_read: dict[str, FileIdentity] = {}
        self.tensors_placed = 0  # PLACE: tensors of the live objects being written, or written (a failure leaves them partly loaded)

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not self._active:
            return super().read_data(plan, planner)  # type: ignore[misc]  # the DCP reader this is mixed into
        from torch.futures import Future

        # The blobs this plan needs, each once, in file order; the reads that want each.
        wanted: dict[Any, list[Any]] = {}
        for read_item in plan.items:
            wanted.setdefault(read_item.storage_index, []).append(read_item)
        by_file: dict[str, list[tuple[Any, Any]]] = {}
        for index, reads in wanted.items():
            info = self.storage_data[index]
            relative_path = str(info.relative_path)
            check_data_file(index.fqn, relative_path)
            by_file.setdefault(relative_path, []).append((info, reads))
        batches: list[tuple[str, list[tuple[Any, Any]]]] = []
        for relative_path, blobs in sorted(by_file.items()):
            batch: list[tuple[Any, Any]] = []
            size = 0
            for info, reads in sorted(blobs, key=lambda b: int(b[0].offset)):
                batch.append((info, reads))
                size += int(info.length)
                if size >= READ_BATCH_BYTES:
                    batches.append((relative_path, batch))
                    batch, size = [], 0
            if batch:
                batches.append((relative_path, batch))
        lock = threading.Lock()  # the planner's methods are not written for threads
        expected = self._expected
        if len(batches) <= 1 or self._threads == 1:
            for relative_path, batch in batches:
                self._read_batch(relative_path, batch, planner, lock, expected)
        else:
            with ThreadPoolExecutor(max_workers=min(self._threads, len(batches)), thread_name_prefix="overlapckpt-read") as pool:
                futures = [pool.submit(self._read_batch, p, b, planner, lock, expected) for p, b in batches]
                for future in futures:
                    future.result()  # the first failure, in file order
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_batch(
        self, relative_path: str, batch: list[tuple[Any, Any]], planner: Any, lock: threading.Lock, expected: ExpectedSums | None
    ) -> None:
        path = self.fs.concat_path(self.path, relative_path)
        from torch.distributed.checkpoint.planner import LoadItemType

        mode = self._mode
        with self.fs.create_stream(path, "rb") as stream:
            identity = file_identity(stream)
            if identity is not None:
                self.files_read[relative_path] = identity
            if self._checked_files is not None and relative_path in self._checked_files:
                if identity != self._checked_files[relative_path]:
                    raise CorruptCheckpointError(
                        f"{path} changed between this load's check of it and its read (was {self._checked_files[relative_path]}, "
                        f"now {identity}): something rewrote a committed checkpoint; load again"
                    )
                expected = None  # these very bytes were checked by the CHECK pass
            file_nbytes = stream.seek(0, io.SEEK_END)
            mapped = map_for_checking(stream, file_nbytes) if mode == CHECK else None
            metadata = getattr(planner, "metadata", None)  # DCP's planner holds the .metadata it planned from
            for info, reads in batch:
                check_span(relative_path, info, file_nbytes)
                in_map = None if mapped is None else mapped[int(info.offset) : int(info.offset) + int(info.length)]
                index = reads[0].storage_index
                if reads[0].type == LoadItemType.BYTE_IO:
                    blob = checked_blob(stream, relative_path, info, expected, in_map)
                    if mode == CHECK:
                        # Decoded and dropped: a refusal (the allowlist) or a damaged pickle
                        # must come before the placing pass writes any live tensor.
                        for read_item in reads:
                            load_byte_item(io.BytesIO(blob), read_item.dest_index.fqn)
                    else:
                        _decode_bytes(blob, reads, planner, lock)
                    continue
                # The dtype and shape .metadata gives the chunk: which framing a small blob is compared with.
                stored_as = None if metadata is None else stored_chunk(metadata, index)
                if in_map is not None:  # CHECK, of a local file
                    checked_bytes(in_map, relative_path, info, index, expected, stored_as)
                elif mode == CHECK:
                    checked_tensor(stream, relative_path, info, index, expected, fresh=False, stored_as=stored_as)
                elif mode == ADOPT:
                    tensor = checked_tensor(stream, relative_path, info, index, expected, fresh=True, stored_as=stored_as)
                    _place(tensor, reads, planner, lock, adopt=True)
                else:
                    with lock:  # counted before any byte of them is written: a failure may leave them partly written
                        self.tensors_placed += len(reads)
                    if not place_direct(stream, relative_path, info, reads, planner, lock, expected):
                        # A view of this thread's buffer: copied into every target before its next read.
                        tensor = checked_tensor(stream, relative_path, info, index, expected, fresh=False, stored_as=stored_as)
                        _place(tensor, reads, planner, lock, adopt=False)


def verified_reader_class(base: type) -> type:
    """``base`` (a DCP file-system reader) whose ``read_data`` checks each blob once ``expect()`` was called."""

    class VerifiedReader(VerifiedReading, base):
        pass

    VerifiedReader.__name__ = VerifiedReader.__qualname__ = f"Verified{base.__name__}"
    return VerifiedReader


@dataclass(frozen=True)
class FileIdentity:
    """A local file as ``fstat`` sees it: rewritten or replaced, one of these changes."""

    device: int
    inode: int
    size: int
    modified_ns: int


def map_for_checking(stream: Any, file_nbytes: int) -> memoryview | None:
    """A local file's pages, mapped: a check hashes the page cache in place instead of copying it out first.

    A checking pass over mapped pages moves a third of the bytes a read and a hash would
    (768 MiB: 0.12 s against 0.28 s on a 2-core VM). Private and writable (copy on write,
    and nothing writes), so a tensor can be decoded as a view of it. None for a stream
    without a file descriptor, or an empty file: the caller reads instead. The mapping is
    released when the last view of it goes.
    """
    try:
        fileno = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    if file_nbytes == 0:
        return None
    try:
        return memoryview(mmap.mmap(fileno, file_nbytes, access=mmap.ACCESS_COPY))
    except (OSError, ValueError):
        return None


def file_identity(stream: Any) -> FileIdentity | None:
    """The identity of an open local file; None for a stream without one (fsspec's remote files)."""
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    return FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_data_file(fqn: str, relative_path: str) -> None:
    """A blob's file, as .metadata names it, must be one of the checkpoint's data files.

    Confined always, with or without verify: "../../<another root>/..." would read another
    checkpoint's (or any file's) bytes as this one's.
    """
    if not DATA_FILE_RE.fullmatch(relative_path):
        raise CorruptCheckpointError(
            f"the checkpoint's .metadata places {fqn!r} in {relative_path!r}, which is not one of its "
            "data files (__<rank>_<n>.distcp): the file is damaged or crafted; refused unread"
        )


def check_span(relative_path: str, info: Any, file_nbytes: int) -> None:
    """Before any buffer is allocated for it: the blob .metadata claims lies inside its file."""
    offset, length = int(info.offset), int(info.length)
    if offset < 0 or length < 0 or offset + length > file_nbytes:
        raise CorruptCheckpointError(
            f"the checkpoint's .metadata claims bytes {offset}..{offset + length} of {relative_path}, which holds "
            f"{file_nbytes} bytes: the file is damaged or crafted; refused before reading"
        )



def _decode_bytes(blob: memoryview, reads: list[Any], planner: Any, lock: threading.Lock) -> None:
    for read_item in reads:
        with lock:
            planner.load_bytes(read_item, io.BytesIO(blob))  # a copy: the planner may keep it


def _place(tensor: torch.Tensor, reads: list[Any], planner: Any, lock: threading.Lock, adopt: bool) -> None:
    """The decoded tensor into the load: with ``adopt``, adopted when it is a read's whole target; else copied into each target."""
    from torch.distributed._shard._utils import narrow_tensor_by_index

    for read_item in reads:
        with lock:
            if adopt and len(reads) == 1 and _adopt(planner, read_item, tensor):
                continue  # the decoded tensor is the load's own: no copy, and the target was never touched
        part = narrow_tensor_by_index(tensor, read_item.storage_offsets, read_item.lengths)
        with lock:
            target = planner.resolve_tensor(read_item).detach()
        if target.size() != part.size():
            raise CorruptCheckpointError(
                f"{read_item.storage_index.fqn!r} decodes to size {tuple(part.size())}, the load "
                f"wants {tuple(target.size())}"
            )
        target.copy_(part)
        with lock:
            planner.commit_tensor(read_item, target)


def _adopt(planner: Any, read_item: Any, tensor: torch.Tensor) -> bool:
    """Put the decoded ``tensor`` in the load's state dict in place of its target, when it is the whole target.

    The target is a host tensor the load allocated (``torch.empty``, so never touched
    until written: its pages are never faulted in). Copying into it would cost a copy of
    the state and a page fault per 4 KiB; the decoded tensor is the same bytes, freshly
    allocated, so the load adopts it, as DCP itself does for byte items (``load_bytes``).
    Only for a plain tensor read whole, through a planner that keeps DCP's default
    mappings; anything else is copied as DCP copies it.
    """
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    state_dict = getattr(planner, "state_dict", None)
    if not isinstance(state_dict, dict):
        return False
    current = state_dict.get(fqn)
    if type(current) is not torch.Tensor or current.shape != tensor.shape or current.dtype != tensor.dtype:
        return False
    if any(read_item.dest_offsets) or any(read_item.storage_offsets) or tuple(read_item.lengths) != tuple(tensor.shape):
        return False
    if getattr(planner, "flatten_state_dict", False):
        mappings = getattr(planner, "mappings", None)
        original = getattr(planner, "original_state_dict", None)
        if not isinstance(mappings, dict) or fqn not in mappings or original is None:
            return False
        set_element(original, mappings[fqn], tensor)
    state_dict[fqn] = tensor
    planner.commit_tensor(read_item, tensor)
    return True
