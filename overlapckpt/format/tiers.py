"""The two tiers a checkpoint can go to, and where the node-local one lives by default.

* **root**: the durable root (``path=``), a directory or an fsspec URL, every ``every`` steps;
* **local**: a directory on this node (tmpfs or local NVMe), every ``local_every`` steps,
  with its own retention (``local_keep``). Its default is under ``/dev/shm``, named after
  the job's root, so a job restarted on the same node with the same root finds it again.

Both hold the same format (DCP shards, ``.metadata``, the manifest, ``latest``): a local
tier directory is a root of its own, which ``load``, ``list_checkpoints`` and the CLI read.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile

ROOT_TIER = "root"
LOCAL_TIER = "local"
# Where a node's RAM-backed tier goes by default: tmpfs on Linux, the temp dir elsewhere.
_SHARED_MEMORY_DIR = "/dev/shm"
LOCAL_DIR_PREFIX = "overlapckpt-"


def default_local_dir(root: str) -> str:
    """``/dev/shm/overlapckpt-<job>-<hash>``: the job is the root's last path part, the hash the whole root's."""
    text = str(root).rstrip("/")
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", text.rsplit("/", 1)[-1] or "root")[:40]
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    parent = _SHARED_MEMORY_DIR if os.path.isdir(_SHARED_MEMORY_DIR) else tempfile.gettempdir()
    return os.path.join(parent, f"{LOCAL_DIR_PREFIX}{job}-{digest}")
