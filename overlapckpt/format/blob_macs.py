"""With a signing key, a keyed digest (MAC) of every stored blob: integrity against a forger, not only accident.

CRC-32C finds accidents; anyone who can write a shard can also craft bytes that keep
its CRC (4 bytes fixed up anywhere in a blob suffice). With a signing key, each blob
DCP stores also gets a MAC under the key, computed on the way to storage in the
same pass as its CRC (``checksumming_stream.ChecksummingStream``) and listed in the manifest,
which the signature covers (``signing.py``). A reader with the key checks every
blob's MAC as it reads it (``blob_reader.py``, ``verify.py``).

The MAC, chosen by speed (measured on the 2-core build VM, one thread, 256 MiB in RAM, in
64 MiB updates): AES-256-GMAC 16.8 GiB/s (24 on two threads: OpenSSL releases the GIL),
Poly1305 11.6 (it keeps the GIL), CRC32C 14, SHA-256 with the CPU's SHA extensions 1.7,
BLAKE2b 0.8. Each blob gets its own key, ``HMAC-SHA256(signing key, label | file nonce |
blob offset)``, the file nonce being 16 random bytes drawn per stored file and recorded
in the manifest: a key authenticates one message only, which is what makes a fixed GCM
nonce (and a one-time MAC) safe.

- ``aes256-gmac`` (the ``cryptography`` package: OpenSSL's AES-NI and carry-less
  multiply GHASH): GCM with the blob as additional data and no plaintext;
- ``hmac-sha256``, the standard library's: the fallback where ``cryptography`` is missing
  (the GPU machine), about ten times slower. ``OVERLAPCKPT_BLOB_MAC`` chooses either for
  new checkpoints; a reader uses whatever the manifest names.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, SignatureError

if TYPE_CHECKING:
    from .manifest import Manifest

AES_GMAC = "aes256-gmac"
HMAC_SHA256 = "hmac-sha256"
MAC_ALGORITHMS = (AES_GMAC, HMAC_SHA256)
MAC_ALGORITHM_ENV = "OVERLAPCKPT_BLOB_MAC"
NONCE_NBYTES = 16
_KEY_LABEL = b"overlapckpt blob mac v1\0"
_GCM_NONCE = b"\0" * 12  # safe fixed: every key authenticates one blob


@functools.lru_cache(maxsize=1)
def _gmac_factory() -> Any:
    """``key -> GCM encryptor`` where the ``cryptography`` package runs AES-GCM, else None; probed once per process
    (every blob's MAC asks)."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        return None

    def encryptor(key: bytes) -> Any:
        return Cipher(algorithms.AES(key), modes.GCM(_GCM_NONCE)).encryptor()

    try:
        encryptor(b"\0" * 32)  # an OpenSSL without AES-GCM raises UnsupportedAlgorithm here
    except Exception:
        return None
    return encryptor


def default_mac_algorithm() -> str:
    """The MAC new signed checkpoints use: ``$OVERLAPCKPT_BLOB_MAC``, else AES-GMAC where it runs, else HMAC-SHA256."""
    chosen = os.environ.get(MAC_ALGORITHM_ENV)
    if chosen:
        check_mac_algorithm(chosen, f"{MAC_ALGORITHM_ENV}={chosen!r}")
        return chosen
    return AES_GMAC if _gmac_factory() is not None else HMAC_SHA256


def check_mac_algorithm(algorithm: str, where: str) -> None:
    """ConfigError naming the fix when ``algorithm`` (named by ``where``) cannot run here."""
    if algorithm not in MAC_ALGORITHMS:
        raise ConfigError(f"{where} names the blob MAC {algorithm!r}; overlapckpt knows {MAC_ALGORITHMS}")
    if algorithm == AES_GMAC and _gmac_factory() is None:
        raise ConfigError(
            f"{where} uses the blob MAC {AES_GMAC!r}, which needs the cryptography package: pip install "
            f"'overlapckpt[signing]' (or cryptography); or write with {MAC_ALGORITHM_ENV}={HMAC_SHA256}"
        )


def new_nonce() -> str:
    """A file's nonce, hex: every blob key derived from it is used once."""
    return os.urandom(NONCE_NBYTES).hex()


def blob_key(signing_key: bytes, nonce: str, offset: int) -> bytes:
    """The one-time key of the blob at byte ``offset`` of the file whose nonce is ``nonce``."""
    message = _KEY_LABEL + bytes.fromhex(nonce) + int(offset).to_bytes(8, "big")
    return hmac.new(signing_key, message, hashlib.sha256).digest()


class BlobMac:
    """The MAC of one blob, fed its bytes in order (views of any buffer, without a copy)."""

    def __init__(self, signing_key: bytes, algorithm: str, nonce: str, offset: int) -> None:
        key = blob_key(signing_key, nonce, offset)
        self._gmac: Any = None
        self._hmac: Any = None
        if algorithm == AES_GMAC:
            factory = _gmac_factory()
            if factory is None:
                check_mac_algorithm(algorithm, "this checkpoint")
            self._gmac = factory(key)
        elif algorithm == HMAC_SHA256:
            self._hmac = hmac.new(key, digestmod=hashlib.sha256)
        else:
            check_mac_algorithm(algorithm, "this checkpoint")

    def update(self, data: Any) -> None:
        if self._gmac is not None:
            self._gmac.authenticate_additional_data(data)
        else:
            self._hmac.update(data)

    def hexdigest(self) -> str:
        if self._gmac is not None:
            self._gmac.finalize()
            return str(self._gmac.tag.hex())
        return str(self._hmac.hexdigest())


def mac_of(signing_key: bytes, algorithm: str, nonce: str, offset: int, *parts: Any) -> str:
    """The MAC of the blob whose bytes are ``parts`` in order."""
    mac = BlobMac(signing_key, algorithm, nonce, offset)
    for part in parts:
        mac.update(part)
    return mac.hexdigest()


def same_mac(expected: str, actual: str) -> bool:
    """Compared in constant time."""
    return hmac.compare_digest(expected.encode("ascii", "replace"), actual.encode("ascii", "replace"))


@dataclass(frozen=True)
class BlobMacs:
    """Each blob's MAC under the signing key, from a signed manifest (``blob_macs.py``)."""

    signing_key: bytes
    algorithm: str
    macs: dict[tuple[str, int, int], str]  # (file, offset, length) -> MAC
    nonces: dict[str, str]  # file -> nonce

    @classmethod
    def from_manifest(cls, manifest: Manifest, where: str, signing_key: bytes) -> BlobMacs:
        """SignatureError when the (signed) manifest lacks a blob's MAC: its shard bytes would go unauthenticated."""
        sums = manifest.checksums
        algorithm = None if sums is None else sums.mac_algorithm
        if sums is None or algorithm is None:
            raise SignatureError(
                f"{where} is signed, but its manifest has no keyed digests of its shards (written by an overlapckpt "
                "before 0.9, whose shards only CRCs cover): refused with a signing key. Load it without a key only "
                "if you trust whoever could write it, then save it again to sign its shards"
            )
        check_mac_algorithm(algorithm, where)
        macs: dict[tuple[str, int, int], str] = {}
        nonces: dict[str, str] = {}
        for name, f in sums.files.items():
            for b in f.blobs:
                if b.length == 0:
                    continue
                if b.mac is None or f.mac_nonce is None:
                    raise SignatureError(f"{where}'s signed manifest has no MAC for {b.key!r} in {name}: refused")
                macs[(name, b.offset, b.length)] = b.mac
            if f.mac_nonce is not None:
                nonces[name] = f.mac_nonce
        return cls(signing_key, algorithm, macs, nonces)

    def new_mac(self, relative_path: str, offset: int) -> BlobMac | None:
        """The MAC to feed the bytes of the blob at ``offset`` of ``relative_path``; None for a file without a nonce."""
        nonce = self.nonces.get(relative_path)
        return None if nonce is None else BlobMac(self.signing_key, self.algorithm, nonce, offset)

    def is_mac_of(self, relative_path: str, offset: int, length: int, digest: str | None) -> bool:
        """Whether ``digest`` (a ``new_mac``'s, fed the blob) is the one the manifest lists."""
        if length == 0:
            return True
        expected = self.macs.get((relative_path, offset, length))
        return expected is not None and digest is not None and same_mac(expected, digest)

    def matches(self, relative_path: str, offset: int, length: int, *parts: Any) -> bool:
        """Whether the blob whose bytes are ``parts`` has the MAC the manifest lists."""
        if length == 0:
            return True
        mac = self.new_mac(relative_path, offset)
        if mac is None:
            return False
        for part in parts:
            mac.update(part)
        return self.is_mac_of(relative_path, offset, length, mac.hexdigest())


class MacPipeline:
    """The MACs of one written file's spans, computed on a thread of their own beside the writes.

    A MAC cannot be combined from parts as a CRC can (``known_sums.py``), so every byte is fed
    to it: run inline in the write, it added 42-45 ms to each 768 MiB save on the build VM
    (``benchmarks/signing.py``); here 10-12 ms of it stay on the path
    (``benchmarks/results/signing/signing.md``). GMAC releases the GIL, so this thread hashes
    one chunk while the writer's thread hands the next to storage. Bytes that stay put until the
    save ends (``stable``: a host-snapshot tensor, which the slot protocol keeps unchanged) are
    fed as they are; any other buffer (torch.save's framing, which its writer reuses) is copied
    first, which costs little: those writes are small.
    """

    def __init__(self, signing_key: bytes, algorithm: str, nonce: str) -> None:
        from concurrent.futures import Future, ThreadPoolExecutor

        check_mac_algorithm(algorithm, "this writer's blob MAC")
        self._key, self._algorithm, self._nonce = signing_key, algorithm, nonce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlapckpt-mac")
        self._pending: list[Future[None]] = []  # in order: one thread runs them in submission order
        self._mac: BlobMac | None = None
        self.macs: dict[tuple[int, int], str] = {}  # (start, end) -> MAC, filled by the thread

    def update(self, span_start: int, data: Any, stable: bool) -> None:
        self._pending.append(self._pool.submit(self._update, span_start, data if stable else bytes(data)))

    def close_span(self, start: int, end: int) -> None:
        self._pending.append(self._pool.submit(self._close, start, end))

    def finish(self) -> dict[tuple[int, int], str]:
        """Every span's MAC, once the thread has hashed every byte submitted (the first failure raised)."""
        try:
            for future in self._pending:
                future.result()
        finally:
            self.shut_down()
        return self.macs

    def shut_down(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _update(self, span_start: int, data: Any) -> None:
        if self._mac is None:
            self._mac = BlobMac(self._key, self._algorithm, self._nonce, span_start)
        self._mac.update(data)

    def _close(self, start: int, end: int) -> None:
        if self._mac is not None:
            self.macs[(start, end)] = self._mac.hexdigest()
            self._mac = None
