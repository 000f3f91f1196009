"""Files a load reads twice are parsed once: the same bytes share a parse, changed bytes are parsed afresh."""

from __future__ import annotations

import pytest

from overlapckpt import Checkpointer, load
from overlapckpt.format import manifest as manifest_module
from overlapckpt.format import safe_unpickle
from overlapckpt.format.recent_parses import RecentParses
from overlapckpt.restore import pipeline

from helpers import assert_state_equal, make_run, snapshot, train_step


def test_the_same_bytes_share_a_parse_and_other_bytes_or_keys_do_not():
    parses: list[bytes] = []
    recent: RecentParses[list[bytes]] = RecentParses(entries=2)

    def parse(data: bytes):
        def run() -> list[bytes]:
            parses.append(data)
            return [data]
        return run

    first = recent.parsed("a", b"one", parse(b"one"))
    assert recent.parsed("a", bytes(b"one"), parse(b"one")) is first  # equal bytes, another object: shared
    assert recent.parsed("b", b"one", parse(b"one")) is not first  # another key (another checkpoint's file)
    recent.parsed("a", b"two", parse(b"two"))  # a third entry: the oldest ("a", b"one") goes
    recent.parsed("a", b"one", parse(b"one"))
    assert parses == [b"one", b"one", b"two", b"one"]


def test_a_failed_parse_is_not_kept():
    recent: RecentParses[int] = RecentParses(entries=4)

    def fails() -> int:
        raise ValueError("damaged")

    for _ in range(2):
        with pytest.raises(ValueError, match="damaged"):
            recent.parsed("k", b"x", fails)
    assert recent.parsed("k", b"x", lambda: 7) == 7


def test_a_load_parses_its_manifest_once_and_a_two_pass_load_its_metadata_once(tmp_path, monkeypatch):
    """Before: the manifest was parsed by the checkpoint's resolution and again by the checks, and .metadata by each pass."""
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=120)
        saved = snapshot(model, opt)
    counts = {"manifest": 0, "metadata": 0}
    parse_manifest, unpickle_metadata = manifest_module._parsed_manifest, safe_unpickle._unpickled_metadata

    def counting_manifest(raw, where):
        counts["manifest"] += 1
        return parse_manifest(raw, where)

    def counting_metadata(data, where):
        counts["metadata"] += 1
        return unpickle_metadata(data, where)

    monkeypatch.setattr(manifest_module, "_parsed_manifest", counting_manifest)
    monkeypatch.setattr(safe_unpickle, "_unpickled_metadata", counting_metadata)
    monkeypatch.setattr(manifest_module, "_recent_manifests", RecentParses(entries=4))
    monkeypatch.setattr(safe_unpickle, "_recent_metadata", RecentParses(entries=2))
    monkeypatch.setattr(pipeline, "TWO_PASS_MIN_BYTES", 0)  # a check pass, then a placing pass
    fresh, fresh_opt, _, _ = make_run(seed=3)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*saved, fresh, fresh_opt)
    assert counts == {"manifest": 1, "metadata": 1}
