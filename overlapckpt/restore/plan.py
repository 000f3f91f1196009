"""Which files of a checkpoint this rank's load reads: the files its DCP load plan names, before anything is read.

A node-local tier's restore fetches a node only the files its ranks read (``tiers.py``),
and each rank checks those before its read (``check.py``). The plan is DCP's own: the
live objects' tensors (a DTensor, its local shard) matched against the chunks
``.metadata`` lists, and the items every rank reads whole (``param_groups``).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.safe_unpickle import SafeLoadPlanner
from ..format.storage import CheckpointStore, translate_read_errors


def files_in_load_plan(store: CheckpointStore, name: str, manifest: Manifest, target: dict[str, Any], is_coordinator: bool) -> frozenset[str]:
    """The data files of checkpoint ``name`` that loading into ``target`` reads on this rank.

    ``.metadata`` is read through the package's reader (plain data only, its size bounded);
    a file it names that the manifest does not list raises CorruptCheckpointError. A target
    that does not fit the checkpoint raises as DCP's planning does (the load itself then
    names the mismatch).
    """
    where = store.checkpoint_url(name)
    reader = store.make_reader(name)
    with translate_read_errors(f"{where}/.metadata"):
        metadata = reader.read_metadata()
    planner = SafeLoadPlanner()
    planner.set_up_planner(target, metadata, is_coordinator)
    plan = planner.create_local_plan()
    files = frozenset(str(metadata.storage_data[item.storage_index].relative_path) for item in plan.items)
    listed = manifest.checksums.files if manifest.checksums is not None else {}
    unlisted = sorted(files - listed.keys())
    if unlisted:
        raise CorruptCheckpointError(f"{where}/.metadata places items in {unlisted[:3]}, which {where}/{MANIFEST_NAME} does not list")
    return files
