"""Check a committed checkpoint without the model: read every tensor the manifest lists, compare checksums."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CorruptCheckpointError
from .manifest import MANIFEST_NAME, parse_manifest, tensor_crc32
from .storage import CheckpointStore


@dataclass
class VerifyReport:
    path: str
    step: int
    items: int = 0
    nbytes: int = 0
    mismatched: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatched


def read_manifest(store: CheckpointStore, name: str) -> dict[str, Any]:
    where = store.checkpoint_url(name)
    try:
        raw = store.read_bytes(name, MANIFEST_NAME)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{where} is committed but has no {MANIFEST_NAME}; it was not written by overlapckpt") from e
    return parse_manifest(raw, f"{where}/{MANIFEST_NAME}")


def _dtype(name: str, key: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"item {key!r} of {where} has dtype {name!r}, which this torch does not know")
    return dtype


def verify_checkpoint(store: CheckpointStore, name: str) -> VerifyReport:
    """Read each tensor of checkpoint ``name`` by the shapes in its manifest and check its CRC-32.

    Raises CorruptCheckpointError when the shards cannot be read at all; a tensor
    whose bytes differ is listed in the report's ``mismatched``.
    """
    import torch.distributed.checkpoint as dcp

    where = store.checkpoint_url(name)
    manifest = read_manifest(store, name)
    items = manifest["items"]
    # DCP's keys are the flattened ones the manifest uses, so a flat dict loads as is.
    host = {k: torch.empty(tuple(v["shape"]), dtype=_dtype(v["dtype"], k, where)) for k, v in items.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(host, storage_reader=store.make_reader(name), no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        raise CorruptCheckpointError(f"reading the checkpoint {where} failed: {type(e).__name__}: {e}") from e
    report = VerifyReport(path=where, step=int(manifest["step"]))
    for key, t in host.items():
        report.items += 1
        report.nbytes += t.numel() * t.element_size()
        if tensor_crc32(t) != int(items[key]["crc32"]):
            report.mismatched.append(key)
    return report
