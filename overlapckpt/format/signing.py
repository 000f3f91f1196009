"""Optional signing: an HMAC-SHA256 over the manifest, and a SHA-256 of ``.metadata`` inside it.

Checksums are integrity: whoever can write the files can recompute them. With a
signing key (``signing_key=`` or ``OVERLAPCKPT_SIGNING_KEY``), the writer adds a
``signature`` to the manifest: the SHA-256 of ``.metadata``'s bytes and an
HMAC-SHA256, keyed, over the manifest's canonical JSON (every field but the MAC and
the manifest's own CRC). ``load`` and ``verify`` with a key refuse an unsigned
checkpoint, a forged MAC and a ``.metadata`` that is not the one signed, with a
``SignatureError``.

What the signature covers: the manifest (version, lineage, ledger, stateful objects
and RNG states, per-item CRCs, and a MAC of every shard blob and framework file) and
``.metadata`` exactly. So every stored byte is authenticated: the shards by their
blobs' MACs under the same key (``blob_macs.py``: AES-256-GMAC, keyed per blob), which a
load with the key checks as it reads each blob and ``verify`` checks for every blob.
A CRC alone would not do: a forger can craft bytes that keep a CRC-32C.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from ..errors import ConfigError, SignatureError

SIGNING_KEY_ENV = "OVERLAPCKPT_SIGNING_KEY"
SIGNATURE_FIELD = "signature"
ALGORITHM = "hmac-sha256"


def resolve_key(signing_key: str | bytes | None) -> bytes | None:
    """The key as bytes: the argument, else ``OVERLAPCKPT_SIGNING_KEY``, else None (no signing)."""
    key = signing_key if signing_key is not None else os.environ.get(SIGNING_KEY_ENV)
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, bytes) or len(key) < 16:
        raise ConfigError(
            f"signing_key has {len(key) if isinstance(key, bytes) else type(key).__name__} bytes; pass at least 16 "
            f"bytes of secret (a str or bytes), or set {SIGNING_KEY_ENV}"
        )
    return key


def _canonical(manifest: dict[str, Any]) -> bytes:
    signed = {k: v for k, v in manifest.items() if k not in ("manifest_crc32",)}
    signature = dict(signed.get(SIGNATURE_FIELD) or {})
    signature.pop("mac", None)
    signed[SIGNATURE_FIELD] = signature
    return json.dumps(signed, sort_keys=True, separators=(",", ":")).encode("utf-8")


def sign(manifest: dict[str, Any], metadata_bytes: bytes, key: bytes) -> None:
    """Add the signature to ``manifest`` in place (before it is written)."""
    manifest[SIGNATURE_FIELD] = {"algorithm": ALGORITHM, "metadata_sha256": hashlib.sha256(metadata_bytes).hexdigest()}
    manifest[SIGNATURE_FIELD]["mac"] = hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def check_signature(manifest: dict[str, Any], metadata_bytes: bytes, key: bytes, where: str) -> None:
    """Raise SignatureError unless ``manifest`` is signed with ``key`` and ``.metadata`` is the one signed."""
    signature = manifest.get(SIGNATURE_FIELD)
    if not isinstance(signature, dict) or not isinstance(signature.get("mac"), str):
        raise SignatureError(
            f"{where} is not signed, and a signing key is set: refused. Load it without a key only if you trust "
            "whoever could write it"
        )
    if signature.get("algorithm") != ALGORITHM:
        raise SignatureError(f"{where} is signed with {signature.get('algorithm')!r}; this overlapckpt checks {ALGORITHM!r}")
    expected = hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, signature["mac"]):
        raise SignatureError(f"{where}'s signature does not match: forged, or signed with another key: refused")
    if not hmac.compare_digest(hashlib.sha256(metadata_bytes).hexdigest(), str(signature.get("metadata_sha256"))):
        raise SignatureError(f"{where}'s .metadata is not the one that was signed: refused")
