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
"""

from __future__ import annotations

import io
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from ..cores import usable_cores
from ..errors import CorruptCheckpointError
from .blob_macs import BlobMacs
from .checksum import CRC32, hex32, updater
from .crc_combine import combine
from .direct_read import DIRECT_MIN_BYTES, fill, mark_written, read_ends, takes_data_as_is, tensor_bytes
from .manifest import DATA_FILE_RE, Manifest, tensor_checksum
from .safe_unpickle import load_byte_item
from .tensor_decode import BlobEnds, TensorRecord, ViewReader, decode_in_place, decode_meta, locate, locate_from_ends

# Threads that read and check blobs in a load: training is not running then, so up to 8,
# one per two cores (a page-cache read, a CRC32C and a copy each release the GIL). Reads
# from the page cache are bound by memory bandwidth, not by cores: on a 2-core VM a second
# thread made a 768 MiB load vary from 0.35 to 0.73 s, where one took 0.35 to 0.40 s.
MAX_READ_THREADS = 8
# Blobs of one file are read in batches of about this size, one open file per batch:
# large enough that small blobs (param_groups, step counters) share an open, small
# enough that a shard's large tensors spread over the threads.
READ_BATCH_BYTES = 32 << 20
# A tensor's bytes at least this long are hashed once, with the checksums of the spans
# combined (~0.2 ms a blob); shorter ones are cheaper to hash twice.
SPLIT_MIN_BYTES = 4 << 20

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


@dataclass(frozen=True)
class TensorSum:
    """The checksum of one tensor (or rank part) of the host snapshot that was saved."""

    shape: tuple[int, ...]
    algorithm: str
    checksum: str


@dataclass(frozen=True)
class ExpectedSums:
    """What a checkpoint's blobs and tensors must hash to, from its (self-checked) manifest."""

    where: str  # the checkpoint's path or URL, for messages
    algorithm: str
    blobs: dict[tuple[str, int, int], tuple[str, str]]  # (file, offset, length) -> (key, checksum)
    tensors: dict[tuple[str, tuple[int, ...]], TensorSum]  # (fqn, offset in the global tensor) -> its sum
    macs: BlobMacs | None = None  # with a signing key: each blob's MAC is checked too

    @classmethod
    def from_manifest(cls, manifest: Manifest, where: str, signing_key: bytes | None = None) -> ExpectedSums:
        """``signing_key``: the manifest's signature was checked with it; each blob's MAC is checked too."""
        sums = manifest.checksums
        if sums is None:
            raise CorruptCheckpointError(f"{where} has no checksums of its stored bytes; load it with verify=False")
        macs = None if signing_key is None else BlobMacs.from_manifest(manifest, where, signing_key)
        blobs = {(name, b.offset, b.length): (b.key, b.checksum) for name, f in sums.files.items() for b in f.blobs}
        tensors: dict[tuple[str, tuple[int, ...]], TensorSum] = {}
        parts = [(key, item) for key, item in manifest.items.items()]
        parts += [(key, item) for section in manifest.ranks for key, item in section.items.items()]
        for key, item in parts:
            if item.checksum is not None:
                algorithm, checksum = sums.algorithm, item.checksum
            elif item.crc32 is not None:  # format 2: zlib's CRC-32 as an integer
                algorithm, checksum = CRC32, hex32(item.crc32)
            else:
                continue
            offset = tuple(item.offset) if item.offset is not None else (0,) * len(item.shape)
            tensors[(key, offset)] = TensorSum(tuple(item.shape), algorithm, checksum)
        return cls(where=where, algorithm=sums.algorithm, blobs=blobs, tensors=tensors, macs=macs)

    def check_mac(self, relative_path: str, info: Any, key: str | None, *parts: Any) -> None:
        """With a signing key, the blob whose bytes are ``parts`` against its MAC; a refusal if it differs."""
        if self.macs is not None and not self.macs.matches(relative_path, int(info.offset), int(info.length), *parts):
            offset, length = int(info.offset), int(info.length)
            raise _refusal(
                self.where,
                f"the keyed digest (MAC) of {key!r} in {self.where}/{relative_path} (bytes {offset}..{offset + length}) "
                "does not match the signed manifest's: forged or damaged",
            )


def _refusal(where: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"reading the checkpoint {where} failed verification: {problem}; restore from an older checkpoint "
        "(list_checkpoints), or pass verify=False to inspect it"
    )


def verified_reader_class(base: type) -> type:
    """``base`` (a DCP file-system reader) whose ``read_data`` checks each blob once ``expect()`` was called."""

    class VerifiedReader(base):
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
                return super().read_data(plan, planner)
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
                for info, reads in batch:
                    check_span(relative_path, info, file_nbytes)
                    in_map = None if mapped is None else mapped[int(info.offset) : int(info.offset) + int(info.length)]
                    if reads[0].type == LoadItemType.BYTE_IO:
                        blob = _checked_blob(stream, relative_path, info, expected, in_map)
                        if mode == CHECK:
                            # Decoded and dropped: a refusal (the allowlist) or a damaged pickle
                            # must come before the placing pass writes any live tensor.
                            for read_item in reads:
                                load_byte_item(io.BytesIO(blob), read_item.dest_index.fqn)
                        else:
                            _decode_bytes(blob, reads, planner, lock)
                    elif in_map is not None:  # CHECK, of a local file
                        _checked_bytes(in_map, relative_path, info, reads[0].storage_index, expected)
                    elif mode == CHECK:
                        _checked_tensor(stream, relative_path, info, reads[0].storage_index, expected, fresh=False)
                    elif mode == ADOPT:
                        tensor = _checked_tensor(stream, relative_path, info, reads[0].storage_index, expected, fresh=True)
                        _place(tensor, reads, planner, lock, adopt=True)
                    else:
                        with lock:  # counted before any byte of them is written: a failure may leave them partly written
                            self.tensors_placed += len(reads)
                        if not _place_direct(stream, relative_path, info, reads, planner, lock, expected):
                            # A view of this thread's buffer: copied into every target before its next read.
                            tensor = _checked_tensor(stream, relative_path, info, reads[0].storage_index, expected, fresh=False)
                            _place(tensor, reads, planner, lock, adopt=False)

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


_thread_buffers = threading.local()


def _read_into_thread_buffer(stream: Any, length: int) -> memoryview:
    """``length`` bytes of ``stream`` (fewer at its end) in this thread's reused buffer.

    A fresh ``bytes`` per blob would cost a page fault per 4 KiB of every blob; the
    buffer's pages are faulted in once per thread. The view is valid until this thread
    reads its next blob (each blob is decoded, and its tensor copied out, before that).
    """
    buffer: bytearray | None = getattr(_thread_buffers, "buffer", None)
    if buffer is None or len(buffer) < length:
        buffer = bytearray(length)
        _thread_buffers.buffer = buffer
    view = memoryview(buffer)[:length]
    return view[: fill(stream, view)]


def _blob_sums(relative_path: str, info: Any, expected: ExpectedSums | None) -> tuple[str | None, str | None]:
    """(key, checksum) the manifest lists for this blob; a refusal if it lists none. (None, None) without checks."""
    if expected is None:
        return None, None
    offset, length = int(info.offset), int(info.length)
    span = f"{expected.where}/{relative_path} (bytes {offset}..{offset + length})"
    sums = expected.blobs.get((relative_path, offset, length))
    if sums is None:
        raise _refusal(expected.where, f"{span} is not a blob the manifest lists, though .metadata points at it")
    key, checksum = sums
    if getattr(info, "transform_descriptors", None):
        raise _refusal(expected.where, f"{key!r} in {span} was stored through DCP extensions, which overlapckpt never writes")
    return key, checksum


def _cut_short(relative_path: str, info: Any, got: int, key: str | None, expected: ExpectedSums | None) -> CorruptCheckpointError:
    offset, length = int(info.offset), int(info.length)
    if expected is None:
        return CorruptCheckpointError(f"{relative_path} (bytes {offset}..{offset + length}) is cut short at byte {offset + got}")
    span = f"{expected.where}/{relative_path} (bytes {offset}..{offset + length})"
    return _refusal(expected.where, f"{key!r} in {span} is cut short at byte {offset + got}: the file is truncated")


def _mismatch(relative_path: str, info: Any, key: str | None, expected: ExpectedSums) -> CorruptCheckpointError:
    offset, length = int(info.offset), int(info.length)
    return _refusal(expected.where, f"checksum mismatch for {key!r} in {expected.where}/{relative_path} (bytes {offset}..{offset + length})")


def _checked_blob(
    stream: Any, relative_path: str, info: Any, expected: ExpectedSums | None, mapped: memoryview | None = None
) -> memoryview:
    """One blob's bytes, read once (``mapped``: already in memory), after its checksum matched the manifest's.

    ``expected``: None checks nothing.
    """
    key, checksum = _blob_sums(relative_path, info, expected)
    if mapped is not None:
        blob = mapped
    else:
        stream.seek(int(info.offset))
        blob = _read_into_thread_buffer(stream, int(info.length))
    if len(blob) < int(info.length):
        raise _cut_short(relative_path, info, len(blob), key, expected)
    if expected is not None:
        if hex32(updater(expected.algorithm)(blob, 0)) != checksum:
            raise _mismatch(relative_path, info, key, expected)
        expected.check_mac(relative_path, info, key, blob)
    return blob


def _read_fresh(stream: Any, length: int) -> bytearray:
    """``length`` bytes of ``stream`` (fewer at its end) in a buffer of their own: the tensor decoded from it keeps it."""
    buffer = bytearray(length)
    with memoryview(buffer) as view:
        filled = fill(stream, view)
    return buffer if filled == length else buffer[:filled]


def _checked_tensor(
    stream: Any, relative_path: str, info: Any, index: Any, expected: ExpectedSums | None, fresh: bool
) -> torch.Tensor:
    """One tensor blob, read once and checked (its stored bytes, then the tensor against the snapshot), then decoded.

    The tensor is a view of the bytes read (``tensor_decode.py``): no copy. With
    ``fresh``, of a buffer of its own, which it keeps; without, of the reading thread's
    buffer, valid until the thread reads its next blob. The stored
    bytes are hashed once, in three spans (torch.save's framing before the data, the
    data, the framing after), combined into the blob's checksum (``crc_combine.py``);
    the data span's own checksum is the tensor's, compared with the host snapshot's.
    Small blobs, and any that are not torch.save's plain form, are hashed whole, decoded
    by ``torch.load`` where needed, and the tensor hashed again.
    """
    stream.seek(int(info.offset))
    length = int(info.length)
    buffer: Any = _read_fresh(stream, length) if fresh else _read_into_thread_buffer(stream, length)
    if len(buffer) < length:
        raise _cut_short(relative_path, info, len(buffer), _blob_sums(relative_path, info, expected)[0], expected)
    return _checked_bytes(buffer, relative_path, info, index, expected)


def _checked_bytes(buffer: Any, relative_path: str, info: Any, index: Any, expected: ExpectedSums | None) -> torch.Tensor:
    """``_checked_tensor`` on a blob's bytes in memory (``buffer``: writable, as long as the blob); the tensor views them."""
    key, checksum = _blob_sums(relative_path, info, expected)
    view = memoryview(buffer)
    record = locate(view)  # the zip's directory only: nothing is unpickled before the checksum matched
    data_sum: str | None = None
    if expected is not None:
        update = updater(expected.algorithm)
        if record is not None and record.data_end - record.data_start >= SPLIT_MIN_BYTES:
            start, end = record.data_start, record.data_end
            data = update(view[start:end], 0)
            whole = _blob_checksum(expected.algorithm, view[:start], data, end - start, view[end:])
            data_sum = hex32(data)
        else:
            whole = update(view, 0)
        if hex32(whole) != checksum:
            raise _mismatch(relative_path, info, key, expected)
        expected.check_mac(relative_path, info, key, view)
    del view
    tensor = decode_in_place(buffer, record) if record is not None else None
    in_place = tensor is not None
    if tensor is None:
        # Weights only, as DCP's own reader: no code from the checkpoint runs.
        tensor = torch.load(cast(IO[bytes], ViewReader(memoryview(buffer))), map_location="cpu", weights_only=True)
    saved = None if expected is None else _snapshot_of(expected, index, tensor.shape)
    if saved is not None:
        assert expected is not None
        if in_place and data_sum is not None and saved.algorithm == expected.algorithm:
            matches = data_sum == saved.checksum  # the tensor is these very bytes
        else:
            matches = tensor_checksum(tensor, saved.algorithm) == saved.checksum
        if not matches:
            raise _serialization_fault(expected, index.fqn)
    return tensor


def _serialization_fault(expected: ExpectedSums, fqn: str) -> CorruptCheckpointError:
    return _refusal(
        expected.where,
        f"checksum mismatch for {fqn!r}: the tensor read back differs from the snapshot that was saved, "
        "though the stored bytes match their checksums (a serialization fault)",
    )


def _layout_from_ends(stream: Any, info: Any) -> tuple[BlobEnds, TensorRecord, torch.Tensor] | None:
    """A large tensor blob's framing from its two ends: (the ends, where the data lies, the tensor as a meta tensor).

    None for a small blob or one not in torch.save's plain form: the caller reads it whole.
    """
    length = int(info.length)
    if length < DIRECT_MIN_BYTES:
        return None
    ends = read_ends(stream, int(info.offset), length)
    record = None if ends is None else locate_from_ends(ends)
    saved = None if record is None else decode_meta(record)
    if ends is None or record is None or saved is None:
        return None
    return ends, record, saved


def _snapshot_of(expected: ExpectedSums, index: Any, shape: torch.Size) -> TensorSum | None:
    """The host snapshot's checksum of the tensor stored at ``index``, of this ``shape``; None where there is none.

    None also for another shape: a part of a tensor, which the blob's own checksum covers.
    """
    offset = tuple(int(o) for o in (index.offset or ())) or (0,) * len(shape)
    snapshot = expected.tensors.get((index.fqn, offset))
    return snapshot if snapshot is not None and snapshot.shape == tuple(shape) else None


def _blob_checksum(algorithm: str, before: Any, data_sum: int, data_nbytes: int, after: Any) -> int:
    """A blob's checksum from its data's and the framing's around it (``crc_combine.py``): the data is hashed once."""
    update = updater(algorithm)
    return combine(algorithm, combine(algorithm, update(before, 0), data_sum, data_nbytes), update(after, 0), len(after))


def _framing(ends: BlobEnds, record: TensorRecord) -> tuple[memoryview, memoryview]:
    """The blob's bytes before its tensor's data, and after."""
    return ends.head[: record.data_start], ends.tail[record.data_end - ends.tail_start :]


def _check_data_sums(
    relative_path: str, info: Any, key: str | None, checksum: str | None, expected: ExpectedSums,
    ends: BlobEnds, record: TensorRecord, data_sums: dict[str, int], index: Any, snapshot: TensorSum | None,
) -> None:
    """The blob against the manifest (its framing's sums combined with the data's), then the data against the snapshot."""
    algorithm = expected.algorithm
    before, after = _framing(ends, record)
    if hex32(_blob_checksum(algorithm, before, data_sums[algorithm], record.data_end - record.data_start, after)) != checksum:
        raise _mismatch(relative_path, info, key, expected)
    if snapshot is not None and hex32(data_sums[snapshot.algorithm]) != snapshot.checksum:
        raise _serialization_fault(expected, index.fqn)


def _place_direct(
    stream: Any, relative_path: str, info: Any, reads: list[Any], planner: Any, lock: threading.Lock, expected: ExpectedSums | None
) -> bool:
    """A large tensor's data read straight into the tensor the load restores, checked there; False where that does not apply.

    Only the blob's two ends go through a buffer (``direct_read.py``): they say where the
    data lies and what it is. The stored bytes are checked as ``_checked_tensor`` checks
    them (the blob against the manifest, the data against the snapshot), here after they
    landed in the target: the load has checked them once before (``CHECK``), so a
    mismatch here means they changed between its two reads.
    """
    if len(reads) != 1:
        return False
    read_item = reads[0]
    if any(read_item.storage_offsets) or any(read_item.dest_offsets):
        return False  # a part of the blob, or into a part of the target: resharding copies
    layout = _layout_from_ends(stream, info)
    if layout is None or tuple(read_item.lengths) != tuple(layout[2].shape):
        return False
    ends, record, saved = layout
    with lock:
        target = planner.resolve_tensor(read_item).detach()
    if not takes_data_as_is(target, saved):
        return False
    key, checksum = _blob_sums(relative_path, info, expected)
    data = tensor_bytes(target)
    stream.seek(int(info.offset) + record.data_start)
    got = fill(stream, data)
    # Written behind autograd's back: bump the version as copy_ would, so a graph that saved
    # this tensor refuses to use it, as it would after any in-place write.
    mark_written(target)
    if got < len(data):
        raise _cut_short(relative_path, info, record.data_start + got, key, expected)
    if expected is not None:
        snapshot = _snapshot_of(expected, read_item.storage_index, saved.shape)
        names = {expected.algorithm} | ({snapshot.algorithm} if snapshot is not None else set())
        sums = {name: updater(name)(data, 0) for name in names}
        _check_data_sums(relative_path, info, key, checksum, expected, ends, record, sums, read_item.storage_index, snapshot)
        before, after = _framing(ends, record)
        expected.check_mac(relative_path, info, key, before, data, after)
    with lock:
        planner.commit_tensor(read_item, target)
    return True


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
