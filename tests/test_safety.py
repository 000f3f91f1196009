"""No code from a checkpoint: crafted pickles in .metadata and in a byte item, through load and the CLI.

The attacker here can write the checkpoint's files and recompute every checksum (they
are CRCs: integrity, not authenticity). Each crafted file carries a payload that
would create a marker file; the marker must never appear, and the refusal must name
the file and the global.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch

from overlapckpt import Checkpointer, UnsafeCheckpointError, load
from overlapckpt.cli import main
from overlapckpt.format.checksum import checksum_bytes, hex32
from overlapckpt.format.manifest import dump_manifest

from helpers import make_run, train_step

STEP = "step-000000003"


class _Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(root: Path) -> Path:
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root) as ckpt:
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
    return root / STEP


def _recompute_checksums(ckpt: Path, shard_blob: dict | None = None) -> None:
    """What an attacker does after editing files: fix the manifest's checksums, then its own."""
    manifest = json.loads((ckpt / "overlapckpt.json").read_text())
    sums = manifest["checksums"]
    metadata = (ckpt / ".metadata").read_bytes()
    sums["metadata"]["checksum"] = hex32(checksum_bytes(sums["algorithm"], metadata))
    sums["metadata"]["nbytes"] = len(metadata)
    if shard_blob is not None:
        whole = (ckpt / shard_blob["file"]).read_bytes()
        data = whole[shard_blob["offset"] :]
        sums["files"][shard_blob["file"]]["nbytes"] = len(whole)
        sums["files"][shard_blob["file"]]["blobs"].append(
            {"checksum": hex32(checksum_bytes(sums["algorithm"], data)), "key": shard_blob["key"], "length": len(data), "offset": shard_blob["offset"]}
        )
    manifest.pop("manifest_crc32", None)
    (ckpt / "overlapckpt.json").write_bytes(dump_manifest(manifest))


def _craft_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _recompute_checksums(ckpt)


def _craft_byte_item(ckpt: Path, marker: Path) -> None:
    """Point the optimizer's lr byte item at a torch.save of the payload, appended to the shard."""
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())  # our own, honest file
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    info = metadata.storage_data[key]
    shard = ckpt / str(info.relative_path)
    offset = shard.stat().st_size
    buffer = io.BytesIO()
    torch.save(_Payload(marker), buffer)
    with open(shard, "ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = type(info)(relative_path=info.relative_path, offset=offset, length=len(buffer.getvalue()))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _recompute_checksums(ckpt, {"file": str(info.relative_path), "offset": offset, "key": key.fqn})


@pytest.mark.parametrize("craft, needle", [(_craft_metadata, "posix.system"), (_craft_byte_item, "optimizer.param_groups.0.lr")], ids=["metadata", "byte-item"])
def test_a_crafted_checkpoint_runs_no_code(tmp_path, capsys, craft, needle):
    ckpt = _checkpoint(tmp_path / "root")
    marker = tmp_path / "marker"
    craft(ckpt, marker)
    assert main(["verify", str(tmp_path / "root"), "--step", "3"]) == 0  # the checksums were recomputed: integrity only
    for verify in (True, False):
        model, opt, _, _ = make_run(seed=5)
        with pytest.raises(UnsafeCheckpointError, match=needle) as info:
            load(str(tmp_path / "root"), model, opt, verify=verify)
        assert not marker.exists(), f"the payload ran (verify={verify})"
        assert "refused" in str(info.value) or "not DCP metadata" in str(info.value)
    for command in (["ls", str(tmp_path / "root")], ["inspect", str(ckpt)], ["verify", str(tmp_path / "root")]):
        main(command)
        assert not marker.exists(), f"overlapckpt {command[0]} ran the payload"
    capsys.readouterr()


def test_stock_dcp_metadata_of_every_kind_is_allowed(tmp_path):
    """The allowlist admits what DCP writes: the precondition of the refusals above."""
    from overlapckpt.format.safe_read import load_metadata

    ckpt = _checkpoint(tmp_path)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = load_metadata(f, str(ckpt / ".metadata"))
    assert "optimizer.param_groups.0.lr" in metadata.state_dict_metadata
    assert zlib.crc32((ckpt / ".metadata").read_bytes()) != 0
