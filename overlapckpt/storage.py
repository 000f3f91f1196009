"""The storage layout under a root URL, and the commit rule.

::

    <root>/
      step-000001000/        one checkpoint, DCP format
        __0_0.distcp ...     shards, written first
        overlapckpt.json     manifest, written next
        .metadata            written last by DCP: its presence is the commit
      latest                 name of the newest committed checkpoint, updated after the commit

A directory counts as a checkpoint only once ``.metadata`` exists. DCP writes
``.metadata.tmp`` and renames it: atomic on a local filesystem, and on S3 the
rename is a server-side copy that makes the object appear whole, so a reader never
sees a half-written checkpoint as committed. ``latest`` is written atomically too
(rename locally, a single PUT on S3). Retention removes ``.metadata`` first, so a
checkpoint being deleted stops counting before any shard disappears.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import Any

from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from .errors import ConfigError
from .manifest import LATEST_NAME, MANIFEST_NAME, METADATA_NAME, step_of_name


def _fsspec_dcp_classes() -> tuple[type, type]:
    # FsspecWriter/Reader moved between torch releases; look them up where this torch has them.
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


def _manifest_before_commit(base: type) -> type:
    """A DCP storage writer that calls ``before_commit`` right before it writes ``.metadata``."""

    class ManifestFirstWriter(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, before_commit: Callable[[], None], **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._before_commit = before_commit

        def finish(self, metadata: Any, results: Any) -> None:
            # The manifest must exist before the commit marker, so that every
            # committed checkpoint is verifiable.
            self._before_commit()
            super().finish(metadata, results)

    ManifestFirstWriter.__name__ = f"ManifestFirst{base.__name__}"
    return ManifestFirstWriter


class CheckpointStore:
    """Checkpoints under one root: local directory or fsspec URL (``s3://bucket/prefix``).

    Subclass to change how bytes reach storage; the writer process builds the store
    from its import path, so a subclass works there too.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise ConfigError(f"checkpoint path {root!r} is invalid; pass a directory path or a URL such as s3://bucket/prefix")
        self.root = os.fspath(root)
        self.storage_options = dict(storage_options or {})
        try:
            self.fs, self.root_path = url_to_fs(self.root, **self.storage_options)
        except (ValueError, ImportError) as e:
            raise ConfigError(
                f"cannot open checkpoint path {self.root!r}: {e}; for s3:// install overlapckpt[s3] and pass "
                "storage_options (endpoint_url, key, secret, ...)"
            ) from e
        protocol = self.fs.protocol
        self.is_local = "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))
        if self.is_local:
            self.root_path = os.path.abspath(self.root_path)

    # ---- paths -----------------------------------------------------------------

    def _join(self, *parts: str) -> str:
        if self.is_local:
            return os.path.join(self.root_path, *parts)
        return posixpath.join(self.root_path, *parts)

    def checkpoint_url(self, name: str) -> str:
        """The path or URL that DCP and users open for checkpoint ``name``."""
        if self.is_local:
            return self._join(name)
        return f"{self.root.rstrip('/')}/{name}"

    # ---- checks and listing ----------------------------------------------------

    def prepare_root(self) -> None:
        """Create the root; raise ConfigError if it is a file."""
        if self.fs.exists(self.root_path) and not self.fs.isdir(self.root_path):
            raise ConfigError(
                f"checkpoint path {self.root!r} is an existing file; pass a directory (it is created if missing)"
            )
        self.fs.makedirs(self.root_path, exist_ok=True)

    def exists_as_file(self) -> bool:
        return bool(self.fs.exists(self.root_path) and not self.fs.isdir(self.root_path))

    def is_committed(self, name: str) -> bool:
        return bool(self.fs.exists(self._join(name, METADATA_NAME)))

    def committed_names(self) -> list[str]:
        """Committed checkpoints, oldest (lowest version) first."""
        self.fs.invalidate_cache()
        try:
            listing = self.fs.ls(self.root_path, detail=True)
        except FileNotFoundError:
            return []
        names = []
        for item in listing:
            name = posixpath.basename(str(item["name"]).rstrip("/"))
            if item.get("type") == "directory" and step_of_name(name) is not None and self.is_committed(name):
                names.append(name)
        return sorted(names, key=lambda n: step_of_name(n) or 0)

    # ---- reads and writes ------------------------------------------------------

    def read_bytes(self, name: str, filename: str) -> bytes:
        with self.fs.open(self._join(name, filename), "rb") as f:
            return f.read()

    def write_bytes(self, name: str, filename: str, data: bytes) -> None:
        """Write one small file whole: readers see the old content or the new, never a part."""
        path = self._join(name, filename) if name else self._join(filename)
        if self.is_local:
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)  # one PUT: atomic on object stores

    def read_latest(self) -> str | None:
        try:
            with self.fs.open(self._join(LATEST_NAME), "rb") as f:
                return f.read().decode("utf-8").strip() or None
        except FileNotFoundError:
            return None

    def write_latest(self, name: str) -> None:
        self.write_bytes("", LATEST_NAME, name.encode("utf-8"))

    def write_manifest(self, name: str, data: bytes) -> None:
        self.write_bytes(name, MANIFEST_NAME, data)

    def clear_uncommitted(self, name: str) -> None:
        """Remove what a failed or killed attempt left of an uncommitted checkpoint."""
        path = self._join(name)
        if self.fs.exists(path) and not self.is_committed(name):
            self.fs.rm(path, recursive=True)

    def remove_checkpoint(self, name: str) -> None:
        """Delete a committed checkpoint: first its commit marker, then the rest."""
        marker = self._join(name, METADATA_NAME)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        path = self._join(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    # ---- DCP storage plugins ---------------------------------------------------

    def make_writer(self, name: str, before_commit: Callable[[], None]) -> StorageWriter:
        """A DCP storage writer for checkpoint ``name`` that runs ``before_commit`` before ``.metadata``."""
        if self.is_local:
            os.makedirs(self._join(name), exist_ok=True)
            return _manifest_before_commit(FileSystemWriter)(self._join(name), before_commit=before_commit)
        writer_cls, _ = _fsspec_dcp_classes()
        return _manifest_before_commit(writer_cls)(
            self.checkpoint_url(name), before_commit=before_commit, **self.storage_options
        )

    def make_reader(self, name: str) -> StorageReader:
        if self.is_local:
            return FileSystemReader(self._join(name))
        _, reader_cls = _fsspec_dcp_classes()
        return reader_cls(self.checkpoint_url(name), **self.storage_options)
