"""Checksums of the bytes DCP stores, computed as they are written: no re-read, no extra copy.

DCP's ``_write_item`` brackets every item with ``stream.tell()``
(``offset = tell(); write the item; length = tell() - offset``) and reports
``(file, offset, length)`` in ``WriteResult.storage_data``. The stream handed to
DCP here is a ``ChecksummingStream`` (``checksumming_stream.py``): it checksums the bytes on their way to
storage and closes a segment at each ``tell()``, so each item's checksum is the
segment that matches its ``(offset, length)``. Every byte of a shard lies in some
item (checked: the items must tile the file), so every stored byte is covered,
torch.save framing included.

The pipeline, per checkpoint:

1. every rank's ``write_data`` streams its items through ``ChecksummingStream``
   and returns WriteResults whose ``storage_data`` is a :class:`ChecksummedStorage`
   (DCP's own storage info plus the checksum);
2. DCP gathers all ranks' WriteResults on the coordinator (pickled, with the
   checksums inside), which calls ``finish(metadata, results)``;
3. ``finish`` collects the checksums into :class:`StoredChecksums` and hands DCP
   back its plain storage infos, so ``.metadata`` is exactly what stock DCP writes
   and stock readers need no overlapckpt class to unpickle it;
4. DCP writes ``.metadata.tmp`` through the same checksumming stream, then renames
   it to ``.metadata`` (the commit). The rename is intercepted: the manifest, with
   the checksum of ``.metadata``'s exact bytes, is written first.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
import threading
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointWriteError
from .checksum import hex32
from .checksumming_stream import ChecksummingStream, FileSegments, StreamTimings
from .known_sums import KnownChecksums
from .manifest_records import BlobRecord, ChecksumsRecord, FileRecord

METADATA_FILE_RE = re.compile(r"^(__\d+)?\.metadata$")  # DCP's global or per-rank commit marker


def blob_key(index: Any) -> str:
    """The manifest's name for one stored item: DCP's FQN, with the chunk offset when it is not the origin."""
    offset = getattr(index, "offset", None)
    if offset is None or not any(offset):
        return str(index.fqn)
    return f"{index.fqn}@{','.join(str(int(o)) for o in offset)}"


@dataclass(frozen=True)
class ChecksummedStorage:
    """``WriteResult.storage_data`` on its way from a rank to the coordinator: DCP's info plus the checksum."""

    info: Any  # DCP's _StorageInfo (relative_path, offset, length, ...), handed back to DCP in finish()
    checksum: int
    algorithm: str
    # With a signing key: the blob's MAC, its algorithm and its file's nonce (blob_macs.py).
    mac: str | None = None
    mac_algorithm: str | None = None
    mac_nonce: str | None = None


def _basename(path: str | os.PathLike[str]) -> str:
    return posixpath.basename(os.fspath(path).replace(os.sep, "/"))


class ChecksummingFileSystem:
    """DCP's FileSystem with every written file checksummed, and a hook before ``.metadata`` appears.

    It wraps whatever FileSystem the DCP writer holds (local, fsspec, or a test's
    failing one) and delegates everything else to it.
    """

    def __init__(self, inner: Any, algorithm: str, before_rename_to_metadata: Callable[[str, FileSegments, str], None]) -> None:
        self._inner = inner
        self._algorithm = algorithm
        self._before_commit = before_rename_to_metadata
        self._lock = threading.Lock()  # DCP may write several files from several threads
        self.files: dict[str, FileSegments] = {}
        # Set by the writer before DCP's save: the snapshot's tensors and their checksums.
        self.known_checksums: KnownChecksums | None = None
        # Set by the writer before DCP's save when it signs: every blob gets a MAC (blob_macs.py).
        self.mac_key: bytes | None = None
        self.mac_algorithm: str | None = None

    def timings(self) -> StreamTimings:
        """The sum over the files written so far (their threads' times add up)."""
        total = StreamTimings()
        with self._lock:
            for segments in self.files.values():
                total.add(segments.timings)
        return total

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        if not any(ch in mode for ch in "wa+"):
            with self._inner.create_stream(path, mode) as raw:
                yield raw
            return
        name = _basename(path)
        if METADATA_FILE_RE.match(name):
            # This torch writes the commit marker in place instead of tmp + rename, so the
            # manifest could not be written between its bytes and its appearance.
            raise CheckpointWriteError(
                f"this torch's DCP writer writes {name} in place, not through a temporary file and a "
                "rename; overlapckpt needs the rename to write its manifest first: use torch >= 2.6"
            )
        stream: ChecksummingStream | None = None
        try:
            with self._inner.create_stream(path, mode) as raw:
                stream = ChecksummingStream(raw, self._algorithm, self.known_checksums, self.mac_key, self.mac_algorithm)
                yield stream
                stream.tell()  # closes the last span
                stream.note_end_of_writes()
                stream.finish_macs()
                with self._lock:
                    self.files[name] = stream.segments
        except Exception as e:
            if stream is not None:
                stream.abandon_macs()
            if stream is not None and stream.storage_error is not None and stream.storage_error is not e:
                # The storage's own error, not what the serializer made of it (see storage_error).
                raise stream.storage_error from e
            raise

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        new_name = _basename(new_path)
        if METADATA_FILE_RE.match(new_name):
            written = self.files.get(_basename(path))
            if written is None:
                raise CheckpointWriteError(f"{os.fspath(path)} was not written through the checksumming stream")
            self._before_commit(new_name, written, os.fspath(path))
        self._inner.rename(path, new_path)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


def attach_checksums(
    results: Iterable[Any], files: dict[str, FileSegments], algorithm: str, mac_algorithm: str | None = None
) -> list[Any]:
    """This rank's WriteResults with each item's checksum inside ``storage_data``.

    Raises CheckpointWriteError when an item's span was not seen, or when a file has
    bytes outside every item: a checkpoint is never written with unchecked bytes.
    """
    out = []
    ends: dict[str, list[tuple[int, int]]] = {}
    for result in results:
        info = result.storage_data
        path, offset, length = str(info.relative_path), int(info.offset), int(info.length)
        segments = files.get(path)
        span = (offset, offset + length)
        checksum = segments.spans.get(span) if segments is not None else None
        if checksum is None and length == 0:
            checksum = 0
        if checksum is None:
            raise CheckpointWriteError(
                f"item {blob_key(result.index)!r} of {path} (bytes {offset}..{offset + length}) was not written "
                "between two tell() calls of the stream; this DCP serialization format is not supported "
                "(use the default torch_save format)"
            )
        ends.setdefault(path, []).append(span)
        mac = segments.macs.get(span) if segments is not None else None
        nonce = segments.mac_nonce if segments is not None else None
        stored = ChecksummedStorage(info, checksum, algorithm, mac, mac_algorithm if mac is not None else None, nonce)
        out.append(_with_storage_data(result, stored))
    for path, spans in ends.items():
        _check_tiling(path, spans, files[path].nbytes)
    return out


_WRITE_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(WriteResult))


def _with_storage_data(result: Any, storage_data: Any) -> Any:
    """``result`` with another ``storage_data``: DCP's WriteResult built directly (``dataclasses.replace`` costs 5 us
    an item, a quarter second for 40,000); any other result type through ``replace``."""
    if type(result) is WriteResult and _WRITE_RESULT_FIELDS == ("index", "size_in_bytes", "storage_data"):
        return WriteResult(result.index, result.size_in_bytes, storage_data)
    return dataclasses.replace(result, storage_data=storage_data)


def _check_tiling(path: str, spans: list[tuple[int, int]], nbytes: int) -> None:
    position = 0
    for start, end in sorted(spans):
        if start != position:
            raise CheckpointWriteError(f"bytes {position}..{start} of {path} belong to no item; they would go unchecked")
        position = end
    if position != nbytes:
        raise CheckpointWriteError(f"bytes {position}..{nbytes} of {path} belong to no item; they would go unchecked")


@dataclass(frozen=True)
class StoredBlob:
    key: str
    offset: int
    length: int
    checksum: int
    mac: str | None = None  # with a signing key (blob_macs.py); none for an empty blob


@dataclass(frozen=True)
class StoredChecksums:
    """Every rank's blob checksums, and ``.metadata``'s: the manifest's ``checksums`` section."""

    algorithm: str
    files: dict[str, list[StoredBlob]]  # shard file -> its blobs, by offset
    metadata_name: str = ".metadata"
    metadata_nbytes: int = 0
    metadata_checksum: int = 0
    metadata_bytes: bytes = b""  # .metadata's exact bytes, for a signature (never serialized)
    mac_algorithm: str | None = None  # with a signing key: every blob's MAC (blob_macs.py)
    mac_nonces: dict[str, str] = field(default_factory=dict)  # shard file -> its nonce

    @classmethod
    def from_results(cls, results: list[list[Any]], algorithm: str, mac_algorithm: str | None = None) -> StoredChecksums:
        """Collect the checksums that travelled inside all ranks' WriteResults (the coordinator's view).

        ``mac_algorithm``: the coordinator signs, so every rank's non-empty blob must carry a MAC of it.
        """
        files: dict[str, list[StoredBlob]] = {}
        nonces: dict[str, str] = {}
        for rank, rank_results in enumerate(results):
            for result in rank_results:
                data = result.storage_data
                if not isinstance(data, ChecksummedStorage):
                    raise CheckpointWriteError(
                        f"rank {rank}'s result for {blob_key(result.index)!r} carries no checksum; every rank must "
                        "write through overlapckpt's CheckpointStore.make_writer"
                    )
                if data.algorithm != algorithm:
                    raise CheckpointWriteError(
                        f"rank {rank} checksummed with {data.algorithm!r}, the coordinator with {algorithm!r}; set "
                        "the same OVERLAPCKPT_CHECKSUM (and install the same packages) on every rank"
                    )
                info = data.info
                if mac_algorithm is not None and int(info.length) > 0 and (data.mac is None or data.mac_algorithm != mac_algorithm):
                    raise CheckpointWriteError(
                        f"rank {rank} stored {blob_key(result.index)!r} without a {mac_algorithm} MAC, and the coordinator "
                        f"signs (found {data.mac_algorithm!r}); give every rank the same signing_key (or "
                        "OVERLAPCKPT_SIGNING_KEY) and OVERLAPCKPT_BLOB_MAC"
                    )
                mac = data.mac if mac_algorithm is not None else None
                blob = StoredBlob(blob_key(result.index), int(info.offset), int(info.length), data.checksum, mac)
                files.setdefault(str(info.relative_path), []).append(blob)
                if mac is not None and data.mac_nonce is not None:
                    nonces[str(info.relative_path)] = data.mac_nonce
        for blobs in files.values():
            blobs.sort(key=lambda b: b.offset)
        return cls(algorithm=algorithm, files=files, mac_algorithm=mac_algorithm, mac_nonces=nonces)

    def to_record(self) -> ChecksumsRecord:
        """The manifest's ``checksums`` section, built directly from what was stored (nothing to validate)."""
        files = {
            name: FileRecord(
                nbytes=blobs[-1].offset + blobs[-1].length if blobs else 0,
                blobs=tuple(BlobRecord(b.key, b.offset, b.length, hex32(b.checksum), b.mac) for b in blobs),
                mac_nonce=self.mac_nonces.get(name),
            )
            for name, blobs in self.files.items()
        }
        return ChecksumsRecord(
            algorithm=self.algorithm,
            metadata_name=self.metadata_name,
            metadata_nbytes=self.metadata_nbytes,
            metadata_checksum=hex32(self.metadata_checksum),
            files=files,
            mac_algorithm=self.mac_algorithm,
        )

    def to_json(self) -> dict[str, Any]:
        return self.to_record().to_json()


def plain_results(results: list[list[Any]]) -> list[list[Any]]:
    """The WriteResults with DCP's own storage infos back in place, for ``.metadata``."""
    return [
        [
            _with_storage_data(r, r.storage_data.info) if isinstance(r.storage_data, ChecksummedStorage) else r
            for r in rank_results
        ]
        for rank_results in results
    ]
