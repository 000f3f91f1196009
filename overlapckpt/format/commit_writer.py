"""The DCP storage writer that keeps the commit rule: the manifest is written before ``.metadata`` appears.

Runs in the writer process. ``CheckpointStore.make_writer`` builds it over DCP's local or
fsspec writer; it checksums every file it writes (``blobsums.py``) and, when DCP renames
``.metadata.tmp`` to ``.metadata`` (the commit), first calls ``before_commit`` with the
checksums of every stored blob and of ``.metadata``'s bytes, which writes the manifest.
Separate from ``storage.py``, which holds the layout and the store's file operations: this
is the one place DCP's writer is extended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from torch.futures import Future

from ..errors import CheckpointWriteError
from . import direct_shard_write
from .blobsums import ChecksummingFileSystem, StoredChecksums, attach_checksums, plain_results
from .checksum import default_algorithm
from .checksumming_stream import FileSegments

# Called with the checksums of every stored blob and of .metadata, before .metadata appears.
BeforeCommit = Callable[[StoredChecksums], None]


class ManifestFirstWriting:
    """What ``manifest_first_writer_class`` adds to a DCP storage writer: checksums of what it stores, and ``before_commit``.

    A mixin ahead of the writer class in the order of bases: ``super()`` is DCP's writer,
    whose ``__init__`` assigns ``self.fs`` through the property here.
    See :mod:`overlapckpt.format.blobsums` for how the checksums are computed and how they
    travel from every rank to the coordinator's ``finish()``.
    """

    def __init__(self, *args: Any, before_commit: BeforeCommit, wants_metadata_bytes: bool = False, **kwargs: Any) -> None:
        # Set before DCP's __init__, which assigns self.fs (wrapped by the property below).
        self._wants_metadata_bytes = wants_metadata_bytes
        self._algorithm = default_algorithm()
        self._before_commit = before_commit
        self._pending: StoredChecksums | None = None
        self._committed = False
        super().__init__(*args, **kwargs)

    # Whatever FileSystem DCP (or a subclass, or a test) assigns is wrapped, so
    # every file it writes is checksummed on the way out.
    @property
    def fs(self) -> ChecksummingFileSystem:
        return self._checksumming_fs

    @fs.setter
    def fs(self, inner: Any) -> None:
        self._checksumming_fs = ChecksummingFileSystem(inner, self._algorithm, self._commit_manifest)

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)  # type: ignore[misc]  # DCP's writer, the next base
        self._checksumming_fs.files.clear()  # a reused writer never reports an older save's spans

    def write_data(self, plan: Any, planner: Any) -> Future:
        if direct_shard_write.applies(self, plan):  # DCP's files, without its per-item costs
            written = direct_shard_write.write_data(self, plan, planner)
        else:
            future = super().write_data(plan, planner)  # type: ignore[misc]  # DCP's writer, the next base
            future.wait()
            written = future.value()
        fs = self._checksumming_fs
        results = attach_checksums(written, fs.files, self._algorithm, fs.mac_algorithm if fs.mac_key is not None else None)
        out: Future = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Any, results: Any) -> None:
        # Only the coordinator gets here, with every rank's results.
        fs = self._checksumming_fs
        signs = fs.mac_key is not None
        self._pending = StoredChecksums.from_results(results, self._algorithm, fs.mac_algorithm if signs else None)
        self._committed = False
        super().finish(metadata, plain_results(results))  # type: ignore[misc]  # DCP's writer, the next base
        if not self._committed:
            raise CheckpointWriteError(
                "DCP finished without renaming its metadata into place, so no manifest was written; "
                "this torch's DCP writer is not supported (use torch >= 2.6)"
            )

    def _commit_manifest(self, metadata_name: str, written: FileSegments, source_path: str) -> None:
        # DCP has written .metadata.tmp and is about to rename it to .metadata (the
        # commit): the manifest must exist before, so every committed checkpoint is verifiable.
        if self._pending is None:
            raise CheckpointWriteError(f"{metadata_name} is being committed before finish() collected the checksums")
        spans = list(written.spans.values())
        if len(spans) > 1:
            raise CheckpointWriteError(f"{metadata_name} was written in {len(spans)} spans; expected one")
        metadata_bytes = b""
        if self._wants_metadata_bytes:  # a signature covers .metadata's exact bytes: read back (small)
            with self._checksumming_fs._inner.create_stream(source_path, "rb") as f:
                metadata_bytes = f.read()
        checksums = dataclasses.replace(
            self._pending,
            metadata_name=metadata_name,
            metadata_nbytes=written.nbytes,
            metadata_checksum=spans[0] if spans else 0,
            metadata_bytes=metadata_bytes,
        )
        self._before_commit(checksums)
        self._committed = True


def manifest_first_writer_class(base: type) -> type:
    """A DCP storage writer that checksums what it stores and calls ``before_commit`` right before ``.metadata``."""

    class ManifestFirstWriter(ManifestFirstWriting, base):
        pass

    ManifestFirstWriter.__name__ = f"ManifestFirst{base.__name__}"
    return ManifestFirstWriter
