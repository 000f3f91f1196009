"""Retention's reading of manifests: each one parsed once, by content, so a replaced file is read again."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer
from overlapckpt.format.manifest import MANIFEST_NAME, dump_manifest
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.writer import retention


@pytest.fixture
def three_checkpoints(tmp_path):
    """A root with three committed checkpoints of one run (no retention), and its run id."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(model, opt, tmp_path, every=1) as ckpt:
        for _ in range(3):
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
    assert [i.step for i in infos] == [1, 2, 3]
    store = CheckpointStore(str(tmp_path))
    run_id = json.loads(store.read_bytes("step-000000003", MANIFEST_NAME))["run_id"]
    return store, run_id


@pytest.fixture
def parses(monkeypatch):
    """A fresh lineage memory, and the names of the manifests retention parsed."""
    monkeypatch.setattr(retention, "_lineage_by_content", {})
    seen: list[str] = []
    real = retention.parse_manifest

    def counting(raw, where):
        seen.append(where.rsplit("/", 1)[-1])
        return real(raw, where)

    monkeypatch.setattr(retention, "parse_manifest", counting)
    return seen


def test_each_manifest_is_parsed_once_across_commits(three_checkpoints, parses):
    store, run_id = three_checkpoints
    assert retention.select_for_retention(store, "step-000000003", run_id, keep=1) == ["step-000000001", "step-000000002"]
    assert sorted(parses) == ["step-000000001", "step-000000002", "step-000000003"]
    # The next commit's retention reads the same files: none is parsed again.
    assert retention.select_for_retention(store, "step-000000003", run_id, keep=1) == ["step-000000001", "step-000000002"]
    assert len(parses) == 3


def test_a_manifest_replaced_under_its_name_is_parsed_again(three_checkpoints, parses):
    store, run_id = three_checkpoints
    assert "step-000000001" in retention.select_for_retention(store, "step-000000003", run_id, keep=1)
    # Another run's manifest now stands under the same name (its own checksum valid): not this run's to delete.
    document = json.loads(store.read_bytes("step-000000001", MANIFEST_NAME))
    document["run_id"] = "another-run"
    with open(f"{store.root}/step-000000001/{MANIFEST_NAME}", "wb") as f:
        f.write(dump_manifest(document))
    assert retention.select_for_retention(store, "step-000000003", run_id, keep=1) == ["step-000000002"]
    assert parses.count("step-000000001") == 2


def test_manifests_this_writer_wrote_are_read_without_parsing(three_checkpoints, parses):
    store, run_id = three_checkpoints
    for name, step in (("step-000000001", 1), ("step-000000002", 2), ("step-000000003", 3)):
        retention.remember_lineage(store.read_bytes(name, MANIFEST_NAME), run_id, step)  # as persist.py does at the write
    assert retention.select_for_retention(store, "step-000000003", run_id, keep=2) == ["step-000000001"]
    assert parses == []


def test_a_damaged_manifest_is_kept_and_read_again_next_time(three_checkpoints, parses):
    store, run_id = three_checkpoints
    path = f"{store.root}/step-000000001/{MANIFEST_NAME}"
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    raw[raw.index(b'"step"') + 1] ^= 0x20  # one flipped bit: its own checksum fails
    with open(path, "wb") as f:
        f.write(bytes(raw))
    for _ in range(2):
        assert retention.select_for_retention(store, "step-000000003", run_id, keep=1) == ["step-000000002"]
    assert parses.count("step-000000001") == 2  # a failure is not remembered: a repaired file is read afresh
