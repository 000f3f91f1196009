"""Check a committed checkpoint's stored bytes against its manifest, streaming, without the model.

What is checked, in order:

1. the manifest against its own CRC-32 (:func:`read_manifest`);
2. ``.metadata``'s size and checksum, before anything unpickles it;
3. each shard: its size, then every blob in offset order (the blobs tile the file,
   so this is every byte of it), each read in chunks of at most
   ``VERIFY_CHUNK_BYTES`` that never cross a blob boundary;
4. with a signing key: the manifest's signature and ``.metadata``'s SHA-256
   (``signing.py``), and each blob's and framework file's MAC (``blob_macs.py``).

Memory stays at one chunk whatever the checkpoint's size, so a checkpoint larger
than RAM verifies. A blob that differs is reported by file and key; reading goes on,
so one run names every damaged blob.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, SignatureError
from .blob_macs import BlobMac, BlobMacs, same_mac
from .checksum import hex32, updater
from .manifest import DATA_FILE_RE, LEGACY_FORMAT_VERSION, MANIFEST_NAME, Manifest, parse_manifest, step_of_name
from .manifest_records import ChecksumsRecord, ExportRecord
from .signing import check_signature
from .storage import CheckpointStore, translate_read_errors

# The only files verify reads: DCP's data files (DATA_FILE_RE, manifest.py) and its commit
# marker. A manifest naming anything else ("../../etc/passwd") is damaged or crafted, and is
# refused unread.
METADATA_RE = re.compile(r"(__[0-9]+)?\.metadata", re.ASCII)
# And the framework files a checkpoint may carry (writer/exports.py), by exact name.
EXPORT_FILE_NAMES = frozenset({"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"})

# One read's size at most: bounds verify's memory, and is large enough that a read
# costs far more in transfer than in per-call overhead (S3 ranged GETs included).
VERIFY_CHUNK_BYTES = 16 << 20


@dataclass
class VerifyReport:
    """The outcome of verifying one checkpoint: what was read, and each problem found."""

    path: str
    step: int
    algorithm: str = ""
    files: int = 0  # shard files checked
    blobs: int = 0  # blobs checked
    nbytes: int = 0  # bytes read and checksummed, .metadata included
    problems: list[str] = field(default_factory=list)  # each names the file, and the blob where one applies

    @property
    def ok(self) -> bool:
        return not self.problems


def read_manifest(store: CheckpointStore, name: str) -> Manifest:
    """The manifest of committed checkpoint ``name``, checked against its own checksum.

    CorruptCheckpointError if it is missing, damaged or unparsable; CheckpointReadError
    if storage could not be read.
    """
    return read_manifest_and_bytes(store, name)[0]


def read_manifest_and_bytes(store: CheckpointStore, name: str) -> tuple[Manifest, bytes]:
    """``read_manifest``'s manifest, with the exact bytes it was parsed from: a digest of them names that manifest."""
    where = store.checkpoint_url(name)
    with translate_read_errors(where):
        try:
            raw = store.read_bytes(name, MANIFEST_NAME)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"{where} is committed but has no {MANIFEST_NAME}; it was not written by overlapckpt"
            ) from e
    manifest = parse_manifest(raw, f"{where}/{MANIFEST_NAME}")
    check_name_matches(name, manifest, where)
    return manifest, raw


def check_name_matches(name: str, manifest: Manifest, where: str) -> None:
    """Refuse a checkpoint whose directory name is not the one its manifest was written under.

    Files copied or renamed into another step's directory (``step-2``'s into
    ``step-000000006``) would load as that step; with a key, the signed manifest's step and
    run are what the name must agree with, so a signature binds the name too.
    """
    version = step_of_name(name)
    if version is not None and version != manifest.step:
        raise CorruptCheckpointError(
            f"{where} is named for step {version}, but its manifest holds step {manifest.step}: its files were copied "
            "or renamed from another checkpoint; refused"
        )
    parts = name.split("-")
    if version is not None and len(parts) == 3 and manifest.run_id is not None and not manifest.run_id.startswith(parts[2]):
        raise CorruptCheckpointError(
            f"{where} is named for run {parts[2]}, but its manifest was written by run {manifest.run_id[:8]}: its files "
            "were copied or renamed from another run's checkpoint; refused"
        )


@dataclass(frozen=True)
class VerifyShare:
    """Which shard files one ``verify_checkpoint`` call reads: every ``world_size``-th from ``rank``, or exactly ``files``.

    ``.metadata`` and the framework files are rank 0's either way.
    """

    rank: int = 0
    world_size: int = 1
    # These shard files instead of the rank's share: a node-local tier's directory holds only
    # the files its ranks read (restore/plan.py).
    files: Collection[str] | None = None

    def picks(self, index: int, filename: str) -> bool:
        """Whether the ``index``-th shard file (in name order), ``filename``, is this share's."""
        return index % self.world_size == self.rank if self.files is None else filename in self.files


WHOLE_CHECKPOINT = VerifyShare()  # one process reads every file


def verify_checkpoint(
    store: CheckpointStore,
    name: str,
    manifest: Manifest | None = None,
    share: VerifyShare = WHOLE_CHECKPOINT,
    signing_key: bytes | None = None,
    read_blobs: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Verify every stored byte of checkpoint ``name`` against its manifest, blob by blob.

    ``share``: verify only this rank's share of the files (every ``world_size``-th shard
    file, and ``.metadata`` on rank 0), so that the ranks of a distributed load together
    read the checkpoint about once; their outcomes are combined by the caller. Its
    ``files``: verify these shard files on this rank instead of its share (a node-local
    tier's directory holds only the files its ranks read, ``restore/plan.py``);
    ``.metadata`` is still rank 0's. ``signing_key``: check the signature too, with the
    same read of ``.metadata`` (rank 0; the CLI verifies as one rank). ``read_blobs=False``:
    check ``.metadata`` and each shard's kind and size only, not its blobs, and not the
    framework files: what ``load`` checks before its one read, which checks each blob as it
    arrives (``blob_reader.py``). ``on_progress(bytes_read, bytes_total)`` is called as the
    shards are read (the CLI's progress line).

    Raises CorruptCheckpointError when the manifest itself is damaged or cannot be
    verified, CheckpointReadError when storage cannot be read, and ConfigError when the
    checksum algorithm's package is missing here. Damaged files and blobs are listed
    in the report's ``problems``.
    """
    where = store.checkpoint_url(name)
    if manifest is None:
        manifest = read_manifest(store, name)
    report = VerifyReport(path=where, step=manifest.step)
    sums = _verifiable_checksums(manifest, where)
    report.algorithm = sums.algorithm
    metadata: dict[str, Any] = {"name": sums.metadata_name, "nbytes": sums.metadata_nbytes, "checksum": sums.metadata_checksum}
    shards = {f: (e.nbytes, [(b.key, b.offset, b.length, b.checksum) for b in e.blobs]) for f, e in sums.files.items()}
    exports = {f: (e.nbytes, e.crc32) for f, e in manifest.exports.items()}
    _check_listed_names(where, str(metadata["name"]), shards, exports)
    mine = [(filename, entry) for index, (filename, entry) in enumerate(sorted(shards.items())) if share.picks(index, filename)]
    # Every byte this call reads: its shards, and on rank 0 .metadata and the framework files too.
    total_nbytes = sum(nbytes for _, (nbytes, _) in mine)
    if share.rank == 0:
        total_nbytes += int(metadata["nbytes"]) + (sum(nbytes for nbytes, _ in exports.values()) if read_blobs else 0)

    def progress() -> None:
        if on_progress is not None:
            on_progress(report.nbytes, total_nbytes)

    reading = _Reading(store, name, updater(report.algorithm), report, progress)
    with translate_read_errors(where):
        if share.rank == 0:
            _verify_signed_metadata(reading, metadata, manifest, signing_key)
        macs = _blob_macs(manifest, where, signing_key, report, share.rank == 0) if read_blobs else None
        if share.rank == 0:
            for filename in sorted(exports) if read_blobs else ():
                _verify_export(store, name, filename, manifest.exports[filename], report, macs)
        for filename, (nbytes, blobs) in mine:
            if read_blobs:
                _verify_file(reading, filename, nbytes, blobs, macs)
            else:
                _check_file_size(store, name, filename, nbytes, report)
    return report


def _verifiable_checksums(manifest: Manifest, where: str) -> ChecksumsRecord:
    """The manifest's checksums of the stored bytes; CorruptCheckpointError for format 1, which has none."""
    sums = manifest.checksums
    if manifest.format_version == LEGACY_FORMAT_VERSION or sums is None:
        raise CorruptCheckpointError(
            f"{where} was written by overlapckpt format {LEGACY_FORMAT_VERSION}, whose manifest has no checksums of "
            "the stored bytes, so it cannot be verified; load it with verify=False"
        )
    return sums


def _check_listed_names(where: str, metadata_name: str, shards: Collection[str], exports: Collection[str]) -> None:
    """Refuse, unread, a manifest that lists a file overlapckpt never writes (a DCP file or a framework file)."""
    for filename, pattern in [(metadata_name, METADATA_RE)] + [(f, DATA_FILE_RE) for f in shards]:
        if not pattern.fullmatch(filename):
            raise CorruptCheckpointError(
                f"{where}/{MANIFEST_NAME} lists the file {filename!r}, which is not a DCP file name: refused unread "
                "(the manifest is damaged or crafted)"
            )
    for filename in exports:
        if filename not in EXPORT_FILE_NAMES:
            raise CorruptCheckpointError(
                f"{where}/{MANIFEST_NAME} lists the export {filename!r}, which is not a framework file overlapckpt writes: "
                "refused unread (the manifest is damaged or crafted)"
            )


@dataclass(frozen=True)
class _Reading:
    """What every shard file's check in one ``verify_checkpoint`` call shares: where it reads, how it hashes, where it reports."""

    store: CheckpointStore
    name: str  # the checkpoint's directory under the store's root
    update: Callable[[Any, int], int]  # the manifest's checksum algorithm, one chunk at a time
    report: VerifyReport
    progress: Callable[[], None]  # called after each chunk read


def _verify_signed_metadata(reading: _Reading, expected: dict[str, Any], manifest: Manifest, signing_key: bytes | None) -> None:
    """Rank 0's part: ``.metadata`` against the manifest, then, with a key, the signature over both, from the same read."""
    metadata_bytes = _verify_metadata(reading.store, reading.name, expected, reading.update, reading.report)
    if signing_key is not None and metadata_bytes is not None:
        try:
            check_signature(manifest.raw, metadata_bytes, signing_key, reading.report.path)
        except SignatureError as e:
            reading.report.problems.append(str(e))


def _blob_macs(manifest: Manifest, where: str, signing_key: bytes | None, report: VerifyReport, reports: bool) -> BlobMacs | None:
    """With a key, each blob's MAC to check; a signed manifest without them is a problem (``reports``: listed here)."""
    if signing_key is None:
        return None
    try:
        return BlobMacs.from_manifest(manifest, where, signing_key)
    except SignatureError as e:
        if reports:
            report.problems.append(str(e))
        return None


def _check_file_size(store: CheckpointStore, name: str, filename: str, nbytes: int, report: VerifyReport) -> None:
    report.files += 1
    if not _regular_file(store, name, filename, report):
        return
    stored_nbytes = store.file_size(name, filename)
    if stored_nbytes != nbytes:
        report.problems.append(_size_problem(report.path, filename, stored_nbytes, nbytes))


def _size_problem(where: str, filename: str, stored_nbytes: int, nbytes: int) -> str:
    return f"{where}/{filename} is {stored_nbytes} bytes, the manifest says {nbytes} (truncated or extended)"


def _verify_export(
    store: CheckpointStore, name: str, filename: str, export: ExportRecord, report: VerifyReport, macs: BlobMacs | None
) -> None:
    """A framework file (writer/exports.py): its size and zlib CRC-32, streamed; its MAC too with a key."""
    report.files += 1
    if not _regular_file(store, name, filename, report):
        return
    mac = None
    if macs is not None:
        if export.mac is None or export.mac_nonce is None:
            report.problems.append(f"{report.path}/{filename} (a framework file) has no MAC in the signed manifest")
        else:
            mac = BlobMac(macs.signing_key, macs.algorithm, export.mac_nonce, 0)
    checksum, read = 0, 0
    with store.open_read(name, filename) as f:
        while chunk := f.read(VERIFY_CHUNK_BYTES):
            checksum = zlib.crc32(chunk, checksum)
            if mac is not None:
                mac.update(chunk)
            read += len(chunk)
    report.nbytes += read
    if read != export.nbytes:
        report.problems.append(f"{report.path}/{filename} is {read} bytes, the manifest says {export.nbytes}")
    elif checksum & 0xFFFFFFFF != export.crc32:
        report.problems.append(f"checksum mismatch for {report.path}/{filename} (a framework file)")
    elif mac is not None and export.mac is not None and not same_mac(export.mac, mac.hexdigest()):
        report.problems.append(f"MAC mismatch for {report.path}/{filename} (a framework file): forged or damaged")


def _verify_metadata(
    store: CheckpointStore, name: str, expected: dict[str, Any], update: Callable[[Any, int], int], report: VerifyReport
) -> bytes | None:
    """Check ``.metadata``; its bytes (for the signature), or None if it was refused unread."""
    filename = str(expected["name"])
    if not _regular_file(store, name, filename, report):
        return None
    raw = store.read_bytes(name, filename)
    report.nbytes += len(raw)
    if len(raw) != int(expected["nbytes"]):
        report.problems.append(f"{report.path}/{filename} is {len(raw)} bytes, the manifest says {expected['nbytes']}")
    elif hex32(update(raw, 0)) != expected["checksum"]:
        report.problems.append(f"checksum mismatch for {report.path}/{filename} (DCP's metadata)")
    return raw


def _verify_file(reading: _Reading, filename: str, nbytes: int, blobs: list[tuple[str, int, int, str]], macs: BlobMacs | None) -> None:
    """One shard: its kind and size, then every blob in offset order, each hashed in chunks (and MACed, with a key)."""
    store, name, update, report, progress = reading.store, reading.name, reading.update, reading.report, reading.progress
    report.files += 1
    if not _regular_file(store, name, filename, report):
        return
    if sum(length for _, _, length, _ in blobs) != nbytes:
        raise CorruptCheckpointError(f"the manifest of {report.path} lists blobs of {filename} that do not add up to its {nbytes} bytes")
    stored_nbytes = store.file_size(name, filename)
    if stored_nbytes != nbytes:
        report.problems.append(_size_problem(report.path, filename, stored_nbytes, nbytes))
    position = 0
    with store.open_read(name, filename) as f:
        for key, offset, length, expected in sorted(blobs, key=lambda b: b[1]):
            if offset != position:  # the writer checked that blobs tile the file; the manifest says otherwise
                raise CorruptCheckpointError(
                    f"the manifest of {report.path} lists {filename}'s blobs with a gap at byte {position}; it is damaged"
                )
            checksum, read = 0, 0
            mac = None if macs is None else macs.new_mac(filename, offset)
            while read < length:
                chunk = f.read(min(length - read, VERIFY_CHUNK_BYTES))
                if not chunk:
                    break
                checksum = update(chunk, checksum)
                if mac is not None:
                    mac.update(chunk)
                read += len(chunk)
                report.nbytes += len(chunk)
                progress()
            report.blobs += 1
            position = offset + length
            if read < length:
                report.problems.append(
                    f"{key!r} in {report.path}/{filename} (bytes {offset}..{offset + length}) is cut short at byte "
                    f"{offset + read}: the file is truncated"
                )
                return
            if hex32(checksum) != expected:
                report.problems.append(
                    f"checksum mismatch for {key!r} in {report.path}/{filename} (bytes {offset}..{offset + length})"
                )
            elif macs is not None and not macs.is_mac_of(filename, offset, length, None if mac is None else mac.hexdigest()):
                report.problems.append(
                    f"MAC mismatch for {key!r} in {report.path}/{filename} (bytes {offset}..{offset + length}): "
                    "forged or damaged"
                )


def _regular_file(store: CheckpointStore, name: str, filename: str, report: VerifyReport) -> bool:
    """Only a regular file is read: a FIFO would hang the read, a link could point anywhere."""
    try:
        kind = store.file_kind(name, filename)
    except FileNotFoundError:
        return True  # reading it raises the missing-file error verify already reports
    if kind != "file":
        what = "symbolic link" if kind == "link" else "FIFO, device or directory"
        report.problems.append(f"{report.path}/{filename} is not a regular file (a {what}): refused unread")
        return False
    return True


def describe_problems(report: VerifyReport, limit: int = 3) -> str:
    """The first few problems of a report, in one line."""
    shown = "; ".join(report.problems[:limit])
    more = len(report.problems) - limit
    return shown + (f"; and {more} more" if more > 0 else "")
