"""``overlapckpt.json``: what a checkpoint holds, how it was made, and how to verify it.

Written by the writer process strictly before DCP's ``.metadata`` (the commit
marker), so every committed checkpoint has one. JSON, never pickle.

What it covers (format 2):

- ``checksums``: the checksum of every blob DCP stored, by file, offset and length
  (tensor data, serialized non-tensor items such as ``param_groups``, and
  torch.save's framing: the blobs tile each shard), and of ``.metadata``'s exact
  bytes; the algorithm is named there (see :mod:`overlapckpt.checksum`);
- ``items``: a CRC-32 per tensor of the host snapshot, checked after a load against
  the tensors DCP decoded: end to end, it catches a serializer that stored the
  wrong bytes, which checksums of the stored bytes cannot;
- ``manifest_crc32``: zlib's CRC-32 of this file's exact bytes, with the field's
  own 8 hex digits read as zeros. Always CRC-32, so any reader can check the
  manifest, whatever package computed the blob checksums.
"""

from __future__ import annotations

import ctypes
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError

MANIFEST_NAME = "overlapckpt.json"
METADATA_NAME = ".metadata"
LATEST_NAME = "latest"
FORMAT_VERSION = 2  # 2: stored-byte checksums and the manifest's own checksum
LEGACY_FORMAT_VERSION = 1  # tensor CRC-32s only; readable, not verifiable
SELF_CHECKSUM_FIELD = "manifest_crc32"
# With sort_keys and indent=1, a top-level field starts a line with exactly one space,
# so this marker cannot match a nested key of the same name.
_SELF_MARKER = f'\n "{SELF_CHECKSUM_FIELD}": "'.encode()
_SELF_DIGITS = 8
CHECKPOINT_PREFIX = "step-"


# ASCII only: str.isdigit() accepts "²", which int() then refuses. The optional suffix is
# a run's id, for a version that another run's committed checkpoint already holds.
_NAME_RE = re.compile(r"step-([0-9]{9,})(?:-([0-9a-f]{8}))?", re.ASCII)
RUN_ID_HEX = 16  # a run id is 16 hex digits; names carry its first 8


def checkpoint_name(step: int, run_id: str | None = None) -> str:
    """The directory name of the checkpoint holding version ``step`` (``run_id``: the lineage-aware name)."""
    return f"{CHECKPOINT_PREFIX}{step:09d}" + ("" if run_id is None else f"-{run_id[:8]}")


def step_of_name(name: str) -> int | None:
    """The version in a checkpoint directory name, or None for any other name (strictly ``step-`` + digits)."""
    match = _NAME_RE.fullmatch(name)
    return None if match is None else int(match.group(1))


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes, read in place (no copy for contiguous tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return 0
    return zlib.crc32((ctypes.c_char * nbytes).from_address(t.data_ptr()))


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint, as described by its manifest."""

    step: int  # the version it holds, in optimizer steps
    path: str  # the checkpoint directory (local path or URL)
    window: int
    mode: str  # "single" (W=1), "replay" or "stage"
    nbytes: int  # bytes of tensor state (every rank's share)
    created_at: float  # UNIX time of the commit
    requested_step: int  # the step at which the checkpoint was requested
    torch_version: str
    world_size: int = 1  # ranks that wrote it
    run_id: str | None = None  # the run that wrote it (None: written before runs had ids)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], path: str) -> CheckpointInfo:
        return cls(
            step=int(manifest["step"]),
            path=path,
            window=int(manifest["window"]),
            mode=str(manifest["mode"]),
            nbytes=int(manifest["nbytes"]),
            created_at=float(manifest["created_at"]),
            requested_step=int(manifest["requested_step"]),
            torch_version=str(manifest["torch_version"]),
            world_size=int(manifest.get("world_size", 1)),
            run_id=None if manifest.get("run_id") is None else str(manifest["run_id"]),
        )


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes, with its own CRC-32 in ``manifest_crc32`` (see the module docstring)."""
    body = {k: v for k, v in manifest.items() if k != SELF_CHECKSUM_FIELD}
    body[SELF_CHECKSUM_FIELD] = "0" * _SELF_DIGITS
    raw = json.dumps(body, indent=1, sort_keys=True, allow_nan=True).encode("utf-8")
    at = raw.index(_SELF_MARKER) + len(_SELF_MARKER)
    digits = f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}".encode("ascii")
    return raw[:at] + digits + raw[at + _SELF_DIGITS :]


def _check_self_checksum(raw: bytes, where: str) -> bool:
    """Compare the manifest's CRC-32 with its bytes; False when it has none (format 1)."""
    marker_at = raw.find(_SELF_MARKER)
    if marker_at < 0:
        return False
    at = marker_at + len(_SELF_MARKER)
    stored = raw[at : at + _SELF_DIGITS]
    zeroed = raw[:at] + b"0" * _SELF_DIGITS + raw[at + _SELF_DIGITS :]
    actual = f"{zlib.crc32(zeroed) & 0xFFFFFFFF:08x}"
    # Compared as text: a flipped case bit in a hex digit is a difference too.
    if stored.decode("ascii", errors="replace") != actual:
        raise CorruptCheckpointError(
            f"manifest {where} fails its own checksum (stored {stored!r}, computed {actual!r}): a byte of it "
            "changed after it was written; restore from an older checkpoint (list_checkpoints)"
        )
    return True


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Check the manifest's own checksum, parse it, and sanity-check it; CorruptCheckpointError naming ``where``."""
    self_checked = _check_self_checksum(raw, where)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"manifest {where} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise CorruptCheckpointError(f"manifest {where} has no format_version; it was not written by overlapckpt")
    version = manifest["format_version"]
    if not isinstance(version, int) or version < LEGACY_FORMAT_VERSION:
        raise CorruptCheckpointError(f"manifest {where} has format_version {version!r}; the file is damaged")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"manifest {where} has format_version {version}, newer than this overlapckpt reads "
            f"({FORMAT_VERSION}); upgrade overlapckpt"
        )
    if version >= 2 and not self_checked:
        raise CorruptCheckpointError(f"manifest {where} lacks its {SELF_CHECKSUM_FIELD!r} field; the file is damaged")
    required = ("step", "window", "mode", "nbytes", "items", "created_at") + (("checksums",) if version >= 2 else ())
    for key in required:
        if key not in manifest:
            raise CorruptCheckpointError(f"manifest {where} lacks the field {key!r}; the file is damaged")
    return manifest
