"""The two tiers a checkpoint can go to, and where the node-local one lives by default.

* **root**: the durable root (``path=``), a directory or an fsspec URL, every ``every`` steps;
* **local**: a directory on this node (tmpfs or local NVMe), every ``local_every`` steps,
  with its own retention (``local_keep``). Its default is under ``/dev/shm``, named after
  the job's root, so a job restarted on the same node with the same root finds it again.

Both hold the same format (DCP shards, ``.metadata``, the manifest, ``latest``): a local
tier directory is a root of its own, which ``load``, ``list_checkpoints`` and the CLI read.

A node-local tier is this job's own (a trust boundary: ``/dev/shm`` is shared by every user
and container of the node, and the default name is computable by anyone):

- it is made ``0700`` by this user, its files ``0600``; a directory that is a symlink, owned
  by another user, or writable by others is refused by name (``private_files.py``);
- it is bound to its root: the default name hashes this user's uid and the root's
  identity (its ``realpath``, or a URL as given), and the tier's marker file
  (``TIER_MARKER_NAME``) records that identity, so a tier made for another root (a
  relative ``"ckpts"`` of another project, a directory passed by mistake) is never read;
- the marker also tells the dead-job sweep (``lease.py``) that the directory is a tier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import tempfile

from ..errors import ConfigError, UntrustedPathError
from .private_files import RECORD_MAX_BYTES, create_private_file, make_private_dir, read_regular_file, refusal_of_directory
from .storage import CheckpointStore

ROOT_TIER = "root"
LOCAL_TIER = "local"
# Where a node's RAM-backed tier goes by default: tmpfs on Linux, the temp dir elsewhere.
_SHARED_MEMORY_DIR = "/dev/shm"
LOCAL_DIR_PREFIX = "overlapckpt-"
# In a tier's directory: which root it belongs to, and that it is a tier at all.
TIER_MARKER_NAME = ".overlapckpt-tier"
_TIER_MARKER_FORMAT = 1


def tiers_for(local_tier: bool, every: int | None, scheduled_version: int | None, on_request: bool) -> tuple[str, ...]:
    """The tiers a snapshot goes to, the local one first (it is the faster to commit): the routing, beside the tiers' names.

    With a local tier it takes every snapshot; the root the versions of ``every=``, and
    every ``request()`` (a restart, a preemption, the end of training). Without one, the root.
    """
    if not local_tier:
        return (ROOT_TIER,)
    to_root = on_request or scheduled_version is None or (every is not None and scheduled_version % every == 0)
    return (LOCAL_TIER,) + ((ROOT_TIER,) if to_root else ())


def root_identity(root: str | os.PathLike[str]) -> str:
    """What a tier is bound to: a URL as given (less a trailing ``/``), a local root's ``realpath``.

    The path as the store opens it: ``~`` is not expanded there, so not here either (a root
    ``"~/ckpts"`` is the directory ``~`` under the working directory, not the home's ``ckpts``).
    """
    text = os.fspath(root)
    if "://" in text:
        return text.rstrip("/")
    return os.path.realpath(text)


def default_local_dir(root: str | os.PathLike[str]) -> str:
    """``/dev/shm/overlapckpt-<job>-<hash>``: the job is the root's last path part, the hash of this user and the root's identity."""
    identity = root_identity(root)
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", identity.rstrip("/").rsplit("/", 1)[-1] or "root")[:40]
    digest = hashlib.sha256(f"{os.geteuid()}\0{identity}".encode()).hexdigest()[:12]
    parent = _SHARED_MEMORY_DIR if os.path.isdir(_SHARED_MEMORY_DIR) else tempfile.gettempdir()
    return os.path.join(parent, f"{LOCAL_DIR_PREFIX}{job}-{digest}")


def tier_store(local_dir: str | os.PathLike[str]) -> CheckpointStore:
    """The store of a node-local tier: its files are created ``0600``."""
    return CheckpointStore(os.fspath(local_dir), private=True)


_FIX = "pass local_dir= a directory of your own (mode 0700), or remove this one once you know what it holds"


def prepare_tier(local_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> CheckpointStore:
    """Make (or check) the tier ``local_dir`` of ``root``, and mark it; its store.

    UntrustedPathError when the directory is not this user's own; ConfigError when its marker
    names another root (the directory is another job's tier).
    """
    path = os.path.abspath(os.fspath(local_dir))
    make_private_dir(path, f"the node-local tier local_dir={os.fspath(local_dir)!r}", _FIX)
    identity = root_identity(root)
    marker = os.path.join(path, TIER_MARKER_NAME)
    recorded = _marked_root(marker)
    if recorded is None:
        recorded = _mark(marker, identity)
    if recorded != identity:
        raise ConfigError(
            f"local_dir={os.fspath(local_dir)!r} is the node-local tier of the root {recorded!r}, not of {identity!r}; "
            "pass another local_dir (each root has its own tier), or remove that directory if its job is gone"
        )
    return tier_store(path)


def _mark(marker: str, identity: str) -> str:
    """Write the marker whole under a name of its own, then link it into place; the identity the marker then holds.

    The ranks of a node prepare its tier at once: a marker written in place could be read
    half-written by another rank (and refused). A link either makes the whole file appear or
    finds one there, which is read instead.
    """
    partial = f"{marker}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    with os.fdopen(create_private_file(partial), "wb") as f:
        f.write(json.dumps({"format": _TIER_MARKER_FORMAT, "root": identity, "uid": os.geteuid()}, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(partial, marker)
    except FileExistsError:
        pass  # another rank marked it first
    finally:
        os.unlink(partial)
    recorded = _marked_root(marker)
    if recorded is None:
        raise UntrustedPathError(f"{marker} vanished while it was written; {_FIX}")
    return recorded


def _marked_root(marker: str) -> str | None:
    """The root identity a tier's marker records; None when there is no marker. UntrustedPathError when it is not one."""
    try:
        raw = json.loads(read_regular_file(marker, RECORD_MAX_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UntrustedPathError(f"{marker} is not a tier marker overlapckpt wrote ({e}); {_FIX}") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("root"), str):
        raise UntrustedPathError(f"{marker} is not a tier marker overlapckpt wrote; {_FIX}")
    return str(raw["root"])


def tier_refusal(local_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> str | None:
    """Why a restore must not read the tier ``local_dir`` for ``root``, or None when it may (or it does not exist)."""
    path = os.path.abspath(os.fspath(local_dir))
    refusal = refusal_of_directory(path)
    if refusal is not None:
        return refusal
    if not os.path.isdir(path):
        return None
    try:
        recorded = _marked_root(os.path.join(path, TIER_MARKER_NAME))
    except UntrustedPathError as e:
        return str(e)
    if recorded is None:
        return f"{path} has no tier marker ({TIER_MARKER_NAME}): it was not made as the tier of {root_identity(root)!r}"
    if recorded != root_identity(root):
        return f"{path} is the node-local tier of the root {recorded!r}, not of {root_identity(root)!r}"
    return None
