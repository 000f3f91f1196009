"""Node-local tier checkpoints made without training: a manifest that lists the files named, and those files.

For the restore listing's tests (tests/test_tiers.py and its worker): how many files a
checkpoint has and what their names are is the point there, and a real checkpoint of 1,024
ranks' files cannot be trained on this machine. The manifest is a real one (``dump_manifest``:
it reads back through ``read_manifest`` with its own checksum); the files hold zeros.
"""

from __future__ import annotations

import os

from overlapckpt.format.manifest import FORMAT_VERSION, MANIFEST_NAME, checkpoint_name, dump_manifest
from overlapckpt.format.tiers import prepare_tier

METADATA_NBYTES = 10


def manifest_bytes(step: int, run_id: str, files: dict[str, int], world: int, created_at: float = 0.0) -> bytes:
    """A manifest of ``step`` by ``run_id`` at ``world`` ranks listing the data ``files`` (name: bytes) and a .metadata."""
    return dump_manifest({
        "format_version": FORMAT_VERSION, "step": step, "requested_step": step, "mode": "replay", "window": 1,
        "nbytes": sum(files.values()), "created_at": created_at, "torch_version": "test", "items": {},
        "world_size": world, "run_id": run_id, "extra_state": {},
        "checksums": {
            "algorithm": "crc32",
            "files": {name: {"nbytes": nbytes, "blobs": []} for name, nbytes in sorted(files.items())},
            "metadata": {"name": ".metadata", "nbytes": METADATA_NBYTES, "checksum": "00000000"},
        },
    })


def write_tier_checkpoint(
    local_dir: str, root: str, step: int, files: dict[str, int], world: int, held: set[str] | None = None, created_at: float = 0.0
) -> str:
    """A committed checkpoint of ``step`` in the tier ``local_dir`` of ``root``, holding ``held`` of ``files`` (None: all); its name.

    It always holds its manifest and .metadata (a directory without .metadata is not committed).
    """
    prepare_tier(local_dir, root)
    run_id = "0123456789abcdef" * 2
    name = checkpoint_name(step, run_id)
    directory = os.path.join(local_dir, name)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with open(os.path.join(directory, MANIFEST_NAME), "wb") as f:
        f.write(manifest_bytes(step, run_id, files, world, created_at))
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(bytes(METADATA_NBYTES))
    for file in sorted(files if held is None else held):
        with open(os.path.join(directory, file), "wb") as f:
            f.truncate(files[file])
    return name
