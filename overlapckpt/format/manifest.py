"""``overlapckpt.json``: what a checkpoint holds, how it was made, and how to verify it.

Written by the writer process strictly before DCP's ``.metadata`` (the commit
marker), so every committed checkpoint has one. JSON, never pickle.

What it covers (format 4: format 3's fields, the file one line, ``manifest_crc32`` its last member):

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
  manifest, whatever package computed the blob checksums. The last member of the
  object, so the file ends ``"manifest_crc32": "<8 digits>"}`` and nothing nested can be
  taken for it (formats 2 and 3, indented, had it on a line of its own).
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
from .manifest_records import (
    ChecksumsRecord,
    ExportRecord,
    GroupArithmetic,
    ItemRecord,
    RankSection,
    read_ancestors,
    read_field,
    read_ints,
)
from .recent_parses import RecentParses

# DCP's data files, by name: a .metadata or manifest that places bytes anywhere else
# ("../../<another root>/...") is damaged or crafted, and is refused unread.
DATA_FILE_RE = re.compile(r"__[0-9]+_[0-9]+\.distcp", re.ASCII)

MANIFEST_NAME = "overlapckpt.json"
METADATA_NAME = ".metadata"
LATEST_NAME = "latest"
# 2: stored-byte checksums and the manifest's own checksum; 3: tensor checksums in the
# checkpoint's algorithm (CRC32C: 4x zlib's CRC-32, the writer's second pass over the state).
FORMAT_VERSION = 4
LEGACY_FORMAT_VERSION = 1  # tensor CRC-32s only; readable, not verifiable
SELF_CHECKSUM_FIELD = "manifest_crc32"
# With sort_keys and indent=1, a top-level field starts a line with exactly one space,
# so this marker cannot match a nested key of the same name.
_SELF_MARKER = f'"{SELF_CHECKSUM_FIELD}": "'.encode()
_INDENTED_SELF_MARKER = b"\n " + _SELF_MARKER  # formats 2 and 3: indented, the field on a line of its own
_SELF_TAIL = b'"}'  # format 4: the field closes the file
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


_NUMBER = (int, float)  # created_at: a UNIX time, which JSON may hold as an integer or a float


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
        version = read_field(raw, "format_version", int, where)
        checksums = raw.get("checksums")
        step = read_field(raw, "step", int, where)
        return cls(
            format_version=version,
            step=step,
            requested_step=read_field(raw, "requested_step", int, where, step),
            mode=read_field(raw, "mode", str, where),
            window=read_field(raw, "window", int, where),
            nbytes=read_field(raw, "nbytes", int, where),
            created_at=float(read_field(raw, "created_at", _NUMBER, where)),
            torch_version=read_field(raw, "torch_version", str, where, "unknown"),
            items={str(k): ItemRecord.from_json(v, f"{where} ({k})") for k, v in read_field(raw, "items", dict, where).items()},
            world_size=read_field(raw, "world_size", int, where, 1),
            mesh_shape=read_ints(raw, "mesh_shape", where) if "mesh_shape" in raw else (1,),
            run_id=read_field(raw, "run_id", (str, type(None)), where, None),
            restored_from=read_field(raw, "restored_from", (str, type(None)), where, None),
            ancestors=read_ancestors(raw, where),
            checksums=None if checksums is None else ChecksumsRecord.from_json(checksums, f"{where} (checksums)"),
            exports={
                str(k): ExportRecord.from_json(v, where)
                for k, v in read_field(raw, "exports", dict, where, {}).items()
            },
            extra_state=read_field(raw, "extra_state", dict, where, {}),
            extra_state_index=tuple(str(k) for k in read_field(raw, "extra_state_index", list, where, [])),
            ranks=tuple(
                RankSection.from_json(r, f"{where} (rank section {i})") for i, r in enumerate(read_field(raw, "ranks", list, where, []))
            ),
            ledger=read_field(raw, "ledger", (dict, type(None)), where, None),
            stats=read_field(raw, "stats", (dict, type(None)), where, None),
            key_layout=_known_layout(read_field(raw, "key_layout", str, where, GET_STATE_DICT), where),
            optimizer=read_field(raw, "optimizer", (str, type(None)), where, None),
            replay_arithmetic=tuple(
                GroupArithmetic.from_json(r, f"{where} (replay_arithmetic)") for r in read_field(raw, "replay_arithmetic", list, where, [])
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
    # One line, no indent: json's C encoder then writes it (an indent takes the pure-Python one,
    # 0.4 s of a commit's 0.5 s manifest phase at 30,000 tensors). Readers parse it either way.
    encoded = json.dumps(body, sort_keys=True, allow_nan=True).encode("utf-8")
    raw = encoded[:-1] + (b", " if body else b"") + _SELF_MARKER + b"0" * _SELF_DIGITS + _SELF_TAIL
    at = len(raw) - len(_SELF_TAIL) - _SELF_DIGITS
    digits = f"{zlib.crc32(raw) & 0xFFFFFFFF:08x}".encode("ascii")
    return raw[:at] + digits + raw[at + _SELF_DIGITS :]


def _check_self_checksum(raw: bytes, where: str) -> bool:
    """Compare the manifest's CRC-32 with its bytes; False when it has none (format 1)."""
    at = len(raw) - len(_SELF_TAIL) - _SELF_DIGITS  # format 4: the file's last member
    if not (raw.endswith(_SELF_TAIL) and at >= len(_SELF_MARKER) and raw[at - len(_SELF_MARKER) : at] == _SELF_MARKER):
        marker_at = raw.find(_INDENTED_SELF_MARKER)  # formats 2 and 3
        if marker_at < 0:
            return False
        at = marker_at + len(_INDENTED_SELF_MARKER)
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
    """Check the manifest's own checksum, parse it, and sanity-check it; CorruptCheckpointError naming ``where``.

    The same bytes of the same checkpoint parsed again (a load resolves the checkpoint, reading
    its manifest, then reads it for its checks) give the Manifest they gave before: a frozen
    record, parsed from exactly these bytes (a manifest of 30,000 tensors: 0.5 s a parse).
    """
    return _recent_manifests.parsed(where, raw, lambda: _parsed_manifest(raw, where))


# Manifests parsed lately (recent_parses.py), by where they were read and their bytes.
_recent_manifests: RecentParses[Manifest] = RecentParses(entries=4)


def _parsed_manifest(raw: bytes, where: str) -> Manifest:
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
