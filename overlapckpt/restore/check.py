"""Checking a checkpoint before anything is read: the signature, the manifest's fields, its files' sizes, and that it fits the live objects."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    OverlapCkptError,
)
from ..format.entries import check_shapes, flatten_tensors
from ..format.expected_sums import verification_refusal
from ..format.extra_state import decode
from ..format.manifest import METADATA_NAME, Manifest
from ..format.signing import check_signature, resolve_key
from ..format.storage import CheckpointStore, translate_read_errors
from ..format.verify import VerifyShare, describe_problems, verify_checkpoint
from ..optimizers import update_rule_name

PER_RANK_STATE_CHOICES = ("restore", "skip")


def check_signed(store: CheckpointStore, name: str, manifest: Manifest, signing_key: str | bytes | None) -> bytes | None:
    """With a key (``signing_key`` or the environment), refuse unsigned and forged checkpoints, whatever verify says.

    Returns the key (None without one): the read that follows checks each blob's MAC with it (``format/blob_macs.py``).
    """
    key = resolve_key(signing_key)
    if key is None:
        return None
    with translate_read_errors(store.checkpoint_url(name)):
        metadata_bytes = store.read_bytes(name, METADATA_NAME)
    check_signature(manifest.raw, metadata_bytes, key, store.checkpoint_url(name))
    return key


@dataclass(frozen=True)
class ManifestChecks:
    """What ``checked_manifest`` checks on this rank before anything is read."""

    share: VerifyShare  # which files this rank checks (1/N of them, or a local tier's directory's), and the world size
    per_rank_state: str  # "restore": the world size must be the one that wrote it; "skip": any
    verify: bool  # .metadata's bytes and every shard's kind and size, before reading


def checked_manifest(
    store: CheckpointStore,
    name: str,
    manifest: Manifest,
    checks: ManifestChecks,
    target: dict[str, Any] | Callable[[str], dict[str, Any]],
) -> Manifest:
    """``manifest`` (``name``'s, as the caller read it and checked its signature), once everything that can
    be checked before reading has passed: the very bytes whose signature held, not a second read."""
    where = store.checkpoint_url(name)
    try:
        return _checked_fields(store, name, manifest, checks, target, where)
    except OverlapCkptError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        # A manifest whose checksum matches but whose fields have the wrong types: named, and
        # raised as an OverlapCkptError so every rank agrees on it before any collective.
        raise CorruptCheckpointError(f"{where}/overlapckpt.json has a malformed field: {type(e).__name__}: {e}") from e


def _checked_fields(
    store: CheckpointStore,
    name: str,
    manifest: Manifest,
    checks: ManifestChecks,
    target: dict[str, Any] | Callable[[str], dict[str, Any]],
    where: str,
) -> Manifest:
    if callable(target):
        target = target(manifest.key_layout)
    world = checks.share.world_size
    saved_world = manifest.world_size
    if checks.per_rank_state == "restore" and saved_world != world:
        raise CheckpointMismatchError(
            f"{where} was written by {saved_world} rank(s) and is loaded by {world}: its stateful objects and RNG "
            "states are per rank and cannot be restored here; load at the same world size, or pass "
            "per_rank_state='skip' to restore model and optimizer only"
        )
    if checks.verify:
        # Before reading: .metadata's bytes, and every shard's kind and size (each rank of a
        # distributed load checks a 1/N share of the files; a rank that finds damage fails,
        # and the agreement below makes every rank raise). The blobs are checked as they
        # are read, once, in read_into (format/blob_reader.py). This is integrity (a
        # flipped bit, a truncated shard), not authenticity: whoever can write the files can
        # recompute CRCs. What keeps a crafted file from running code is the reading itself
        # (safe_unpickle.py), with or without verify.
        report = verify_checkpoint(store, name, manifest, checks.share, read_blobs=False)
        if not report.ok:
            # The detailed account (which blob a truncation cuts): read everything, once, on failure only.
            report = verify_checkpoint(store, name, manifest, checks.share)
            raise verification_refusal(where, describe_problems(report))
    expected = {k: v.shape for k, v in manifest.items.items()}
    check_shapes(expected, flatten_tensors(target))
    return manifest


def per_rank_extra_state(manifest: Manifest, rank: int) -> dict[str, Any]:
    return decode(manifest.extra_state_of(rank))


def check_stateful_names(extra: dict[str, Any], stateful: dict[str, Any], where: str) -> None:
    saved = extra.get("stateful", {})
    missing = [name for name in stateful if name not in saved]
    if missing:
        raise CheckpointMismatchError(
            f"stateful objects {missing} are not in {where}, which holds {sorted(saved)}; pass the same "
            "stateful names that were saved"
        )


def warn_of_stateful_not_given(extra: dict[str, Any], stateful: dict[str, Any], where: str) -> None:
    """A checkpoint's stateful objects that load() was not given stay as they are: warn (a user may mean it)."""
    not_given = sorted(set(extra.get("stateful", {})) - set(stateful))
    if not_given:
        warnings.warn(
            f"overlapckpt: {where} holds stateful objects {not_given} that load() was not given: they are not restored "
            f"(an LR scheduler's lr is, in the optimizer, but not its position, last_epoch). Pass "
            f"stateful={{{', '.join(repr(n) + ': ...' for n in not_given)}}} to restore them",
            stacklevel=3,
        )


def check_optimizer_matches(manifest: Manifest, optimizer: Any, where: str) -> None:
    """The live optimizer has the update rule whose state the checkpoint holds (checkpoints that record it)."""
    live = update_rule_name(optimizer)
    if manifest.optimizer is not None and manifest.optimizer != live:
        raise CheckpointMismatchError(
            f"{where} holds the state of a {manifest.optimizer}, and is loaded into a {live}: the state would be "
            "restored into an optimizer that reads it differently. Build the optimizer that was saved, or pass "
            "optimizer=None to restore the model only"
        )


def check_items_stored(manifest: Manifest, target: dict[str, Any], where: str) -> None:
    """Every non-tensor item the live objects have is stored (tensors: ``check_shapes``), before any read.

    An LR scheduler attached to the optimizer adds ``initial_lr`` to its param_groups; a
    checkpoint written without one lacks it, which DCP reported as a corrupt checkpoint
    ("Missing key ... initial_lr"): it is a mismatch of the objects, named here.
    """
    try:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # a torch without it: DCP names the key itself when it reads
        return
    if manifest.checksums is None:
        return  # format 1: no record of the stored keys
    stored = {blob.key.split("@", 1)[0] for f in manifest.checksums.files.values() for blob in f.blobs}
    flat, _ = flatten_state_dict(target)
    missing = sorted(k for k, v in flat.items() if not isinstance(v, torch.Tensor) and k not in stored)
    if not missing:
        return
    if any(k.endswith(".initial_lr") for k in missing):
        why = (
            "an LR scheduler attached to the optimizer adds 'initial_lr' to its param_groups, and the checkpoint was "
            "written without one: create the scheduler after load(), or save with it (stateful={'scheduler': ...})"
        )
    else:
        why = "the optimizer's param_groups differ from the saved ones: build the optimizer with the options that were saved"
    raise CheckpointMismatchError(f"the objects being loaded have {missing[:5]} that {where} does not store: {why}")
