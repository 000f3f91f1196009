"""``overlapckpt.json``: what a checkpoint holds, how it was made, and how to verify it.

Written by the writer process strictly before DCP's ``.metadata`` (the commit
marker), so every committed checkpoint has one. JSON, never pickle.

What it covers (format 3):

- ``checksums``: the checksum of every blob DCP stored, by file, offset and length
  (tensor data, serialized non-tensor items such as ``param_groups``, and
  torch.save's framing: the blobs tile each shard), and of ``.metadata``'s exact
  bytes; the algorithm is named there (see :mod:`overlapckpt.format.checksum`);
- ``items``: a checksum per tensor of the host snapshot (``checksum``, in the
  algorithm ``checksums`` names; format 2 wrote zlib's CRC-32 as ``crc32``), checked
  at load against the tensor DCP decoded: end to end, it catches a serializer that
  stored the wrong bytes, which checksums of the stored bytes cannot;
- ``manifest_crc32``: zlib's CRC-32 of this file's exact bytes, with the field's
  own 8 hex digits read as zeros. Always CRC-32, so any reader can check the
  manifest, whatever package computed the blob checksums.
"""

from __future__ import annotations

import ctypes
import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from .checksum import hex32, updater
from .key_layout import GET_STATE_DICT, KEY_LAYOUTS, TORCHTITAN

# DCP's data files, by name: a .metadata or manifest that places bytes anywhere else
# ("../../<another root>/...") is damaged or crafted, and is refused unread.
DATA_FILE_RE = re.compile(r"__[0-9]+_[0-9]+\.distcp", re.ASCII)

MANIFEST_NAME = "overlapckpt.json"
METADATA_NAME = ".metadata"
LATEST_NAME = "latest"
# 2: stored-byte checksums and the manifest's own checksum; 3: tensor checksums in the
# checkpoint's algorithm (CRC32C: 4x zlib's CRC-32, the writer's second pass over the state).
FORMAT_VERSION = 3
LEGACY_FORMAT_VERSION = 1  # tensor CRC-32s only; readable, not verifiable
SELF_CHECKSUM_FIELD = "manifest_crc32"
# With sort_keys and indent=1, a top-level field starts a line with exactly one space,
# so this marker cannot match a nested key of the same name.
_SELF_MARKER = f'\n "{SELF_CHECKSUM_FIELD}": "'.encode()
_SELF_DIGITS = 8
CHECKPOINT_PREFIX = "step-"


# ASCII only: str.isdigit() accepts "²", which int() then refuses. The optional suffix is
# a run's id, for a version that another run's committed checkpoint already holds.
_NAME_RE = re.compile(r"(?:step|checkpoint)-([0-9]+)(?:-([0-9a-f]{8}))?", re.ASCII)
RUN_ID_HEX = 16  # a run id is 16 hex digits; names carry its first 8


@dataclass(frozen=True)
class NameStyle:
    """How checkpoint directories are named: a prefix and the step, zero-padded to ``digits`` (0: unpadded)."""

    prefix: str
    digits: int


STEP_NAMES = NameStyle(CHECKPOINT_PREFIX, 9)  # step-000000100: the default, sorted by name too
TITAN_NAMES = NameStyle(CHECKPOINT_PREFIX, 0)  # step-100: what TorchTitan's manager looks for
TRAINER_NAMES = NameStyle("checkpoint-", 0)  # checkpoint-100: what the Hugging Face Trainer's resume looks for
NAME_STYLES = (STEP_NAMES, TITAN_NAMES, TRAINER_NAMES)


def name_style_for(key_layout: str, export_formats: tuple[str, ...] = ()) -> NameStyle:
    """The directory names a run writes: its framework's, where it resumes by them (the Trainer, TorchTitan)."""
    if "hf_trainer" in export_formats:
        return TRAINER_NAMES
    return TITAN_NAMES if key_layout == TORCHTITAN else STEP_NAMES


def checkpoint_name(step: int, run_id: str | None = None, style: NameStyle = STEP_NAMES) -> str:
    """The directory name of the checkpoint holding version ``step`` (``run_id``: the lineage-aware name)."""
    return f"{style.prefix}{step:0{style.digits}d}" + ("" if run_id is None else f"-{run_id[:8]}")


def step_of_name(name: str) -> int | None:
    """The version in a checkpoint directory name, or None for any other name (strictly ``step-`` + digits)."""
    match = _NAME_RE.fullmatch(name)
    return None if match is None else int(match.group(1))


def _known_layout(name: str, where: str) -> str:
    if name not in KEY_LAYOUTS:
        raise CorruptCheckpointError(
            f"{where} names key layout {name!r}, which this overlapckpt does not know (it reads {KEY_LAYOUTS}); "
            "upgrade overlapckpt to read it"
        )
    return name


def _in_place(t: torch.Tensor) -> Any:
    """A CPU tensor's bytes as a buffer, read in place (no copy for contiguous tensors)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    return (ctypes.c_char * nbytes).from_address(t.data_ptr()) if nbytes else b""


def tensor_checksum(t: torch.Tensor, algorithm: str) -> str:
    """The checksum of a CPU tensor's bytes in ``algorithm`` (8 hex digits), read in place."""
    return hex32(updater(algorithm)(_in_place(t), 0))


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
    restored_from: str | None = None  # the checkpoint its run continued from (its lineage), if any
    # The runs its run descends from, nearest first: (run id, the version it continued from).
    ancestors: tuple[tuple[str, int], ...] = ()
    # The tier it was written to or restored from ("root", "local": format/tiers.py); None where it
    # was read from a directory by name (list_checkpoints, read_checkpoint).
    tier: str | None = None

    @classmethod
    def from_manifest(cls, manifest: Manifest, path: str, tier: str | None = None) -> CheckpointInfo:
        return cls(
            step=manifest.step,
            path=path,
            window=manifest.window,
            mode=manifest.mode,
            nbytes=manifest.nbytes,
            created_at=manifest.created_at,
            requested_step=manifest.requested_step,
            torch_version=manifest.torch_version,
            world_size=manifest.world_size,
            run_id=manifest.run_id,
            restored_from=manifest.restored_from,
            ancestors=manifest.ancestors,
            tier=tier,
        )


# ---- the manifest's fields, typed ----------------------------------------------------
#
# Each record reads itself from the JSON (``from_json``, raising CorruptCheckpointError
# that names the field) and writes itself back (``to_json``). The ledger and the stats
# stay JSON objects here: their types belong to the training side, which the format
# never imports; the CLI and ckpt.stats read them as dicts.


def _field(raw: Any, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
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


def _ints(raw: Any, key: str, where: str) -> tuple[int, ...]:
    values = _field(raw, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise CorruptCheckpointError(f"manifest {where} has a malformed field {key!r}: {values!r} is not a list of integers; the file is damaged")
    return tuple(values)


_NUMBER = (int, float)
# A lineage longer than this keeps its nearest runs: older ones' checkpoints were retired long before.
MAX_ANCESTORS = 256


def _ancestors(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    values = _field(raw, "ancestors", list, where, [])
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
            dtype=_field(raw, "dtype", str, where, ""),
            shape=_ints(raw, "shape", where),
            crc32=_field(raw, "crc32", int, where, None),
            offset=_ints(raw, "offset", where) if isinstance(raw, dict) and "offset" in raw else None,
            checksum=_field(raw, "checksum", str, where, None),
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
        metadata = _field(raw, "metadata", dict, where)
        files = {}
        for name, entry in _field(raw, "files", dict, where).items():
            blobs = []
            for blob in _field(entry, "blobs", list, f"{where} ({name})"):
                at = f"{where} ({name})"
                blobs.append(
                    BlobRecord(
                        _field(blob, "key", str, at), _field(blob, "offset", int, at), _field(blob, "length", int, at),
                        _field(blob, "checksum", str, at), _field(blob, "mac", (str, type(None)), at, None),
                    )
                )
            files[str(name)] = FileRecord(
                nbytes=_field(entry, "nbytes", int, f"{where} ({name})"),
                blobs=tuple(blobs),
                mac_nonce=_field(entry, "mac_nonce", (str, type(None)), f"{where} ({name})", None),
            )
        return cls(
            algorithm=_field(raw, "algorithm", str, where),
            metadata_name=_field(metadata, "name", str, where),
            metadata_nbytes=_field(metadata, "nbytes", int, where),
            metadata_checksum=_field(metadata, "checksum", str, where),
            files=files,
            mac_algorithm=_field(raw, "mac_algorithm", (str, type(None)), where, None),
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
            _field(raw, "nbytes", int, where),
            _field(raw, "crc32", int, where),
            _field(raw, "mac", (str, type(None)), where, None),
            _field(raw, "mac_nonce", (str, type(None)), where, None),
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
            _field(raw, "group", int, where),
            _field(raw, "device", str, where),
            _field(raw, "path", str, where),
            _field(raw, "arithmetic", (str, type(None)), where),
            _field(raw, "exact", bool, where),
            _field(raw, "evidence", str, where),
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
            rank=_field(raw, "rank", int, where),
            nbytes=_field(raw, "nbytes", int, where),
            items={str(k): ItemRecord.from_json(v, f"{where} ({k})") for k, v in _field(raw, "items", dict, where).items()},
            extra_state=_field(raw, "extra_state", dict, where, {}),
            ledger=_field(raw, "ledger", (dict, type(None)), where, None),
            stats=_field(raw, "stats", (dict, type(None)), where, None),
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


@dataclass(frozen=True)
class Manifest:
    """``overlapckpt.json``, typed: read by :func:`parse_manifest`, written with :meth:`to_json` and :func:`dump_manifest`."""

    format_version: int
    step: int  # the version it holds
    requested_step: int
    mode: str
    window: int
    nbytes: int  # tensor bytes, every rank's share
    created_at: float
    torch_version: str
    items: dict[str, ItemRecord]
    world_size: int = 1
    mesh_shape: tuple[int, ...] = (1,)
    run_id: str | None = None
    restored_from: str | None = None
    # The lineage its run continued: (run id, version continued from) of each earlier run, nearest
    # first. Retention counts those runs' checkpoints up to those versions as this run's own.
    ancestors: tuple[tuple[str, int], ...] = ()
    checksums: ChecksumsRecord | None = None  # None only in format 1 (not verifiable)
    exports: dict[str, ExportRecord] = field(default_factory=dict)
    extra_state: dict[str, Any] = field(default_factory=dict)  # one process: tagged JSON; distributed: per rank
    extra_state_index: tuple[str, ...] = ()
    ranks: tuple[RankSection, ...] = ()
    ledger: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    key_layout: str = "get_state_dict"  # how the state is named inside DCP (format/key_layout.py)
    # The optimizer class(es) whose state it holds, by full name (None: written before it was recorded).
    optimizer: str | None = None
    # A replay-mode checkpoint: how each param group was replayed, and how exactly (empty otherwise).
    replay_arithmetic: tuple[GroupArithmetic, ...] = ()
    # The JSON as read, for what is checked on the exact document (the signature, inspect --json).
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def extra_state_of(self, rank: int) -> dict[str, Any]:
        """The tagged-JSON stateful objects and RNG states that ``rank`` wrote."""
        if self.ranks:
            if not 0 <= rank < len(self.ranks):
                raise CorruptCheckpointError(f"the manifest has {len(self.ranks)} rank sections; rank {rank} has none")
            return self.ranks[rank].extra_state
        return self.extra_state

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str) -> Manifest:
        version = _field(raw, "format_version", int, where)
        checksums = raw.get("checksums")
        step = _field(raw, "step", int, where)
        return cls(
            format_version=version,
            step=step,
            requested_step=_field(raw, "requested_step", int, where, step),
            mode=_field(raw, "mode", str, where),
            window=_field(raw, "window", int, where),
            nbytes=_field(raw, "nbytes", int, where),
            created_at=float(_field(raw, "created_at", _NUMBER, where)),
            torch_version=_field(raw, "torch_version", str, where, "unknown"),
            items={str(k): ItemRecord.from_json(v, f"{where} ({k})") for k, v in _field(raw, "items", dict, where).items()},
            world_size=_field(raw, "world_size", int, where, 1),
            mesh_shape=_ints(raw, "mesh_shape", where) if "mesh_shape" in raw else (1,),
            run_id=_field(raw, "run_id", (str, type(None)), where, None),
            restored_from=_field(raw, "restored_from", (str, type(None)), where, None),
            ancestors=_ancestors(raw, where),
            checksums=None if checksums is None else ChecksumsRecord.from_json(checksums, f"{where} (checksums)"),
            exports={
                str(k): ExportRecord.from_json(v, where)
                for k, v in _field(raw, "exports", dict, where, {}).items()
            },
            extra_state=_field(raw, "extra_state", dict, where, {}),
            extra_state_index=tuple(str(k) for k in _field(raw, "extra_state_index", list, where, [])),
            ranks=tuple(RankSection.from_json(r, f"{where} (rank section {i})") for i, r in enumerate(_field(raw, "ranks", list, where, []))),
            ledger=_field(raw, "ledger", (dict, type(None)), where, None),
            stats=_field(raw, "stats", (dict, type(None)), where, None),
            key_layout=_known_layout(_field(raw, "key_layout", str, where, GET_STATE_DICT), where),
            optimizer=_field(raw, "optimizer", (str, type(None)), where, None),
            replay_arithmetic=tuple(
                GroupArithmetic.from_json(r, f"{where} (replay_arithmetic)") for r in _field(raw, "replay_arithmetic", list, where, [])
            ),
            raw=raw,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (checksums and exports as they are at the time; the signature is added by signing.py)."""
        out: dict[str, Any] = {
            "format_version": self.format_version,
            "step": self.step,
            "requested_step": self.requested_step,
            "mode": self.mode,
            "window": self.window,
            "nbytes": self.nbytes,
            "created_at": self.created_at,
            "torch_version": self.torch_version,
            "items": {k: v.to_json() for k, v in self.items.items()},
            "world_size": self.world_size,
            "mesh_shape": list(self.mesh_shape),
            "run_id": self.run_id,
            "restored_from": self.restored_from,
            "ancestors": [list(a) for a in self.ancestors],
            "ledger": self.ledger,
            "stats": self.stats,
            "extra_state_index": list(self.extra_state_index),
            "key_layout": self.key_layout,
            "optimizer": self.optimizer,
            **({"replay_arithmetic": [r.to_json() for r in self.replay_arithmetic]} if self.replay_arithmetic else {}),
        }
        if self.ranks:
            out["ranks"] = [r.to_json() for r in self.ranks]
        else:
            out["extra_state"] = self.extra_state
        if self.checksums is not None:
            out["checksums"] = self.checksums.to_json()
        if self.exports:
            out["exports"] = {k: v.to_json() for k, v in self.exports.items()}
        return out


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


def parse_manifest(raw: bytes, where: str) -> Manifest:
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
    if version >= 2 and "checksums" not in manifest:
        raise CorruptCheckpointError(f"manifest {where} lacks the field 'checksums'; the file is damaged")
    return Manifest.from_json(manifest, where)
