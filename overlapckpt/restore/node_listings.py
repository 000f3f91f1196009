"""Every node's local tier, digested and pooled: which versions are complete across the nodes, and what a node lacks.

Each node's lowest rank digests its node's tier (``tier_listing``): per committed checkpoint, one
``TierDigest`` (the manifest's SHA-256, a few sizes, and the files it holds as the shortest of
"every one", a bitmap and their indices: ``held_files.py``), never their names; the ranks gather the digests, and ``NodeListings`` answers what a
restore asks of them (``restore/tiers.py`` chooses the source): the newest version of this world
size whose every file some node holds, on this run's lineage first (``tier_lineage``: what the
tier's ``latest`` names), and the copies that bring each node the files its ranks read. The
file names are read by each node from its own copy of the chosen checkpoint's manifest
(``agreed_file_table``), once the head fetch gave it one: no file list crosses the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ..errors import CheckpointReadError, CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME, METADATA_NAME, Manifest
from ..format.private_files import SMALL_FILE_MAX_BYTES
from ..format.tiers import tier_refusal, tier_store
from ..format.verify import read_manifest, read_manifest_and_bytes
from ..protocol import FileCopy
from .held_files import decode_held, encode_held

log = logging.getLogger("overlapckpt.restore")


@dataclass(frozen=True)
class TierDigest:
    """What one node's tier holds of one committed checkpoint, in bytes that do not grow with its files' names.

    Gathered from every node at a restore, one per node per checkpoint (pickled as its values,
    ``__reduce__``, without its field names). What it holds follows the checkpoint's ``FileTable``
    (the data files in name order, then ``.metadata``, then the manifest), encoded as the shortest
    of every file, a bitmap or the indices (``held_files.py``).
    """

    version: int  # the manifest's step
    run_id: str  # the manifest's run ("" when it names none): the lineage rules choose by it
    manifest_sha256: bytes  # of the manifest's bytes as read (32): nodes agree on a checkpoint by it, not by its name
    files: int  # the file table's length: the data files, .metadata and the manifest
    # File i held (``decode_held``): this node holds it as a regular file of the manifest's size
    # (the manifest itself: of the size hashed, within SMALL_FILE_MAX_BYTES).
    held_files: bytes
    # The two head files' sizes: a node lacking both is sent them before it can read any name.
    metadata_nbytes: int  # as the manifest gives it
    manifest_nbytes: int  # the bytes hashed

    def __reduce__(self) -> tuple[type[TierDigest], tuple[int, str, bytes, int, bytes, int, int]]:
        return (TierDigest, (self.version, self.run_id, self.manifest_sha256, self.files, self.held_files, self.metadata_nbytes, self.manifest_nbytes))

    def held(self) -> int:
        """The held files as one integer (bit i: file i), none beyond the table."""
        return decode_held(self.held_files, self.files)

    def checkpoint(self) -> tuple[bytes, int, str, int, int, int]:
        """What every node holding this checkpoint must agree on: all but what it holds."""
        return (self.manifest_sha256, self.version, self.run_id, self.files, self.metadata_nbytes, self.manifest_nbytes)


# A node's tier, digested: by checkpoint name.
Listing = dict[str, TierDigest]


@dataclass(frozen=True)
class FileTable:
    """A checkpoint's files in its digests' bit order, each with the size its manifest gives (-1: the manifest, which gives none)."""

    names: tuple[str, ...]
    nbytes: tuple[int, ...]

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> FileTable:
        """The data files in name order, then .metadata, then the manifest (a manifest of format 1 lists none: CorruptCheckpointError)."""
        sums = manifest.checksums
        if sums is None:
            raise CorruptCheckpointError(f"a manifest of step {manifest.step} lists no files (format 1): it cannot be restored from a node-local tier")
        data = sorted(sums.files)
        return cls((*data, sums.metadata_name, MANIFEST_NAME), (*(sums.files[f].nbytes for f in data), sums.metadata_nbytes, -1))

    @cached_property
    def index(self) -> dict[str, int]:
        """Each file's bit index."""
        return {file: i for i, file in enumerate(self.names)}

    def indices(self, name: str, files: Collection[str]) -> frozenset[int]:
        """The bit indices of ``files`` of checkpoint ``name``.

        A file the manifest does not list is refused (CorruptCheckpointError): the name came from
        storage (a load plan read from .metadata), and only the manifest's files are copied.
        """
        unknown = sorted(set(files) - self.index.keys())
        if unknown:
            raise CorruptCheckpointError(f"the local tiers' checkpoint {name} is read from {unknown[:3]}, which its manifest does not list")
        return frozenset(self.index[file] for file in files)


def tier_listing(local_dir: str, world: int, root: str) -> Listing:
    """A digest of each checkpoint this node's tier holds that was written at ``world`` ranks (those whose manifest reads).

    Its warnings' stacklevel (6) names the frame ``from_newest_tier``'s own warnings name (two above
    it), through ``local_candidate`` and ``_pooled_listings`` (``restore/tiers.py``).

    Nothing, with a warning naming why, when the directory is not this job's tier of ``root``
    (``format/tiers.py``: a symlink, another user's, writable by others, or another root's).
    Each file is ``lstat``ed on its own: only regular files count as held, so a dangling or
    planted link, a FIFO or an unreadable entry makes its checkpoint incomplete, not the restore fail.
    """
    refusal = tier_refusal(local_dir, root)
    if refusal is not None:
        warnings.warn(f"overlapckpt: the node-local tier {local_dir} is not read: {refusal}; restoring from the root {root}", stacklevel=6)
        return {}
    if not os.path.isdir(local_dir):
        return {}
    store = tier_store(local_dir)
    out: Listing = {}
    for name in store.committed_names():
        try:
            manifest, raw = read_manifest_and_bytes(store, name)
        except (CorruptCheckpointError, CheckpointReadError) as e:
            warnings.warn(f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: {e}", stacklevel=6)
            continue
        if manifest.world_size != world or manifest.checksums is None:
            log.info(
                "the local tier's %s was written by %d ranks, and this run has %d (or it lists no files): not restored from "
                "the local tier; the root reshards", store.checkpoint_url(name), manifest.world_size, world,
            )
            continue
        if manifest.checksums.metadata_nbytes > SMALL_FILE_MAX_BYTES:
            warnings.warn(
                f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: its manifest gives .metadata "
                f"{manifest.checksums.metadata_nbytes} bytes, above the {SMALL_FILE_MAX_BYTES} a .metadata may hold", stacklevel=6,
            )
            continue
        table = FileTable.of_manifest(manifest)
        # The head files sit at fixed places in the bits, so that a node without the manifest can be
        # sent them by name; a manifest that names them otherwise is not of overlapckpt's writing.
        if table.names[-2] != METADATA_NAME or len(table.index) != len(table.names):
            warnings.warn(
                f"overlapckpt: the local tier's {store.checkpoint_url(name)} is skipped: its manifest names its .metadata "
                f"{table.names[-2]!r} or lists a data file under the name of .metadata or of the manifest; overlapckpt writes "
                f"neither: restore from the root, which verify checks", stacklevel=6,
            )
            continue
        held = _regular_files(os.path.join(local_dir, name))
        bits = 0
        for i, (file, nbytes) in enumerate(zip(table.names, table.nbytes)):
            # The manifest: the size hashed (read and checked here), within the small-file cap.
            expected = len(raw) if nbytes < 0 else nbytes
            if held.get(file) == expected and (nbytes >= 0 or expected <= SMALL_FILE_MAX_BYTES):
                bits |= 1 << i
        out[name] = TierDigest(
            version=manifest.step,
            run_id=manifest.run_id or "",
            manifest_sha256=hashlib.sha256(raw).digest(),
            files=len(table.names),
            held_files=encode_held(bits, len(table.names)),
            metadata_nbytes=manifest.checksums.metadata_nbytes,
            manifest_nbytes=len(raw),
        )
    return out


def agreed_file_table(local_dir: str, name: str, digest: TierDigest) -> FileTable:
    """The file table of ``name`` as this node's tier holds it, once the nodes agreed on ``digest``'s manifest.

    Read and checked as any manifest is (``read_manifest``); CorruptCheckpointError when its
    SHA-256 is not the agreed one (another checkpoint's under the name, or a copy that changed).
    """
    store = tier_store(local_dir)
    manifest, raw = read_manifest_and_bytes(store, name)
    sha256 = hashlib.sha256(raw).digest()
    if sha256 != digest.manifest_sha256:
        raise CorruptCheckpointError(
            f"{store.checkpoint_url(name)}'s manifest has SHA-256 {sha256.hex()[:16]}..., not the {digest.manifest_sha256.hex()[:16]}... "
            "the nodes agreed on: this node holds another checkpoint under its name; remove it, or restore from the root"
        )
    table = FileTable.of_manifest(manifest)
    if len(table.names) != digest.files:
        raise CorruptCheckpointError(
            f"{store.checkpoint_url(name)}'s manifest lists {len(table.names)} files, and the digest the nodes agreed on "
            f"{digest.files}: a digest was not made from this manifest; restore from the root"
        )
    return table


def _regular_files(directory: str) -> dict[str, int]:
    """The regular files of ``directory`` and their sizes; links, FIFOs and entries that cannot be ``lstat``ed are left out."""
    held: dict[str, int] = {}
    try:
        names = os.listdir(directory)
    except OSError as e:
        log.info("the local tier's %s cannot be listed (%s): taken as holding nothing", directory, e)
        return held
    for file in names:
        try:
            st = os.lstat(os.path.join(directory, file))
        except OSError as e:
            log.warning("the local tier's %s/%s cannot be read (%s): not counted as held", directory, file, e)
            continue
        if stat.S_ISREG(st.st_mode):
            held[file] = st.st_size
        else:
            log.warning("the local tier's %s/%s is not a regular file (a link, a FIFO or a device): not counted as held", directory, file)
    return held


def tier_lineage(local_dir: str) -> dict[str, int]:
    """The runs of the lineage the tier's ``latest`` names, each with the newest version of it on that lineage; {} if none.

    ``latest``'s run counts to any version, each ancestor to the version it was continued from:
    a rollback's abandoned branch (an ancestor's checkpoints newer than the fork) is not on it.
    """
    store = tier_store(local_dir)
    latest = store.read_latest()
    if latest is None:
        return {}
    try:
        manifest = read_manifest(store, latest)
    except (CorruptCheckpointError, CheckpointReadError) as e:
        log.info("the local tier's latest, %s, cannot be read (%s): versions are chosen without it", latest, e)
        return {}
    if manifest.run_id is None:
        return {}
    lineage = {manifest.run_id: _ANY_VERSION}
    for run_id, version in manifest.ancestors:
        lineage.setdefault(run_id, version)
    return lineage


_ANY_VERSION = 2**62


@dataclass
class NodeListings:
    """Every node's digests (by node key), and each node's lowest rank, which receives and sends for it.

    ``lineage``: the runs of the lineage the tiers' ``latest`` names (``tier_lineage``), empty when unknown.
    Every rank builds it from the same gathered digests, so every rank computes the same copies.
    """

    listings: dict[str, Listing]
    leaders: dict[str, int]
    lineage: dict[str, int] = field(default_factory=dict)
    # What each node holds now, by checkpoint (bit i: file i): its digests' bits, and the files
    # fetched to it since (``received``).
    held: dict[str, dict[str, int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.held = {node: {name: digest.held() for name, digest in listing.items()} for node, listing in self.listings.items()}

    @classmethod
    def from_gathered(cls, nodes_by_rank: list[tuple[str, Listing]], lineage: dict[str, int] | None = None) -> NodeListings:
        leaders: dict[str, int] = {}
        for rank, (node, _) in enumerate(nodes_by_rank):
            leaders.setdefault(node, rank)
        return cls({node: nodes_by_rank[rank][1] for node, rank in leaders.items()}, leaders, dict(lineage or {}))

    def on_lineage(self, version: int, run_id: str) -> bool:
        """Whether ``run_id``'s checkpoint of ``version`` is on the lineage ``latest`` names (True when that is unknown)."""
        return not self.lineage or version <= self.lineage.get(run_id, -1)

    def newest_complete(self, step: int | None, root_version: int | None) -> tuple[str, int] | None:
        """(name, version) of the newest version whose every file some node holds, or None.

        As the root resolves a version: among equal versions, the one on the lineage ``latest``
        names wins; without a step, a checkpoint off that lineage (a branch a rollback
        abandoned) is never chosen. It is refused below the root's version, and where nodes
        hold different manifests under one name.
        """
        entries = sorted(
            {(d.version, self.on_lineage(d.version, d.run_id), d.run_id, name) for listing in self.listings.values() for name, d in listing.items()},
            reverse=True,
        )
        for version, on_lineage, _, name in entries:
            if step is not None and version != step:
                continue
            if step is None and not on_lineage:
                log.info("the local tier's %s is off the lineage its latest names (a rollback abandoned it): not restored", name)
                continue
            if step is None and root_version is not None and version < root_version:
                log.info(
                    "the root holds version %d, newer than the local tier's newest complete version %d: restoring from the root",
                    root_version, version,
                )
                return None
            if len({d.checkpoint() for d in self._holding(name).values()}) > 1:
                log.info("checkpoint %s is another run's on some node: not restored from the local tiers", name)
                continue
            digest = self.digest(name)
            if digest.files < 2 or max(digest.metadata_nbytes, digest.manifest_nbytes) > SMALL_FILE_MAX_BYTES:  # a digest is not signed
                log.info(
                    "checkpoint %s's digest lists %d files, or gives a head file above %d bytes: not restored from the local tiers",
                    name, digest.files, SMALL_FILE_MAX_BYTES,
                )
                continue
            lacking = self.missing_on_every_node(name)
            if lacking:
                first = (lacking & -lacking).bit_length() - 1
                log.info(
                    "version %d in the local tiers lacks file %d of its %d (in its manifest's order: data files, .metadata, the "
                    "manifest) on every node: an older version is considered", version, first, digest.files,
                )
                continue
            return name, version
        return None

    def digest(self, name: str) -> TierDigest:
        """The digest of ``name`` (a holder's: once ``newest_complete`` chose it, every holder's is the same but for its bits)."""
        return next(iter(self._holding(name).values()))

    def missing_on_every_node(self, name: str) -> int:
        """The files of ``name`` no node holds (bit i: file i)."""
        union = 0
        for node in self.listings:
            union |= self.held[node].get(name, 0)
        return ((1 << self.digest(name).files) - 1) & ~union

    def missing(self, name: str) -> int:
        """How many files of ``name`` the nodes lack, all nodes together."""
        every = (1 << self.digest(name).files) - 1
        return sum((every & ~self.held[node].get(name, 0)).bit_count() for node in self.listings)

    def lacking(self, node: str, name: str, files: Iterable[int]) -> tuple[int, ...]:
        """Of ``files`` (bit indices) of ``name``, those ``node`` does not hold, in order."""
        held = self.held[node].get(name, 0)
        return tuple(sorted(i for i in files if not held >> i & 1))

    def head_copies(self, name: str) -> list[FileCopy]:
        """The copies that give each node lacking them ``.metadata`` and the manifest: named and sized by the digests alone."""
        digest = self.digest(name)
        head = {digest.files - 2: (METADATA_NAME, digest.metadata_nbytes), digest.files - 1: (MANIFEST_NAME, digest.manifest_nbytes)}
        return self._copies(name, dict.fromkeys(self.listings, frozenset(head)), lambda i: head[i])

    def copies(self, name: str, table: FileTable, wanted: Mapping[str, frozenset[int] | None]) -> list[FileCopy]:
        """The copies that give each node the files of ``name`` it wants (bit indices of ``table``; None: all), each from a node holding it.

        A node ``wanted`` does not name wants none. ``table``: this node's ``agreed_file_table``.
        """
        digest = self.digest(name)
        if len(table.names) != digest.files:
            raise CorruptCheckpointError(f"the local tiers' checkpoint {name} lists {len(table.names)} files, and its digests {digest.files}")
        every = frozenset(range(digest.files))
        # The manifest's size, never a digest's, for a data file or .metadata: a digest is not signed.
        # The manifest's own file has no size in it: the hashed size, which the small-file cap bounds.
        return self._copies(
            name,
            {node: every if files is None else files for node, files in wanted.items()},
            lambda i: (table.names[i], table.nbytes[i] if table.nbytes[i] >= 0 else digest.manifest_nbytes),
        )

    def received(self, name: str, copies: list[FileCopy], table: FileTable | None = None) -> None:
        """Note the files a fetch gave each node. ``table``: this node's file table (None: the head fetch, which names .metadata and the manifest only)."""
        files = self.digest(name).files
        index = table.index if table is not None else {METADATA_NAME: files - 2, MANIFEST_NAME: files - 1}
        by_leader = {rank: node for node, rank in self.leaders.items()}
        for copy in copies:
            held = self.held[by_leader[copy.target]]
            held[name] = held.get(name, 0) | 1 << index[copy.filename]

    def _copies(self, name: str, wanted: dict[str, frozenset[int]], file_of: Callable[[int], tuple[str, int]]) -> list[FileCopy]:
        """Each node's wanted files it lacks, in name order, each from a node holding it, the nodes spread over in turn."""
        copies: list[FileCopy] = []
        for node in sorted(self.listings, key=self.leaders.__getitem__):
            lacking = sorted(self.lacking(node, name, wanted.get(node, frozenset())), key=lambda i: file_of(i)[0])
            for k, i in enumerate(lacking):
                holders = self._holders(name, i)
                source = holders[k % len(holders)]  # spread over the nodes that hold it
                file, nbytes = file_of(i)
                copies.append(FileCopy(self.leaders[source], self.leaders[node], file, nbytes))
        return copies

    def _holding(self, name: str) -> dict[str, TierDigest]:
        return {node: listing[name] for node, listing in self.listings.items() if name in listing}

    def _holders(self, name: str, file: int) -> list[str]:
        return sorted((node for node, held in self.held.items() if held.get(name, 0) >> file & 1), key=self.leaders.__getitem__)
