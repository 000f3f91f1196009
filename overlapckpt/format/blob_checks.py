"""One blob of a load, read and checked against the manifest before anything decodes it.

Runs in the process that loads, on the reader's threads (``blob_reader.py``, which decides
which blobs are read and where their tensors go). A blob is checked whole, or, when it is
a large tensor, in three spans combined (``crc_combine.py``) whose data span is also the
tensor's checksum; or its data is read straight into the tensor the load restores and
checked there (``direct_read.py``, the load's two passes: it was checked once before).
Decoding is weights only: nothing read from storage runs code. Separate from the reader
so that the order of the checks for one blob reads in one place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import IO, Any, cast

import torch

from ..errors import CorruptCheckpointError
from .checksum import hex32, updater
from .crc_combine import combine
from .direct_read import DIRECT_MIN_BYTES, fill, mark_written, read_ends, takes_data_as_is, tensor_bytes
from .expected_sums import ExpectedSums, TensorSum, verification_refusal
from .known_framing import StoredAs, known_framings
from .manifest import tensor_checksum
from .tensor_decode import BlobEnds, TensorRecord, ViewReader, decode_in_place, decode_meta, locate, locate_from_ends

# A tensor's bytes at least this long are hashed once, with the checksums of the spans
# combined (~0.2 ms a blob); shorter ones are cheaper to hash twice.
SPLIT_MIN_BYTES = 4 << 20

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
        raise verification_refusal(expected.where, f"{span} is not a blob the manifest lists, though .metadata points at it")
    key, checksum = sums
    if getattr(info, "transform_descriptors", None):
        raise verification_refusal(expected.where, f"{key!r} in {span} was stored through DCP extensions, which overlapckpt never writes")
    return key, checksum


def _cut_short(relative_path: str, info: Any, got: int, key: str | None, expected: ExpectedSums | None) -> CorruptCheckpointError:
    offset, length = int(info.offset), int(info.length)
    if expected is None:
        return CorruptCheckpointError(f"{relative_path} (bytes {offset}..{offset + length}) is cut short at byte {offset + got}")
    span = f"{expected.where}/{relative_path} (bytes {offset}..{offset + length})"
    return verification_refusal(expected.where, f"{key!r} in {span} is cut short at byte {offset + got}: the file is truncated")


def _mismatch(relative_path: str, info: Any, key: str | None, expected: ExpectedSums) -> CorruptCheckpointError:
    offset, length = int(info.offset), int(info.length)
    return verification_refusal(
        expected.where, f"checksum mismatch for {key!r} in {expected.where}/{relative_path} (bytes {offset}..{offset + length})"
    )


def checked_blob(
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


def checked_tensor(
    stream: Any,
    relative_path: str,
    info: Any,
    index: Any,
    expected: ExpectedSums | None,
    fresh: bool,
    stored_as: StoredAs | None = None,
) -> torch.Tensor:
    """One tensor blob, read once and checked (its stored bytes, then the tensor against the snapshot), then decoded.

    The tensor is a view of the bytes read (``tensor_decode.py``): no copy. With
    ``fresh``, of a buffer of its own, which it keeps; without, of the reading thread's
    buffer, valid until the thread reads its next blob. The stored
    bytes are hashed once, in three spans (torch.save's framing before the data, the
    data, the framing after), combined into the blob's checksum (``crc_combine.py``);
    the data span's own checksum is the tensor's, compared with the host snapshot's.
    Small blobs, and any that are not torch.save's plain form, are hashed whole, decoded
    by ``torch.load`` where needed, and the tensor hashed again. ``stored_as``: the dtype
    and shape ``.metadata`` gives the blob's chunk, whose framing a small blob is compared
    with before any parsing (``known_framing.py``).
    """
    stream.seek(int(info.offset))
    length = int(info.length)
    buffer: Any = _read_fresh(stream, length) if fresh else _read_into_thread_buffer(stream, length)
    if len(buffer) < length:
        raise _cut_short(relative_path, info, len(buffer), _blob_sums(relative_path, info, expected)[0], expected)
    return checked_bytes(buffer, relative_path, info, index, expected, stored_as)


def checked_bytes(
    buffer: Any, relative_path: str, info: Any, index: Any, expected: ExpectedSums | None, stored_as: StoredAs | None = None
) -> torch.Tensor:
    """``checked_tensor`` on a blob's bytes in memory (``buffer``: writable, as long as the blob); the tensor views them."""
    key, checksum = _blob_sums(relative_path, info, expected)
    view = memoryview(buffer)
    # A small blob in the framing torch.save gives the tensor .metadata names: compared, not parsed.
    known = known_framings.tensor(buffer, *stored_as) if stored_as is not None else None
    # Else the zip's directory only: nothing is unpickled before the checksum matched.
    record = locate(view) if known is None else None
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
    tensor: torch.Tensor | None = known
    if tensor is None and record is not None:
        tensor = decode_in_place(buffer, record)
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
    return verification_refusal(
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


@dataclass(frozen=True)
class _ListedBlob:
    """One blob being checked: its file and DCP's storage info for it, with the key and checksum the manifest lists."""

    relative_path: str
    info: Any  # DCP's _StorageInfo: offset and length in the file
    key: str | None
    checksum: str | None


def _check_placed(
    blob: _ListedBlob, expected: ExpectedSums, ends: BlobEnds, record: TensorRecord, data: memoryview, index: Any,
    snapshot: TensorSum | None,
) -> None:
    """Data placed in the target: the blob against the manifest (its framing's sums combined with the data's), then
    the data against the snapshot, then the blob's MAC."""
    algorithm = expected.algorithm
    names = {algorithm} | ({snapshot.algorithm} if snapshot is not None else set())
    data_sums = {name: updater(name)(data, 0) for name in names}
    before, after = _framing(ends, record)
    if hex32(_blob_checksum(algorithm, before, data_sums[algorithm], record.data_end - record.data_start, after)) != blob.checksum:
        raise _mismatch(blob.relative_path, blob.info, blob.key, expected)
    if snapshot is not None and hex32(data_sums[snapshot.algorithm]) != snapshot.checksum:
        raise _serialization_fault(expected, index.fqn)
    expected.check_mac(blob.relative_path, blob.info, blob.key, before, data, after)


def place_direct(
    stream: Any, relative_path: str, info: Any, reads: list[Any], planner: Any, lock: threading.Lock, expected: ExpectedSums | None
) -> bool:
    """A large tensor's data read straight into the tensor the load restores, checked there; False where that does not apply.

    Only the blob's two ends go through a buffer (``direct_read.py``): they say where the
    data lies and what it is. The stored bytes are checked as ``checked_tensor`` checks
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
        listed = _ListedBlob(relative_path, info, key, checksum)
        _check_placed(listed, expected, ends, record, data, read_item.storage_index, snapshot)
    with lock:
        planner.commit_tensor(read_item, target)
    return True

