"""What a checkpoint's blobs and tensors must hash to, read from its manifest, and the refusal a load raises when they do not.

Separate from the reading (``blob_reader.py``) and the per-blob checks (``blob_checks.py``):
both use these records, and ``restore/read.py`` builds them from a manifest before any
reader exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError
from .blob_macs import BlobMacs
from .checksum import CRC32, hex32
from .manifest import Manifest


@dataclass(frozen=True)
class TensorSum:
    """The checksum of one tensor (or rank part) of the host snapshot that was saved."""

    shape: tuple[int, ...]
    algorithm: str
    checksum: str


@dataclass(frozen=True)
class ExpectedSums:
    """What a checkpoint's blobs and tensors must hash to, from its (self-checked) manifest."""

    where: str  # the checkpoint's path or URL, for messages
    algorithm: str
    blobs: dict[tuple[str, int, int], tuple[str, str]]  # (file, offset, length) -> (key, checksum)
    tensors: dict[tuple[str, tuple[int, ...]], TensorSum]  # (fqn, offset in the global tensor) -> its sum
    macs: BlobMacs | None = None  # with a signing key: each blob's MAC is checked too

    @classmethod
    def from_manifest(cls, manifest: Manifest, where: str, signing_key: bytes | None = None) -> ExpectedSums:
        """``signing_key``: the manifest's signature was checked with it; each blob's MAC is checked too."""
        sums = manifest.checksums
        if sums is None:
            raise CorruptCheckpointError(f"{where} has no checksums of its stored bytes; load it with verify=False")
        macs = None if signing_key is None else BlobMacs.from_manifest(manifest, where, signing_key)
        blobs = {(name, b.offset, b.length): (b.key, b.checksum) for name, f in sums.files.items() for b in f.blobs}
        tensors: dict[tuple[str, tuple[int, ...]], TensorSum] = {}
        parts = [(key, item) for key, item in manifest.items.items()]
        parts += [(key, item) for section in manifest.ranks for key, item in section.items.items()]
        for key, item in parts:
            if item.checksum is not None:
                algorithm, checksum = sums.algorithm, item.checksum
            elif item.crc32 is not None:  # format 2: zlib's CRC-32 as an integer
                algorithm, checksum = CRC32, hex32(item.crc32)
            else:
                continue
            offset = tuple(item.offset) if item.offset is not None else (0,) * len(item.shape)
            tensors[(key, offset)] = TensorSum(tuple(item.shape), algorithm, checksum)
        return cls(where=where, algorithm=sums.algorithm, blobs=blobs, tensors=tensors, macs=macs)

    def check_mac(self, relative_path: str, info: Any, key: str | None, *parts: Any) -> None:
        """With a signing key, the blob whose bytes are ``parts`` against its MAC; a refusal if it differs."""
        if self.macs is not None and not self.macs.matches(relative_path, int(info.offset), int(info.length), *parts):
            offset, length = int(info.offset), int(info.length)
            raise verification_refusal(
                self.where,
                f"the keyed digest (MAC) of {key!r} in {self.where}/{relative_path} (bytes {offset}..{offset + length}) "
                "does not match the signed manifest's: forged or damaged",
            )


def verification_refusal(where: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"reading the checkpoint {where} failed verification: {problem}; restore from an older checkpoint "
        "(list_checkpoints), or pass verify=False to inspect it"
    )

