"""The storage layout under a root URL, and the commit rule.

::

    <root>/
      step-000001000/        one checkpoint, DCP format
        __0_0.distcp ...     shards, written first
        overlapckpt.json     manifest, written next, with the checksums of every stored byte
        .metadata            written last by DCP: its presence is the commit
      step-000002000.attempt-<run8>-<random8>/
                             an attempt in progress (local disk): published by one rename
      latest                 name of the newest committed checkpoint, updated after the commit

A directory counts as a checkpoint only once ``.metadata`` exists. DCP writes
``.metadata.tmp`` and renames it: atomic on a local filesystem, and on S3 the
rename is a server-side copy that makes the object appear whole, so a reader never
sees a half-written checkpoint as committed. The manifest is written between the
two (it holds the checksum of ``.metadata.tmp``'s bytes), so it exists before the commit. ``latest`` is written atomically too
(rename locally, a single PUT on S3). Retention removes ``.metadata`` first, so a
checkpoint being deleted stops counting before any shard disappears.

No two attempts ever write the same place: on a local disk each writes a directory
of its own and is published by a rename; on an object store it claims the name
first (``attempts.py``).
"""

from __future__ import annotations

import logging
import os
import posixpath
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from fsspec.core import url_to_fs
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ..errors import CheckpointReadError, ConfigError, CorruptCheckpointError, OverlapCkptError, UnsafeFileError
from .blob_reader import verified_reader_class
from .commit_writer import BeforeCommit, manifest_first_writer_class
from .manifest import LATEST_NAME, MANIFEST_NAME, METADATA_NAME, step_of_name
from .private_files import (
    PRIVATE_FILE_MODE,
    RECORD_MAX_BYTES,
    SMALL_FILE_MAX_BYTES,
    open_regular,
    read_regular_file,
    recreate_private_file,
)
from .safe_unpickle import SafeFileSystemReader, safe_reader_class

_VerifiedLocalReader = verified_reader_class(SafeFileSystemReader)
log = logging.getLogger("overlapckpt")


# A retired checkpoint's directory while it is deleted (CheckpointStore.retire_checkpoint): not a
# checkpoint's name (``step_of_name`` refuses it), so never listed.
RETIRED_PREFIX = ".retired-"


def is_storage_error(e: BaseException) -> bool:
    """Whether ``e`` means "storage could not be reached or read", as opposed to "the bytes are wrong".

    botocore's connection errors are not OSErrors (s3fs translates most other S3
    errors into OSErrors). botocore is not imported for this: if it is not loaded,
    none of its errors can have been raised.
    """
    if isinstance(e, OSError):
        return True
    botocore_exceptions = sys.modules.get("botocore.exceptions")
    return botocore_exceptions is not None and isinstance(e, botocore_exceptions.BotoCoreError)


@contextmanager
def translate_read_errors(where: str) -> Iterator[None]:
    """Raise storage failures inside the block as CheckpointReadError naming ``where``, the cause chained.

    Corruption (CorruptCheckpointError) and the other errors of overlapckpt pass through. A file
    that is not what overlapckpt writes (a link, a FIFO, a device, an oversized small file,
    ``private_files.UnsafeFileError``) is a CorruptCheckpointError: storage read fine.
    """
    try:
        yield
    except UnsafeFileError as e:  # an OverlapCkptError too: first
        raise CorruptCheckpointError(f"reading {where} refused {e.filename}: {e.strerror}") from e
    except OverlapCkptError:
        raise
    except Exception as e:
        if not is_storage_error(e):
            raise
        raise read_error(where, e) from e


def read_error(where: str, cause: BaseException) -> CheckpointReadError:
    """The one wording of a storage read failure (not corruption): what failed, the cause, the fix."""
    return CheckpointReadError(
        f"reading {where} failed: {type(cause).__name__}: {cause}; the storage could not be read (this is not "
        "corruption): check the connection, credentials and files, then retry"
    )


def dcp_root_cause(e: BaseException) -> BaseException:
    """DCP wraps each rank's failure in CheckpointException (a BaseException): the first rank's original error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            return dcp_root_cause(inner[0])
    return e


def fsspec_dcp_classes() -> tuple[type, type]:
    """DCP's (FsspecWriter, FsspecReader): they moved between torch releases, so they are looked up where this torch has them."""
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter  # type: ignore[attr-defined]
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


class CheckpointStore:
    """Checkpoints under one root: local directory or fsspec URL (``s3://bucket/prefix``).

    Subclass to change how bytes reach storage; the writer process builds the store
    from its import path, so a subclass works there too.

    Local reads of the small files (manifest, ``.metadata``, ``latest``, the lease) and
    of shards never follow a symlink, never block on a FIFO and are size-capped
    (``private_files.py``): a file planted there cannot hang or flood a reader.
    ``private``: a node-local tier's store, whose files are created ``0600``.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None, *, private: bool = False) -> None:
        self.private = private
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
        """The path or URL of ``name`` under the root: a checkpoint directory, or a root file such as the lease."""
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
        return sorted(names, key=lambda n: (step_of_name(n) or 0, n))

    # ---- reads and writes ------------------------------------------------------

    def read_bytes(self, name: str, filename: str, max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes:
        """One file of directory ``name`` (``""``: the root) whole. Locally, a regular file of at most ``max_bytes``
        only: OSError for a symlink, a FIFO, a device or a larger file, without reading it."""
        path = self._join(name, filename) if name else self._join(filename)
        if self.is_local:
            return read_regular_file(path, max_bytes)
        with self.fs.open(path, "rb") as f:
            return f.read()

    @contextmanager
    def open_read(self, name: str, filename: str) -> Iterator[BinaryIO]:
        """A file of checkpoint ``name`` opened for sequential reads (verify streams shards through it)."""
        if self.is_local:
            with open_regular(self._join(name, filename)) as (f, _):
                yield f
            return
        with self.fs.open(self._join(name, filename), "rb") as f:
            yield f

    def file_kind(self, name: str, filename: str) -> str:
        """"file" for a regular file, "link" for a symbolic link, else "other" (a FIFO, a device, a directory)."""
        info = self.fs.info(self._join(name, filename))
        if info.get("islink"):
            return "link"
        return "file" if info.get("type") == "file" else "other"

    def file_size(self, name: str, filename: str) -> int:
        """The stored size of one file of checkpoint ``name``, in bytes."""
        return int(self.fs.size(self._join(name, filename)))

    def write_bytes(self, name: str, filename: str, data: bytes) -> None:
        """Write one small file whole: readers see the old content or the new, never a part."""
        path = self._join(name, filename) if name else self._join(filename)
        if self.is_local:
            tmp = f"{path}.tmp-{os.getpid()}"
            if self.private:
                fd = recreate_private_file(tmp)  # over one a killed writer of this pid left
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)  # one PUT: atomic on object stores

    # ---- files at the root (the lease) ------------------------------------------

    def create_exclusive(self, filename: str, data: bytes) -> None:
        """Create ``filename`` (relative to the root) only if it does not exist; FileExistsError if it does.

        Locally ``O_EXCL``; on object stores a conditional PUT (``If-None-Match: *``,
        s3fs's ``mode="create"``), which AWS S3 and moto honour.
        """
        path = self._join(filename)
        if self.is_local:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE_MODE if self.private else 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except TypeError as e:  # an fsspec back end without exclusive create
            raise ConfigError(
                f"storage {self.root!r} ({type(self.fs).__name__}) cannot create a file exclusively, which the root's "
                "lease needs; pass lease=False and make sure one job at a time writes this root"
            ) from e

    def read_root_file(self, filename: str, max_bytes: int = SMALL_FILE_MAX_BYTES) -> bytes:
        return self.read_bytes("", filename, max_bytes)

    def remove_root_file(self, filename: str) -> None:
        path = self._join(filename)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def read_latest(self) -> str | None:
        """The checkpoint ``latest`` names, or None: none, or not a regular file of at most a few KiB (then warned of)."""
        try:
            text = self.read_root_file(LATEST_NAME, max_bytes=RECORD_MAX_BYTES).decode("utf-8", errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            if not self.is_local:
                raise
            log.warning("%s is not a file overlapckpt wrote (%s): ignored", self.checkpoint_url(LATEST_NAME), e)
            return None
        return text or None

    def write_latest(self, name: str) -> None:
        self.write_bytes("", LATEST_NAME, name.encode("utf-8"))

    def write_manifest(self, name: str, data: bytes) -> None:
        self.write_bytes(name, MANIFEST_NAME, data)

    def remove_tree(self, name: str) -> None:
        """Delete directory ``name`` under the root and everything in it, if it exists (attempts.py decides when)."""
        path = self._join(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_file(self, name: str, filename: str) -> None:
        """Delete one file of directory ``name``, if it exists."""
        path = self._join(name, filename)
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def remove_checkpoint(self, name: str) -> None:
        """Delete a committed checkpoint: first its commit marker, then the rest."""
        self.purge_retired(self.retire_checkpoint(name))

    def retire_checkpoint(self, name: str, run_tag: str = "") -> str:
        """Uncommit ``name`` (its marker first: never a half-deleted checkpoint listed) and take it out of the root's
        listing; the directory left to delete with ``purge_retired``. Fast: no byte of its shards is touched.

        A local directory is renamed to ``.retired-<name>-<run_tag>-<random>``; on object
        storage, where a rename copies every object, it keeps its name (uncommitted, never
        listed). A retired directory a dead writer left is removed by the next attempt's
        sweep (``attempts.py``), under the same rule as a dead attempt's.
        """
        marker = self._join(name, METADATA_NAME)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if not self.is_local:
            return name
        retired = f"{RETIRED_PREFIX}{name}-{run_tag or 'run'}-{secrets.token_hex(4)}"
        try:
            os.rename(self._join(name), self._join(retired))
        except FileNotFoundError:
            pass  # deleted already (another process's retention, an operator)
        return retired

    def purge_retired(self, retired: str) -> None:
        """Delete what ``retire_checkpoint`` left: the slow part (unlinking the shards), run after a commit is answered."""
        try:
            self.remove_tree(retired)
        except FileNotFoundError:
            pass

    # ---- DCP storage plugins ---------------------------------------------------

    def make_writer(self, name: str, before_commit: BeforeCommit, wants_metadata_bytes: bool = False, thread_count: int = 1) -> StorageWriter:
        """A DCP storage writer into directory ``name`` under the root (an attempt's, ``attempts.py``): it
        checksums every blob it stores and calls ``before_commit`` with those checksums (and ``.metadata``'s)
        right before ``.metadata`` appears. ``thread_count``: DCP writes that many shard files at once."""
        if self.is_local:
            os.makedirs(self._join(name), exist_ok=True)
            return manifest_first_writer_class(FileSystemWriter)(
                self._join(name), before_commit=before_commit, wants_metadata_bytes=wants_metadata_bytes, thread_count=thread_count
            )
        writer_cls, _ = fsspec_dcp_classes()
        return manifest_first_writer_class(writer_cls)(
            self.checkpoint_url(name),
            before_commit=before_commit,
            wants_metadata_bytes=wants_metadata_bytes,
            thread_count=thread_count,
            **self.storage_options,
        )

    def make_reader(self, name: str) -> StorageReader:
        """A DCP storage reader whose ``.metadata`` is unpickled by an allowlist (``safe_unpickle.py``), and
        whose blobs are checked as they are read once its ``expect()`` is called (``blob_reader.py``)."""
        if self.is_local:
            return _VerifiedLocalReader(self._join(name))
        _, reader_cls = fsspec_dcp_classes()
        return verified_reader_class(safe_reader_class(reader_cls))(self.checkpoint_url(name), **self.storage_options)
