"""Check a committed checkpoint without the model: read every tensor the manifest lists, compare checksums."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import CorruptCheckpointError
from .loading import read_into, read_manifest
from .manifest import tensor_crc32
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
    where = store.checkpoint_url(name)
    manifest = read_manifest(store, name)
    items = manifest["items"]
    # DCP's keys are the flattened ones the manifest uses, so a flat dict loads as is.
    host = {k: torch.empty(tuple(v["shape"]), dtype=_dtype(v["dtype"], k, where)) for k, v in items.items()}
    read_into(store, name, host)
    report = VerifyReport(path=where, step=int(manifest["step"]))
    for key, t in host.items():
        report.items += 1
        report.nbytes += t.numel() * t.element_size()
        if tensor_crc32(t) != int(items[key]["crc32"]):
            report.mismatched.append(key)
    return report
