"""The typed records inside ``overlapckpt.json``, and the field readers that build them from its JSON.

Each record reads itself from the JSON (``from_json``, raising CorruptCheckpointError that
names the field) and writes itself back (``to_json``). The ledger and the stats stay JSON
objects: their types belong to the training side, which the format never imports; the CLI
and ckpt.stats read them as dicts. Separate from ``manifest.py``, which holds the document
as a whole (``Manifest``), its own checksum and its parsing: the records are what the writer
and the loaders exchange piece by piece (a rank's section, an export's checksum, a param
group's replay arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import CorruptCheckpointError


def read_field(raw: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    """``raw[key]``, of type ``kind`` (``default`` where it is absent, if given); CorruptCheckpointError naming the field."""
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(f"manifest {where} has a malformed field: an object was expected, not {type(raw).__name__}; the file is damaged")
    if key not in raw:
        if default is not ...:
            return default
        raise CorruptCheckpointError(f"manifest {where} lacks the field {key!r}; the file is damaged")
    value = raw[key]
    # bool is an int subclass: a true/false where a number belongs is damage too.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise CorruptCheckpointError(f"manifest {where} has a malformed field {key!r}: {value!r} is not {names}; the file is damaged")
    return value


def read_ints(raw: Any, key: str, where: str) -> tuple[int, ...]:
    """``raw[key]``, a list of integers, as a tuple; CorruptCheckpointError naming the field."""
    values = read_field(raw, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CorruptCheckpointError(f"manifest {where} has a malformed field {key!r}: {values!r} is not a list of integers; the file is damaged")
    return tuple(values)


# A lineage longer than this keeps its nearest runs: older ones' checkpoints were retired long before.
MAX_ANCESTORS = 256


def read_ancestors(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    """The ``ancestors`` field: (run id, version) pairs, nearest first; CorruptCheckpointError if malformed."""
    values = read_field(raw, "ancestors", list, where, [])
    ok = len(values) <= MAX_ANCESTORS and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int) and not isinstance(v[1], bool)
        for v in values
    )
    if not ok:
        raise CorruptCheckpointError(
            f"manifest {where} has a malformed field 'ancestors': {values!r:.200} is not a list of at most {MAX_ANCESTORS} "
            "[run id, version] pairs; the file is damaged"
        )
    return tuple((str(v[0]), int(v[1])) for v in values)


@dataclass(frozen=True)
class ItemRecord:
    """One tensor (or, in a rank's section, one part of a tensor)."""

    dtype: str
    shape: tuple[int, ...]
    crc32: int | None = None  # format 2: zlib's CRC-32 of the host snapshot
    offset: tuple[int, ...] | None = None  # a rank's part: where it sits in the global tensor
    # format 3: of the host snapshot, in the algorithm of the manifest's checksums (8 hex
    # digits); absent for the global items of a distributed checkpoint (its parts have them)
    checksum: str | None = None

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ItemRecord:
        return cls(
            dtype=read_field(raw, "dtype", str, where, ""),
            shape=read_ints(raw, "shape", where),
            crc32=read_field(raw, "crc32", int, where, None),
            offset=read_ints(raw, "offset", where) if isinstance(raw, dict) and "offset" in raw else None,
            checksum=read_field(raw, "checksum", str, where, None),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.crc32 is not None:
            out["crc32"] = self.crc32
        if self.checksum is not None:
            out["checksum"] = self.checksum
        if self.offset is not None:
            out["offset"] = list(self.offset)
        return out


@dataclass(frozen=True)
class BlobRecord:
    key: str
    offset: int
    length: int
    checksum: str  # 8 hex digits, of the algorithm ChecksumsRecord names
    mac: str | None = None  # signed checkpoints: of the algorithm ChecksumsRecord's mac_algorithm names (blob_macs.py)


@dataclass(frozen=True)
class FileRecord:
    nbytes: int
    blobs: tuple[BlobRecord, ...]  # in offset order, tiling the file
    mac_nonce: str | None = None  # signed checkpoints: the nonce its blobs' MAC keys derive from


@dataclass(frozen=True)
class ChecksumsRecord:
    """The checksum of every stored byte: each shard's blobs, and ``.metadata``'s exact bytes."""

    algorithm: str
    metadata_name: str
    metadata_nbytes: int
    metadata_checksum: str
    files: dict[str, FileRecord]
    mac_algorithm: str | None = None  # signed checkpoints: every blob's MAC (blob_macs.py)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ChecksumsRecord:
        metadata = read_field(raw, "metadata", dict, where)
        files = {}
        for name, entry in read_field(raw, "files", dict, where).items():
            blobs = []
            for blob in read_field(entry, "blobs", list, f"{where} ({name})"):
                at = f"{where} ({name})"
                blobs.append(
                    BlobRecord(
                        read_field(blob, "key", str, at), read_field(blob, "offset", int, at), read_field(blob, "length", int, at),
                        read_field(blob, "checksum", str, at), read_field(blob, "mac", (str, type(None)), at, None),
                    )
                )
            files[str(name)] = FileRecord(
                nbytes=read_field(entry, "nbytes", int, f"{where} ({name})"),
                blobs=tuple(blobs),
                mac_nonce=read_field(entry, "mac_nonce", (str, type(None)), f"{where} ({name})", None),
            )
        return cls(
            algorithm=read_field(raw, "algorithm", str, where),
            metadata_name=read_field(metadata, "name", str, where),
            metadata_nbytes=read_field(metadata, "nbytes", int, where),
            metadata_checksum=read_field(metadata, "checksum", str, where),
            files=files,
            mac_algorithm=read_field(raw, "mac_algorithm", (str, type(None)), where, None),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "algorithm": self.algorithm,
            "files": {name: _file_json(f) for name, f in sorted(self.files.items())},
            "metadata": {"name": self.metadata_name, "nbytes": self.metadata_nbytes, "checksum": self.metadata_checksum},
        }
        if self.mac_algorithm is not None:
            out["mac_algorithm"] = self.mac_algorithm
        return out


def _file_json(f: FileRecord) -> dict[str, Any]:
    blobs = []
    for b in f.blobs:
        blob: dict[str, Any] = {"key": b.key, "offset": b.offset, "length": b.length, "checksum": b.checksum}
        if b.mac is not None:
            blob["mac"] = b.mac
        blobs.append(blob)
    out: dict[str, Any] = {"nbytes": f.nbytes, "blobs": blobs}
    if f.mac_nonce is not None:
        out["mac_nonce"] = f.mac_nonce
    return out


@dataclass(frozen=True)
class ExportRecord:
    """A framework file written next to DCP's (writer/exports.py): its size and zlib CRC-32 (and MAC, signed)."""

    nbytes: int
    crc32: int
    mac: str | None = None  # signed checkpoints: of the checksums' mac_algorithm, keyed from mac_nonce at offset 0
    mac_nonce: str | None = None

    @classmethod
    def from_json(cls, raw: Any, where: str) -> ExportRecord:
        return cls(
            read_field(raw, "nbytes", int, where),
            read_field(raw, "crc32", int, where),
            read_field(raw, "mac", (str, type(None)), where, None),
            read_field(raw, "mac_nonce", (str, type(None)), where, None),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nbytes": self.nbytes, "crc32": self.crc32}
        if self.mac is not None:
            out["mac"], out["mac_nonce"] = self.mac, self.mac_nonce
        return out


@dataclass(frozen=True)
class GroupArithmetic:
    """How replay steps one optimizer param group on the CPU, and whether that is known to be the training's step bit for bit.

    Written to the manifest of a replay-mode checkpoint, one per param group (``inspect``
    shows them): the training side measures each group on its device when the Checkpointer
    is built (``train/consistency/replay_arithmetic.py``), and the writer steps each group by
    the arithmetic named here (``device_adam_step.py``).
    """

    group: int  # the index of the param group in optimizer.param_groups
    device: str  # where its parameters step in training ("cpu", "cuda:0")
    path: str  # the optimizer's implementation there: "fused", "foreach", "for-loop" or "own-step"
    arithmetic: str | None  # an emulation's name (fused_adam_math, foreach_adam_math), or None: the CPU's own kernel
    exact: bool  # replay reproduces the training's step bit for bit: by construction, or as the probe measured
    evidence: str  # how that is known, in words

    @classmethod
    def from_json(cls, raw: Any, where: str) -> GroupArithmetic:
        return cls(
            read_field(raw, "group", int, where),
            read_field(raw, "device", str, where),
            read_field(raw, "path", str, where),
            read_field(raw, "arithmetic", (str, type(None)), where),
            read_field(raw, "exact", bool, where),
            read_field(raw, "evidence", str, where),
        )

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "device": self.device, "path": self.path, "arithmetic": self.arithmetic,
                "exact": self.exact, "evidence": self.evidence}

    def describe(self) -> str:
        how = self.arithmetic or "the CPU's own kernel"
        return f"param group {self.group} ({self.path} on {self.device}): {how}, {'bit for bit' if self.exact else 'approximate'} ({self.evidence})"


@dataclass(frozen=True)
class RankSection:
    """What one rank of a distributed checkpoint wrote: its parts, its per-rank state, its own ledger."""

    rank: int
    nbytes: int
    items: dict[str, ItemRecord]
    extra_state: dict[str, Any]  # tagged JSON (extra_state.py): stateful objects and RNG states
    ledger: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, raw: Any, where: str) -> RankSection:
        return cls(
            rank=read_field(raw, "rank", int, where),
            nbytes=read_field(raw, "nbytes", int, where),
            items={str(k): ItemRecord.from_json(v, f"{where} ({k})") for k, v in read_field(raw, "items", dict, where).items()},
            extra_state=read_field(raw, "extra_state", dict, where, {}),
            ledger=read_field(raw, "ledger", (dict, type(None)), where, None),
            stats=read_field(raw, "stats", (dict, type(None)), where, None),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "nbytes": self.nbytes,
            "items": {k: v.to_json() for k, v in self.items.items()},
            "extra_state": self.extra_state,
            "ledger": self.ledger,
            "stats": self.stats,
        }
