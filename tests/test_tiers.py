"""The node-local tier: two cadences from one snapshot, its own retention, and restore from the newest verified tier.

One process, a spawned writer per Checkpointer. Every checkpoint is compared bit for bit
(``torch.equal``) with an uninterrupted twin's state at its version.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from fake_tiers import METADATA_NBYTES, manifest_bytes, write_tier_checkpoint

from overlapckpt import Checkpointer, LoadTargets, list_checkpoints, load
from overlapckpt.errors import ConfigError, CorruptCheckpointError
from overlapckpt.format.lease import LEASE_NAME, sweep_dead_tiers
from overlapckpt.format.manifest import MANIFEST_NAME
from overlapckpt.format.peers import NodeLayout
from overlapckpt.format.process_identity import this_process
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.format.tiers import TIER_MARKER_NAME, default_local_dir, tier_store
from overlapckpt.format.verify import VerifyShare, read_manifest, verify_checkpoint
from overlapckpt.protocol import FileCopy
from overlapckpt.restore.held_files import encode_held
from overlapckpt.restore.node_listings import FileTable, NodeListings, TierDigest, agreed_file_table, tier_listing

from helpers import assert_state_equal, launch_ranks, make_run, train_step, twin_states

STEPS = 12
TIER_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "tier_digests_worker.py")
_TWINS: dict[int, dict] = {}


class _Twin:
    """The uninterrupted run's states, computed at the thread count the test trains at (CPU kernels match only there)."""

    def __getitem__(self, step: int) -> tuple:
        threads = torch.get_num_threads()
        if threads not in _TWINS:
            _TWINS[threads] = twin_states(STEPS)
        return _TWINS[threads][step]


TWIN = _Twin()


def _train(root: str, local: str, steps: int = STEPS, **kwargs) -> Checkpointer:
    model, opt, sched, sampler = make_run()
    ckpt = Checkpointer(model, opt, root, every=kwargs.pop("every", 6), local_every=kwargs.pop("local_every", 2), local_dir=local, **kwargs)
    for _ in range(steps):
        train_step(model, opt, sched, sampler)
        ckpt.step()
    ckpt.close()
    return ckpt


def _steps(path: str) -> list[int]:
    return [c.step for c in list_checkpoints(path)]


def _flip_one_byte(path: str) -> None:
    """Flip a byte in the middle of the largest shard of a checkpoint directory."""
    shards = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
    target = max(shards, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _fresh_load(root: str, local: str | None, **kwargs) -> tuple:
    model, opt, _, _ = make_run(seed=1)  # other weights: a load that did nothing fails the comparison
    info = load(root, model, opt, local_dir=local, **kwargs)
    return info, model, opt


def test_each_tier_holds_its_cadence_and_its_retention_bit_exact(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    ckpt = _train(root, local, local_keep=2, keep=None)
    # every=6 to the root; local_every=2 (and every root checkpoint) to the local tier, which keeps 2.
    assert _steps(root) == [6, 12]
    assert _steps(local) == [10, 12]
    # One snapshot per version of either cadence: one device-to-host copy serves both tiers at 6 and 12.
    assert [s["step"] for s in ckpt.stats] == [2, 4, 6, 8, 10, 12]
    both = [s for s in ckpt.stats if len(s["tier_paths"]) == 2]
    assert [s["step"] for s in both] == [6, 12]
    for tier_dir in (root, local):
        for info in list_checkpoints(tier_dir):
            model, opt, _, _ = make_run(seed=1)
            load(info.path, model, opt)
            assert_state_equal(*TWIN[info.step], model, opt)


def test_restore_takes_the_local_tier_when_it_is_newer_and_never_reads_the_root(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=10, every=6)
    assert _steps(root) == [6] and _steps(local)[-1] == 10
    for info in list_checkpoints(root):  # a read of the root's data would now fail verification
        _flip_one_byte(info.path)
    info, model, opt = _fresh_load(root, local)
    assert info.step == 10 and info.path == os.path.join(local, "step-000000010")
    assert info.tier == "local"  # recorded where it was read, not worked out from its path
    assert_state_equal(*TWIN[10], model, opt)


def test_a_newer_root_wins_over_the_local_tier(tmp_path, caplog):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=12, every=6, local_every=4, local_keep=2)
    assert _steps(root) == [6, 12] and _steps(local) == [8, 12]
    CheckpointStore(local).remove_checkpoint("step-000000012")  # the local tier's newest is 8 now, the root's 12
    with caplog.at_level(logging.INFO, logger="overlapckpt"):
        info, model, opt = _fresh_load(root, local)
    assert info.step == 12 and info.path == os.path.join(root, "step-000000012") and info.tier == "root"
    assert "the root holds version 12, newer than the local tier's newest complete version 8" in caplog.text
    assert_state_equal(*TWIN[12], model, opt)


def test_a_local_checkpoint_whose_manifest_is_unreadable_is_skipped_and_an_older_local_one_still_newer_than_the_root_is_used(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=10, every=6)
    assert _steps(root) == [6] and _steps(local)[-2:] == [8, 10]
    newest = os.path.join(local, "step-000000010", MANIFEST_NAME)
    with open(newest, "r+b") as f:  # truncated: its manifest no longer parses
        f.truncate(os.path.getsize(newest) // 2)
    with pytest.warns(UserWarning, match=r"the local tier's .*step-000000010 is skipped"):
        info, model, opt = _fresh_load(root, local)
    assert info.step == 8 and info.path == os.path.join(local, "step-000000008")
    assert_state_equal(*TWIN[8], model, opt)


def test_a_corrupt_local_checkpoint_is_refused_with_a_warning_and_the_root_is_used(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=12, every=6, local_every=4)
    newest_local = list_checkpoints(local)[-1]
    _flip_one_byte(newest_local.path)
    with pytest.warns(UserWarning, match=rf"the local tier's {newest_local.path} was refused \(CorruptCheckpointError"):
        info, model, opt = _fresh_load(root, local)
    assert info.step == 12 and info.path.startswith(root)
    assert_state_equal(*TWIN[12], model, opt)


def test_restore_from_the_local_tier_continues_the_run_bit_exact(tmp_path):
    """Checkpointer.restore() reads the local tier, and training on from it reproduces the twin."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=8, every=6, local_every=2)
    model, opt, sched, sampler = make_run(seed=1)
    with Checkpointer(model, opt, root, every=6, local_every=2, local_dir=local) as ckpt:
        info = ckpt.restore()
        assert info.step == 8 and info.path.startswith(local)
        assert ckpt.step_count == 8
    assert_state_equal(*TWIN[8], model, opt)


def test_restore_into_other_objects_loads_them_leaves_its_own_and_continues_the_count(tmp_path):
    """restore(into=...): what a framework's resume uses (TorchTitan's manager loads into its model parts, less what
    exclude_from_loading names), instead of the Checkpointer's private members."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=8, every=6, local_every=2)
    model, opt, _, _ = make_run(seed=1)
    own_before = {k: v.clone() for k, v in model.state_dict().items()}
    other_model, other_opt, _, _ = make_run(seed=2)
    with Checkpointer(model, opt, root, every=6, local_every=2, local_dir=local) as ckpt:
        info = ckpt.restore(into=LoadTargets(other_model, other_opt))
        assert (info.step, info.tier, ckpt.step_count) == (8, "local", 8)
    assert_state_equal(*TWIN[8], other_model, other_opt)
    assert all(torch.equal(v, own_before[k]) for k, v in model.state_dict().items())  # its own objects untouched


def test_a_restore_reports_its_source_and_times_to_the_figures_callback_with_the_next_commit(tmp_path):
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=8, every=6, local_every=2)
    model, opt, sched, sampler = make_run(seed=1)
    figures: list[dict] = []
    with Checkpointer(model, opt, root, every=6, local_every=2, local_dir=local, on_commit=figures.append) as ckpt:
        assert ckpt.restore_figures is None
        ckpt.restore()
        restored = ckpt.restore_figures
        assert restored is not None
        assert (restored["restore_source"], restored["restore_step"], restored["restore_fetched_files"]) == ("local tier", 8, 0)
        assert restored["restore_refused_local_read_s"] is None
        assert restored["restore_s"] == restored["restore_choose_s"] + restored["restore_read_s"]
        for _ in range(4):  # versions 9..12: the local tier takes 10 and 12
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.wait()
    assert [f["step"] for f in figures] == [10, 12]
    assert {k: v for k, v in figures[0].items() if k.startswith("restore_")} == restored  # with the first commit only
    assert not any(k.startswith("restore_") for k in figures[1])

    # A refused local checkpoint: the root, and the refused read's time.
    _flip_one_byte(list_checkpoints(local)[-1].path)
    model, opt, _, _ = make_run(seed=1)
    with Checkpointer(model, opt, root, every=6, local_every=2, local_dir=local) as ckpt:
        with pytest.warns(UserWarning, match="was refused"):
            ckpt.restore()
        restored = ckpt.restore_figures
    assert restored is not None and (restored["restore_source"], restored["restore_step"]) == ("root", 12)
    assert isinstance(restored["restore_refused_local_read_s"], float)


def test_without_a_local_tier_load_reads_the_root_and_logs_nothing_of_tiers(tmp_path, caplog):
    root, local = str(tmp_path / "root"), str(tmp_path / "missing-local")
    _train(root, str(tmp_path / "local"), steps=6, every=6)
    with caplog.at_level(logging.INFO, logger="overlapckpt"):
        info, model, opt = _fresh_load(root, local)
    assert info.step == 6 and info.path.startswith(root)
    assert f"no local tier at {local}" in caplog.text
    assert_state_equal(*TWIN[6], model, opt)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"local_every": 0}, "local_every=0 is invalid; pass an integer >= 1"),
        ({"local_every": 2, "local_keep": 0}, "local_keep=0 is invalid; pass an integer >= 1"),
        ({"local_every": 2, "local_dir": "s3://bucket/tier"}, "local_dir='s3://bucket/tier' is a URL"),
        ({"local_dir": "/tmp/x"}, "local_dir='/tmp/x' is set but local_every is None"),
        ({"local_every": 2, "local_replicas": -1}, "local_replicas=-1 is invalid; pass the number of other nodes"),
        ({"local_every": 2, "replica_mib_per_s": 0}, "replica_mib_per_s=0 is invalid; pass the most MiB per second"),
    ],
)
def test_bad_tier_settings_name_the_value_and_the_fix(tmp_path, kwargs, message):
    model, opt, _, _ = make_run()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        Checkpointer(model, opt, str(tmp_path / "root"), **kwargs)


def test_partners_are_on_other_nodes_so_that_losing_any_node_loses_no_shard():
    # 3 nodes of unequal sizes (ranks 0-2, 3-4, 5-7), as ranks meet them in rank order.
    layout = NodeLayout.from_keys(["a", "a", "a", "b", "b", "c", "c", "c"])
    assert layout.node_of_rank == (0, 0, 0, 1, 1, 2, 2, 2) and [layout.leader(n) for n in range(3)] == [0, 3, 5]
    assert [layout.partners(r, 1) for r in range(8)] == [[3], [4], [3], [5], [6], [0], [1], [2]]
    for replicas in (1, 2):
        for rank in range(8):
            holders = {layout.node_of_rank[rank]} | {layout.node_of_rank[q] for q in layout.partners(rank, replicas)}
            assert len(holders) == replicas + 1  # each copy on a node of its own: any `replicas` nodes may go
    with pytest.raises(ConfigError, match=r"local_replicas=3 needs at least 4 nodes .* pass local_replicas=2 or fewer"):
        layout.partners(0, 3)
    assert NodeLayout.from_keys(["a", "a"]).node_count == 1  # one node: nothing to replicate, any count is accepted
    NodeLayout.from_keys(["a", "a"]).check_replicas(5)


def test_the_default_local_dir_is_named_after_the_root_and_stable():
    a = default_local_dir("/data/jobs/llama-70b")
    assert a == default_local_dir("/data/jobs/llama-70b/")
    assert os.path.basename(a).startswith("overlapckpt-llama-70b-") and a != default_local_dir("/other/llama-70b")
    assert os.path.dirname(a) == ("/dev/shm" if os.path.isdir("/dev/shm") else os.path.dirname(a))


def test_a_dead_jobs_tier_is_swept_and_live_or_unleased_ones_are_kept(tmp_path):
    parent = tmp_path / "shm"
    parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)  # a pid of this host that no longer exists

    def tier(name: str, pid: int | None) -> str:
        path = parent / name
        (path / "step-000000002").mkdir(parents=True)
        (path / TIER_MARKER_NAME).write_text('{"format": 1, "root": "/r", "uid": 0}')
        if pid is not None:
            who = dataclasses.replace(this_process(), pid=pid)
            (path / LEASE_NAME).write_text(json.dumps({**who.fields(), "run_id": f"r{pid}", "since_unix_s": time.time()}))
        return str(path)

    dead_tier = tier("overlapckpt-dead-1", dead.pid)
    live_tier = tier("overlapckpt-live-1", os.getpid())
    unleased = tier("overlapckpt-closed-1", None)
    not_ours = tier("something-else", dead.pid)
    own = tier("overlapckpt-own-1", dead.pid)  # our own directory: taken over by lease, never swept
    assert sweep_dead_tiers(own) == [dead_tier]
    assert not os.path.exists(dead_tier)
    for kept in (live_tier, unleased, not_ours, own):
        assert os.path.isdir(kept), kept


def test_a_checkpoint_without_a_local_tier_goes_to_the_root_only(tmp_path):
    root = str(tmp_path / "root")
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root, every=3) as ckpt:
        for _ in range(6):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        assert ckpt.local_dir is None
    assert _steps(root) == [3, 6]
    assert [list(s["tier_paths"]) for s in ckpt.stats] == [["root"], ["root"]]
    assert torch.equal(torch.tensor(_steps(root)), torch.tensor([3, 6]))


def test_the_cli_lists_both_tiers_and_verifies_either(tmp_path, capsys):
    from overlapckpt.cli import main

    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=8, every=6, local_every=4)
    assert main(["ls", root, "--local-dir", local]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["tier", "step"]
    assert [line.split()[:2] for line in lines[1:]] == [["root", "6"], ["local", "6"], ["local", "8"]]
    assert main(["ls", root, "--tier", "local", "--local-dir", local, "--json"]) == 0
    import json

    assert [(e["tier"], e["step"]) for e in json.loads(capsys.readouterr().out)] == [("local", 6), ("local", 8)]
    assert main(["verify", root, "--tier", "local", "--local-dir", local]) == 0
    assert capsys.readouterr().out.startswith(f"ok      {os.path.join(local, 'step-000000008')}")
    _flip_one_byte(os.path.join(local, "step-000000008"))
    assert main(["verify", root, "--tier", "local", "--local-dir", local]) == 1
    assert capsys.readouterr().out.startswith(f"CORRUPT {os.path.join(local, 'step-000000008')}")
    assert main(["verify", root]) == 0  # the root is untouched
    capsys.readouterr()
    assert main(["ls", root, "--tier", "local", "--local-dir", str(tmp_path / "nowhere")]) == 2
    assert f"no local tier at {tmp_path / 'nowhere'}" in capsys.readouterr().err


@pytest.mark.parametrize("window", [1, 3])
def test_a_writer_killed_between_the_tiers_is_replaced_and_each_tier_holds_the_checkpoint_once(tmp_path, monkeypatch, window):
    """SIGKILL as the root's write starts, after the local tier committed: the replacement writer finds the local
    checkpoint this run's own (a success, not CheckpointExistsError), writes the root, and both are bit-exact.
    With replay, the slot was rolled forward before the death: it is not replayed twice."""
    from fakes import BLOCK_ONCE_MARKER_ENV, DiesInRootWriteStore

    monkeypatch.setenv(BLOCK_ONCE_MARKER_ENV, str(tmp_path / "died-once"))
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    model, opt, sched, sampler = make_run()
    with pytest.warns(UserWarning, match=r"the writer process died .* a new one was started"):
        with Checkpointer(
            model, opt, root, window=window, local_every=100, local_dir=local, store_class=DiesInRootWriteStore
        ) as ckpt:
            for it in range(1, 7):
                train_step(model, opt, sched, sampler)
                if it == 2:
                    ckpt.request()
                ckpt.step()
            ckpt.wait(timeout_s=120)
            assert ckpt.writer_restarts == 1
    assert (tmp_path / "died-once").exists()  # the precondition: it died there
    version = 2 + window - 1
    assert _steps(root) == [version] and _steps(local) == [version]
    for tier_dir in (root, local):
        fresh, fresh_opt, _, _ = make_run(seed=5)
        load(tier_dir, fresh, fresh_opt)
        assert_state_equal(*TWIN[version], fresh, fresh_opt)


def test_a_request_for_a_version_only_the_local_tier_holds_reaches_the_root(tmp_path):
    """The end of training asks for version 4, which local_every=2 already put in the local tier alone."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, root, local_every=2, local_dir=local) as ckpt:
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.wait(timeout_s=120)
        assert _steps(root) == [] and _steps(local) == [2, 4]
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=120)
        assert [s["tier_paths"] for s in ckpt.stats][-1] == {
            "local": os.path.join(local, "step-000000004"), "root": os.path.join(root, "step-000000004"),
        }
    assert _steps(root) == [4] and _steps(local) == [2, 4]
    fresh, fresh_opt, _, _ = make_run(seed=5)
    load(root, fresh, fresh_opt)
    assert_state_equal(*TWIN[4], fresh, fresh_opt)


def test_replicas_go_in_rounds_of_a_tenth_of_a_second_at_the_cap():
    from overlapckpt.writer.replicas import CHUNK_BYTES, MIN_PACED_CHUNK_BYTES, paced_chunk_bytes

    assert paced_chunk_bytes(256 * 2**20) == CHUNK_BYTES  # the default cap: 25.6 MiB a tenth, held to 8 MiB a round
    assert paced_chunk_bytes(10 * 2**20) == 2**20  # 10 MiB/s: 1 MiB a round
    assert paced_chunk_bytes(1024) == MIN_PACED_CHUNK_BYTES  # 1 KiB/s: no round below 4 KiB
    assert paced_chunk_bytes(float("inf")) == CHUNK_BYTES  # a restore's fetch: unpaced


def test_a_preemption_during_a_paced_senders_wait_ends_it():
    from overlapckpt.writer.replicas import pace_sender

    asked: list[bool] = []

    def preempted() -> bool:  # the preemption comes at the third look, while the sender waits
        asked.append(True)
        return len(asked) >= 3

    # 1 GB already sent at 1 byte/s: without the preemption, a wait of 30 years.
    sender = threading.Thread(target=pace_sender, args=(10**9, 1.0, time.monotonic(), preempted), daemon=True)
    sender.start()
    sender.join(timeout=30)
    assert not sender.is_alive(), "the paced sender still waits after the preemption lifted the cap"
    assert len(asked) == 3


def _table(files: dict[str, int]) -> FileTable:
    """The file table of checkpoint "ckpt": its data ``files`` (name: bytes), a .metadata of 10 bytes, the manifest."""
    data = sorted(files)
    return FileTable((*data, ".metadata", MANIFEST_NAME), (*(files[f] for f in data), 10, -1))


def _digest(version: int, held: set[str], files: dict[str, int], sha256: bytes = b"m" * 32) -> TierDigest:
    """One node's digest of a checkpoint of ``files``: it holds ``held`` (a manifest of 1 byte)."""
    table = _table(files)
    bits = sum(1 << table.index[f] for f in held)
    return TierDigest(version, "run", sha256, len(table.names), encode_held(bits, len(table.names)), 10, 1)


def _listing(version: int, held: set[str], files: dict[str, int]) -> dict:
    """One node's listing of checkpoint "ckpt": it holds ``held`` of the checkpoint's ``files`` (name: bytes)."""
    return {"ckpt": _digest(version, held, files)}


def test_a_restore_fetches_each_node_the_files_its_ranks_read_and_refuses_names_the_manifest_lacks():
    # 3 nodes x 1 rank, R=1: node n holds its shard and node n-1's (the ring); node 1 was replaced.
    files = {"__0_0.distcp": 100, "__1_0.distcp": 200, "__2_0.distcp": 300}
    head = {".metadata", MANIFEST_NAME}
    nodes = NodeListings.from_gathered([
        ("n0", _listing(6, head | {"__0_0.distcp", "__2_0.distcp"}, files)),
        ("n1", {}),
        ("n2", _listing(6, head | {"__2_0.distcp", "__1_0.distcp"}, files)),
    ])
    assert nodes.newest_complete(None, None) == ("ckpt", 6)
    # First the files every rank reads, each from one of the nodes holding it, in turn: named and
    # sized from the digests alone (node 1 has no manifest to read names from yet).
    first = nodes.head_copies("ckpt")
    assert first == [FileCopy(0, 1, ".metadata", 10), FileCopy(2, 1, MANIFEST_NAME, 1)]
    nodes.received("ckpt", first)
    # Then each rank's own shard and rank 0's file (which holds the items every rank reads), named
    # by the file table each node reads from its own manifest.
    table = _table(files)
    wanted = {f"n{r}": table.indices("ckpt", head | {f"__{r}_0.distcp", "__0_0.distcp"}) for r in range(3)}
    assert nodes.copies("ckpt", table, wanted) == [
        FileCopy(0, 1, "__0_0.distcp", 100), FileCopy(2, 1, "__1_0.distcp", 200), FileCopy(0, 2, "__0_0.distcp", 100)
    ]
    # What each node's ranks send instead of their whole sets: only the files their node lacks.
    assert [nodes.lacking(f"n{r}", "ckpt", wanted[f"n{r}"]) for r in range(3)] == [(), (0, 1), (0,)]
    # Without load plans (a reader of whole checkpoints), every node is completed.
    whole = nodes.copies("ckpt", table, {n: None for n in nodes.listings})
    assert sorted((c.target, c.filename) for c in whole) == [
        (0, "__1_0.distcp"), (1, "__0_0.distcp"), (1, "__1_0.distcp"), (1, "__2_0.distcp"), (2, "__0_0.distcp")
    ]
    # A name from a load plan that the manifest does not list is never copied.
    with pytest.raises(CorruptCheckpointError, match=r"\['\.\./\.\./etc/passwd'\], which its manifest does not list"):
        table.indices("ckpt", frozenset({"../../etc/passwd"}))


def test_a_shard_on_no_node_makes_the_version_incomplete_and_an_older_one_is_taken():
    files = {"__0_0.distcp": 100, "__1_0.distcp": 200}
    head = {".metadata", MANIFEST_NAME}
    newer = _digest(8, head | {"__0_0.distcp"}, files)
    older = _digest(6, head | set(files), files)
    nodes = NodeListings.from_gathered([("n0", {"v8": newer, "v6": older}), ("n1", {"v8": newer})])
    assert nodes.newest_complete(None, None) == ("v6", 6)
    assert nodes.newest_complete(None, 7) is None  # the root's version 7 is newer than any complete one


def test_a_node_holding_another_manifest_under_the_name_is_refused(tmp_path, caplog):
    """Nodes agree on a checkpoint by its manifest's SHA-256: the same name, version and run with other bytes is refused."""
    files = {"__0_0.distcp": 100, "__1_0.distcp": 200}
    head = {".metadata", MANIFEST_NAME}
    ours, other = _digest(8, head | {"__0_0.distcp"}, files), _digest(8, head | {"__1_0.distcp"}, files, sha256=b"o" * 32)
    older = _digest(6, head | set(files), files)
    assert (ours.version, ours.run_id) == (other.version, other.run_id)  # what the nodes compared before
    agreeing = NodeListings.from_gathered([("n0", {"v8": ours, "v6": older}), ("n1", {"v8": dataclasses.replace(other, manifest_sha256=b"m" * 32)})])
    assert agreeing.newest_complete(None, None) == ("v8", 8)
    nodes = NodeListings.from_gathered([("n0", {"v8": ours, "v6": older}), ("n1", {"v8": other})])
    with caplog.at_level(logging.INFO, logger="overlapckpt.restore"):
        assert nodes.newest_complete(None, None) == ("v6", 6)
    assert "checkpoint v8 is another run's on some node: not restored from the local tiers" in caplog.text
    # On a node: its own copy of the manifest is read and refused unless it is the agreed one.
    local, root = str(tmp_path / "local"), str(tmp_path / "root")
    os.makedirs(root)
    name = write_tier_checkpoint(local, root, 6, files, 2)
    (digest,) = tier_listing(local, 2, root).values()
    assert agreed_file_table(local, name, digest) == FileTable(
        ("__0_0.distcp", "__1_0.distcp", ".metadata", MANIFEST_NAME), (100, 200, METADATA_NBYTES, -1)
    )
    with open(os.path.join(local, name, MANIFEST_NAME), "wb") as f:  # the same step, run and files, written at another time
        f.write(manifest_bytes(6, "0123456789abcdef" * 2, files, 2, created_at=1.0))
    with pytest.raises(CorruptCheckpointError, match="not the .* the nodes agreed on: this node holds another checkpoint under its name"):
        agreed_file_table(local, name, digest)


@pytest.mark.parametrize("ranks", [8, 1024])
def test_a_nodes_value_in_the_listing_gather_is_the_same_size_at_any_file_count_and_names_no_file(tmp_path, ranks):
    """Before: each checkpoint's listing named every file twice (1,024 ranks: 38,907 pickled bytes per node per checkpoint),
    and then a bit per file (309 bytes at 1,024 ranks, 1,210 at 8,192)."""
    values = {}
    for prefix in ("", "a-long-prefix-that-a-file-name-never-needs-" * 4):
        files = {f"__{r}_0.distcp{prefix}": 1 for r in range(ranks)}
        local, root = str(tmp_path / f"local{len(prefix)}"), str(tmp_path / f"root{len(prefix)}")
        os.makedirs(root)
        name = write_tier_checkpoint(local, root, 6, files, ranks, held={"__1_0.distcp" + prefix})
        listing = tier_listing(local, ranks, root)
        digest = listing[name]
        table = FileTable.of_manifest(read_manifest(tier_store(local), name))
        assert [table.names[i] for i in range(digest.files) if digest.held() >> i & 1] == ["__1_0.distcp" + prefix, ".metadata", MANIFEST_NAME]
        pickled = pickle.dumps({name: digest})
        assert not [f for f in table.names if f.encode() in pickled]
        # The name, the class, the SHA-256, the run, four integers; the three files held as their indices.
        assert len(pickled) <= 200 + 8
        values[prefix] = pickle.dumps({name: dataclasses.replace(digest, manifest_nbytes=0)})
    short, long = values.values()
    assert len(short) == len(long)  # the names' lengths count nowhere but in the manifest's size, an integer


def test_the_ranks_send_only_what_their_node_lacks_and_a_replaced_node_gets_only_that(tmp_path):
    """Two nodes of one rank each (gloo, node keys of their own): node 0 holds the checkpoint, node 1 was replaced (holds nothing).

    Before: every rank all-gathered the whole set of files its load reads, names included.
    """
    results = launch_ranks(TIER_WORKER, "lacking", 2, str(tmp_path), timeout_s=240)
    # What each rank sent once the head fetch gave node 1 the manifest: node 0's rank nothing,
    # node 1's the indices of the two shards (in the manifest's order) its rank reads.
    assert [r["sent"] for r in results] == [["node-0", [], None, None], ["node-1", [0, 1], None, None]]
    for r in results:
        assert r["copies"] == [
            [0, 1, ".metadata", METADATA_NBYTES], [0, 1, MANIFEST_NAME, r["manifest_nbytes"]],
            [0, 1, "__0_0.distcp", 100], [0, 1, "__1_0.distcp", 200],
        ]
        assert r["files"] == sorted({".metadata", MANIFEST_NAME, "__0_0.distcp", f"__{r['rank']}_0.distcp"})
        assert r["listing_names"] == []  # no file name in the listing gather


def test_a_fetched_manifest_that_is_not_the_agreed_one_sends_every_rank_to_the_root(tmp_path):
    """The file names come from each node's own manifest: one whose SHA-256 is not the agreed one is refused on every rank."""
    results = launch_ranks(TIER_WORKER, "forged_manifest", 2, str(tmp_path), timeout_s=240)
    for r in results:
        assert r["copies"] == [[0, 1, ".metadata"], [0, 1, MANIFEST_NAME]]  # the head fetch only: nothing is fetched by its names
        assert r["source"] is None
        (warning,) = r["warnings"]
        assert re.search(
            r"cannot be planned on rank 1 \(CorruptCheckpointError: .*manifest has SHA-256 .*, not the .* the nodes agreed on", warning
        ), warning


def test_verify_checks_the_named_files_instead_of_a_share(tmp_path):
    root = str(tmp_path / "root")
    _train(root, str(tmp_path / "local"), steps=6)
    (info,) = list_checkpoints(root)
    store = CheckpointStore(root)
    name = os.path.basename(info.path)
    shards = sorted(f for f in os.listdir(info.path) if f.endswith(".distcp"))
    os.truncate(os.path.join(info.path, shards[0]), 8)
    assert verify_checkpoint(store, name, share=VerifyShare(files=frozenset()), read_blobs=False).ok  # the truncated shard is not named
    report = verify_checkpoint(store, name, share=VerifyShare(files=frozenset({shards[0]})), read_blobs=False)
    assert report.files == 1 and not report.ok
    assert shards[0] in report.problems[0]


def test_a_restore_below_the_tiers_newest_trains_on_under_lineage_names(tmp_path):
    """Before: restore(step=4) from the tier, then training on raised CheckpointExistsError at version 6, which
    the earlier run's tier already held: the taken versions were read from the root only."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    _train(root, local, steps=8, every=8, local_keep=3)
    assert _steps(local) == [4, 6, 8] and _steps(root) == [8]
    model, opt, sched, sampler = make_run(seed=3)
    with Checkpointer(model, opt, root, every=8, local_every=2, local_keep=3, local_dir=local) as ckpt:
        assert ckpt.restore(step=4).step == 4
        run = ckpt._lineage.run_id
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.wait(timeout_s=120)
    names = sorted(os.listdir(local))
    assert f"step-000000006-{run[:8]}" in names and f"step-000000008-{run[:8]}" in names, names
    assert f"step-000000008-{run[:8]}" in os.listdir(root)


def test_restarts_never_grow_the_tier_beyond_local_keep_plus_one_and_the_log_names_local_keep(tmp_path, caplog):
    """Before: each crash and restore left the previous run's tier checkpoints: local_keep=2 held 8 after three cycles,
    and the retention line said keep= for a local_keep deletion."""
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    held = []
    for cycle in range(4):
        model, opt, sched, sampler = make_run(seed=cycle)
        with caplog.at_level(logging.INFO, logger="overlapckpt"):
            with Checkpointer(model, opt, root, every=100, keep=2, local_every=1, local_keep=2, local_dir=local,
                              stateful={"sched": sched, "sampler": sampler}) as ckpt:
                if cycle:
                    ckpt.restore()
                for _ in range(3):
                    train_step(model, opt, sched, sampler)
                    ckpt.step()
                ckpt.wait(timeout_s=120)
        held.append(len(CheckpointStore(local).committed_names()))
    assert max(held) <= 3, held
    assert _steps(local) == [11, 12]  # the lineage's newest two: each run resumed where the one before ended
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retention (")]
    assert removed and all(line.startswith("retention (local_keep=2) removed ") for line in removed), removed
