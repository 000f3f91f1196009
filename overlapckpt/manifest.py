"""``overlapckpt.json``: what a checkpoint holds, how it was made, and how to verify it.

Written by the writer process strictly before DCP's ``.metadata`` (the commit
marker), so every committed checkpoint has one. JSON, never pickle.
"""

from __future__ import annotations

import ctypes
import json
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptCheckpointError

MANIFEST_NAME = "overlapckpt.json"
METADATA_NAME = ".metadata"
LATEST_NAME = "latest"
FORMAT_VERSION = 1
CHECKPOINT_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint holding version ``step``."""
    return f"{CHECKPOINT_PREFIX}{step:09d}"


def step_of_name(name: str) -> int | None:
    """The version in a checkpoint directory name, or None for any other name."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX) :]
    return int(digits) if digits.isdigit() else None


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
    mode: str  # "window" (W=1), "replay" or "stage"
    nbytes: int  # bytes of tensor state
    created_at: float  # UNIX time of the commit
    requested_step: int  # the step at which the checkpoint was requested
    torch_version: str

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
        )


def dump_manifest(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode("utf-8")


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """Parse and sanity-check a manifest; raise CorruptCheckpointError naming ``where``."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"manifest {where} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or "format_version" not in manifest:
        raise CorruptCheckpointError(f"manifest {where} has no format_version; it was not written by overlapckpt")
    version = manifest["format_version"]
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"manifest {where} has format_version {version}, newer than this overlapckpt reads "
            f"({FORMAT_VERSION}); upgrade overlapckpt"
        )
    for key in ("step", "window", "mode", "nbytes", "items", "created_at"):
        if key not in manifest:
            raise CorruptCheckpointError(f"manifest {where} lacks the field {key!r}; the file is damaged")
    return manifest
