"""Distributed runs: real multi-process gloo launches of tests/workers/dist_worker.py, one launch per scenario.

Each launch serves several checks (see the worker); the assertions are here, on what
every rank wrote. Ports are picked free; every wait has a timeout.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from overlapckpt import Checkpointer, CheckpointMismatchError, list_checkpoints, load

from helpers import launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_worker.py")
LAUNCH_TIMEOUT_S = 420


def _launch(scenario: str, world_size: int, out: str) -> list[dict]:
    return launch_ranks(WORKER, scenario, world_size, out, LAUNCH_TIMEOUT_S)


def _differing(a_file: str, b_file: str) -> list[str]:
    """The tensors that differ between two saved states (torch.equal), or the keys only one has."""
    a, b = torch.load(a_file, weights_only=True), torch.load(b_file, weights_only=True)
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    return [k for k in a if not torch.equal(a[k], b[k])]


def _check_exact(results: list[dict], configs: dict[str, int], world_size: int) -> None:
    for name, version in configs.items():
        per_rank = [r[name] for r in results]
        for rank, r in enumerate(per_rank):
            assert r["versions"] == [version], (name, rank, r["versions"])
            differing = _differing(r["loaded_files"][str(version)], per_rank[0]["twin_files"][str(version)])
            assert differing == [], (name, rank, version, differing)
            assert r["collectives_in_hooks"] == [], (name, rank, r["collectives_in_hooks"])
        files = per_rank[0]["files"]
        assert sorted(files) == [f"__{rank}_0.distcp" for rank in range(world_size)], files  # one shard file per rank


def _assert_loads_as(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer, expected: dict) -> None:
    """Checkpoint ``path`` loaded into a plain ``model`` and ``opt`` equals ``expected`` (by DCP key), bit for bit."""
    load(path, model, opt, per_rank_state="skip")
    for k, v in expected.items():
        if k.startswith("model."):
            assert torch.equal(model.state_dict()[k[len("model."):]], v), k
    for fqn, p in model.named_parameters():
        for k, v in opt.state[p].items():
            assert torch.equal(v, expected[f"optimizer.state.{fqn}.{k}"]), (fqn, k)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return _launch("ddp", 2, str(tmp_path_factory.mktemp("ddp")))


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    # A one-process checkpoint for the 1 -> 2 reshard, and the state it must load as.
    sys.path.insert(0, os.path.dirname(__file__))
    from workers.dist_worker import FEATURES, Net

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    with Checkpointer(model, opt, root / "plain") as ckpt:
        for _ in range(3):
            x = torch.randn(16, FEATURES)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), x).backward()
            opt.step()
        ckpt.request()
        ckpt.wait(timeout_s=120)
    expected = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for fqn, p in model.named_parameters():
        for k, v in opt.state[p].items():
            expected[f"optimizer.state.{fqn}.{k}"] = v.clone()
    torch.save(expected, root / "plain.pt")
    return _launch("fsdp", 2, str(root / "run")), root


def test_ddp_two_ranks_each_write_half_and_every_checkpoint_is_exact(ddp_results):
    _check_exact(ddp_results, {"w1": 3, "w3-replay": 5, "w3-stage": 3}, 2)
    for name in ("w1", "w3-replay", "w3-stage"):
        r0, r1 = ddp_results[0][name], ddp_results[1][name]
        state_bytes = r0["state_bytes"]
        # Each rank copied and wrote about half of the replicated state, and together all of it once.
        assert r0["nbytes"][0] + r1["nbytes"][0] == state_bytes, (name, r0["nbytes"], r1["nbytes"], state_bytes)
        for r in (r0, r1):
            assert 0.25 * state_bytes <= r["nbytes"][0] <= 0.75 * state_bytes, (name, r["nbytes"], state_bytes)
        if name != "w3-replay":  # replay's copies add the gradients it logs
            assert r0["copied_nbytes"][0] + r1["copied_nbytes"][0] <= 1.05 * state_bytes
        # On disk: about one state, not two (torch.save framing adds a little per blob).
        assert sum(r0["files"].values()) < 1.3 * state_bytes, (r0["files"], state_bytes)


def test_ddp_resume_reproduces_the_twin_losses_per_rank(ddp_results):
    r0, r1 = (r["resume"] for r in ddp_results)
    for r in (r0, r1):
        compared = sorted(r["resumed_losses"], key=int)
        assert compared and compared == [str(s) for s in range(r["version"] + 1, r["version"] + 1 + len(compared))]
        assert {s: r["twin_losses"][s] for s in compared} == r["resumed_losses"], r  # bit for bit: floats compared exactly
    assert r0["resumed_losses"].keys() == r1["resumed_losses"].keys()  # the same steps on both ranks
    first = min(r0["resumed_losses"], key=int)
    assert r0["resumed_losses"][first] != r1["resumed_losses"][first]  # each rank has its own data: per-rank state mattered


def test_two_ranks_commit_each_tier_through_one_writers_group_and_restore_from_the_local_one(ddp_results):
    """every=6 to the root, local_every=2 to a local tier shared by both ranks (one host); the root is then corrupted."""
    r0, r1 = (r["local_tier"] for r in ddp_results)
    for r in (r0, r1):
        assert "crashed" not in r, r
        # Rank 1 told "another-node" as its host: 2 nodes, and local_replicas=2 refused on every rank, naming the fix.
        assert r["two_hosts_refused"] == (
            "local_replicas=2 needs at least 3 nodes (each replica on another node), but the ranks run on 2; pass local_replicas=1 or fewer"
        ), r
        assert r["two_hosts_local_dir_made"] is False
        assert r["root_versions"] == [6] and r["local_versions"] == [8, 10], r
        assert r["restored_version"] == 10 and r["restored_path"].endswith("tiered-local/step-000000010"), r
        assert r["step_count"] == 10
        compared = sorted(r["resumed_losses"], key=int)
        assert compared == [str(s) for s in range(11, 14)]
        assert {s: r["twin_losses"][s] for s in compared} == r["resumed_losses"], r  # bit for bit
    assert r0["resumed_losses"]["11"] != r1["resumed_losses"]["11"]  # each rank restored its own sampler and RNG


def test_ddp_checkpoint_reshards_into_fsdp2(ddp_results):
    for r in ddp_results:
        reshard = r["reshard_to_fsdp"]
        assert _differing(reshard["overlapckpt"], reshard["stock_dcp"]) == [], reshard
        assert _differing(reshard["overlapckpt"], reshard["plain_model"]) == [], reshard


def test_ranks_that_request_differently_all_get_a_named_error_and_nothing_commits(ddp_results):
    for case in ("mismatched_steps", "one_rank_only"):
        for rank, r in enumerate(ddp_results):
            c = r[case]
            assert c["error_type"] == "RankDisagreementError", (case, rank, c)
            assert c["listed"] == [], (case, rank, c)
            assert c["elapsed_s"] < 45, (case, rank, c["elapsed_s"])
    steps = ddp_results[0]["mismatched_steps"]["error"]
    assert "rank 0 requested it after step 2" in steps and "rank 1 requested it after step 3" in steps, steps
    assert "requested none" in ddp_results[1]["one_rank_only"]["error"] or "requested no checkpoint" in ddp_results[1]["one_rank_only"]["error"]


def test_settings_that_differ_across_ranks_are_refused_on_every_rank(ddp_results):
    for r in ddp_results:
        c = r["settings_mismatch"]
        assert c["error_type"] == "ConfigError", c
        assert "settings differ across ranks: every (rank 0: 3, rank 1: 4)" in c["error"], c
        assert "max_writer_restarts (rank 0: 2, rank 1: 1)" in c["error"], c


def test_the_hugging_face_export_is_refused_in_a_distributed_run(ddp_results):
    # A single rng_state.pth where the Trainer's DDP resume reads rng_state_{rank}.pth could
    # only be written by a distributed export: there is none to write it.
    for r in ddp_results:
        c = r["export_refused"]
        assert c["error_type"] == "ConfigError" and not c["written"], c
        assert "export_formats=('hf_trainer',) is for one process" in c["error"], c


def test_the_writers_rendezvous_opens_no_listener(ddp_results):
    """The writers join the job's own store (env:// rendezvous) under a random prefix: no socket of ours listens."""
    for rank, r in enumerate(ddp_results):
        assert r["listeners"] == {"new_listeners": [], "committed": [2]}, (rank, r["listeners"])


def test_auto_window_is_the_same_on_every_rank(ddp_results):
    a0, a1 = (r["auto_window"] for r in ddp_results)
    assert a0["windows"] == a1["windows"] and a0["versions"] == a1["versions"], (a0, a1)
    assert a0["windows"][0] == 4 and a0["reasons"][0].startswith("first checkpoint of a distributed run")
    assert a0["reasons"][1].startswith("agreed by the writers after the previous commit")
    assert a0["reasons"] == a1["reasons"]


def test_a_commit_that_fails_on_the_coordinator_raises_on_every_rank_and_lists_nothing(ddp_results):
    """Every rank answers its trainer after the coordinator's commit, and learns its failure in that collective.

    Before the commit barrier (writer/tier_write.py: _commit_barrier), rank 1's writer
    answered "committed" as soon as DCP's save returned, before the coordinator's rename:
    its wait() returned a checkpoint that was never committed."""
    for rank, r in enumerate(ddp_results):
        c = r["commit_fails"]
        assert c["error_type"] == "CheckpointWriteError", (rank, c)
        assert "Permission denied (injected: cannot clear step-000000002)" in c["error"], (rank, c)
        assert c["listed"] == [], (rank, c)
    assert "failed on the coordinating writer (rank 0)" in ddp_results[1]["commit_fails"]["error"]


def test_a_coordinator_that_cannot_begin_the_checkpoint_fails_every_rank_at_once_by_name(ddp_results):
    """Its storage error rides in the broadcast the others wait in (writer/tier_write.py: held_or_begun).

    Before, the coordinator raised before that broadcast, and the others waited in it
    until the collective timeout (60 s here), then failed with the collective's error."""
    for rank, r in enumerate(ddp_results):
        c = r["begin_fails"]
        assert c["error_type"] == "CheckpointWriteError", (rank, c)
        assert "could not begin it" in c["error"] and "injected: cannot look at step-000000002" in c["error"], (rank, c)
        assert c["listed"] == [], (rank, c)


def test_parts_that_do_not_tile_a_tensor_are_refused_before_the_commit():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from overlapckpt.errors import CoverageError
    from overlapckpt.format.shards import check_coverage

    def md(*chunks):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([10, 4]),
                                     [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z in chunks])

    check_coverage({"w": md(((0, 0), (5, 4)), ((5, 0), (5, 4)))}, {"w": (10, 4)})  # two halves: fine
    with pytest.raises(CoverageError, match=r"no rank wrote 1 tensor\(s\) of the checkpoint, e.g. \['b'\]"):
        check_coverage({"w": md(((0, 0), (10, 4)))}, {"w": (10, 4), "b": (4,)})
    with pytest.raises(CoverageError, match=r"'w' of global shape \(10, 4\) is covered by 2 part\(s\) of 36 elements"):
        check_coverage({"w": md(((0, 0), (5, 4)), ((6, 0), (4, 4)))}, {"w": (10, 4)})  # a gap
    with pytest.raises(CoverageError, match=r"\(overlapping\), not exactly once"):
        check_coverage({"w": md(((0, 0), (6, 4)), ((5, 0), (4, 4)))}, {"w": (10, 4)})  # the same elements twice


def test_writers_killed_mid_persist_idle_and_at_agreement_are_replaced_and_later_checkpoints_commit_exactly(tmp_path):
    # Rank 1's writer is killed mid-persist (step 2); rank 0's while idle; rank 0's again mid-persist
    # (step 7), its death first seen as request() waits for the slot step 7 holds; rank 1's as the
    # ranks agree on checkpoint 10. That third kill once deadlocked (issue 17): rank 0's request
    # restarted inside its own wait for the slot, then waited for the new checkpoint to commit.
    r0, r1 = (r["writer_restarted"] for r in _launch("restart", 2, str(tmp_path)))
    for rank, r in enumerate((r0, r1)):
        assert r["error"] is None, (rank, r)  # no rank raised from a hook, wait() or close()
        # Steps 2 and 7 were lost on every rank, never listed. 10 (requested as rank 1's writer
        # died) is committed by every rank, or lost on every rank when rank 1 had handed it to
        # the writer that died before it noticed; 9 and 12 commit.
        committed = r["committed_at_end"]
        assert r["committed_after_kill"] == [4] and {9, 12} <= set(committed) <= {9, 10, 12}, (rank, r)
        assert r["listed"] == [4] + committed and r["attempts_left"] == [], (rank, r)
        assert r["lost"] == 2 + len({10} - set(committed)), (rank, r)
    assert r0["listed"] == r1["listed"]
    assert r0["writer_restarts"] == 2 and r1["writer_restarts"] == 2, (r0, r1)  # each rank's writer killed twice
    root = os.path.dirname(r0["state_files"]["4"])
    sys.path.insert(0, os.path.dirname(__file__))
    from workers.dist_worker import Net

    for step in r0["listed"]:
        (info,) = [i for i in list_checkpoints(os.path.join(root, "restarted")) if i.step == step]
        assert info.world_size == 2
        expected = torch.load(r0["state_files"][str(step)])
        torch.manual_seed(5)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        _assert_loads_as(info.path, model, opt, expected)


def test_a_writer_killed_mid_persist_fails_every_rank_and_lists_nothing(ddp_results):
    r0, r1 = (r["writer_killed"] for r in ddp_results)
    assert r1["error_type"] == "WriterDiedError", r1
    # max_writer_restarts=0 on every rank: rank 0's writer reports the broken collective as it is,
    # without waiting for a replacement that cannot come.
    assert r0["error_type"] == "CheckpointWriteError" and "builtins.RuntimeError" in r0["error"], r0
    assert r0["elapsed_s"] < 60 and r1["elapsed_s"] < 60, (r0, r1)
    assert r0["listed"] == [] and r1["listed"] == []


def test_fsdp2_uneven_shards_exact_and_reshard_both_ways(fsdp_results, tmp_path):
    results, root = fsdp_results
    _check_exact(results, {"w1": 3, "w3-replay": 5, "w3-stage": 3}, 2)
    for r in results:
        reshard = r["reshard_from_plain"]  # 1 process -> 2-rank FSDP2
        assert _differing(reshard["overlapckpt"], reshard["expected_file"]) == [], reshard
        assert _differing(reshard["overlapckpt"], reshard["stock_dcp"]) == [], reshard
    # 2-rank FSDP2 -> 1 process, with overlapckpt's load and with the stock recipe.
    sys.path.insert(0, os.path.dirname(__file__))
    from workers.dist_worker import FEATURES, Net

    run = root / "run" / "w3-replay"
    (info,) = list_checkpoints(str(run))
    expected = torch.load(run / f"twin-{info.step}.pt")
    torch.manual_seed(5)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    assert not torch.equal(model.inp.weight, expected["model.inp.weight"])
    with pytest.raises(CheckpointMismatchError, match=r"written by 2 rank\(s\) and is loaded by 1.*per_rank_state='skip'"):
        load(info.path, model, opt)
    _assert_loads_as(info.path, model, opt, expected)
    # The stock recipe, in one process, with no overlapckpt code.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(6)
    stock = Net()
    stock_opt = torch.optim.AdamW(stock.parameters(), lr=1e-2, foreach=True)
    stock(torch.randn(2, FEATURES)).sum().backward()
    stock_opt.step()  # the optimizer needs state to load into
    msd, osd = get_state_dict(stock, stock_opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=info.path, no_dist=True)
    set_state_dict(stock, stock_opt, model_state_dict=msd, optim_state_dict=osd)
    for k, v in expected.items():
        if k.startswith("model."):
            assert torch.equal(stock.state_dict()[k[len("model."):]], v), k


@pytest.fixture(scope="module")
def hsdp_results(tmp_path_factory):
    return _launch("hsdp", 4, str(tmp_path_factory.mktemp("hsdp")))


def test_hsdp_four_ranks_each_shard_written_once(hsdp_results):
    results = hsdp_results
    _check_exact(results, {"w1": 3, "w3-replay": 5}, 4)
    for name in ("w1", "w3-replay"):
        # Each local shard once: the state's bytes, plus the CPU step counters that both
        # shard groups hold and write (DCP stores each once).
        extra = sum(r[name]["nbytes"][0] for r in results) - results[0][name]["state_bytes"]
        assert 0 <= extra <= 64, (name, extra)


def test_fsdp_by_tp_on_a_2x2_mesh_is_exact_and_reshards_to_two_ranks_and_one(tmp_path):
    results = _launch("fsdp_tp", 4, str(tmp_path))
    _check_exact(results, {"w1": 3, "w3-replay": 5}, 4)
    expected_file = results[0]["w3-replay"]["twin_files"]["5"]
    for rank in (0, 1):  # the 4-rank checkpoint loaded into 2-rank FSDP2 (ranks 0 and 1 of the launch)
        assert results[rank]["reshard_step"] == 5
        assert _differing(results[rank]["reshard_to_fsdp2"], expected_file) == []
    # ... and into one process, with overlapckpt's load.
    sys.path.insert(0, os.path.dirname(__file__))
    from workers.dist_worker import TpNet

    (info,) = list_checkpoints(str(tmp_path / "w3-replay"))
    expected = torch.load(expected_file)
    torch.manual_seed(5)
    model = TpNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    _assert_loads_as(info.path, model, opt, expected)


def test_cli_shows_the_ranks_and_verify_checks_every_ranks_shards(fsdp_results, capsys):
    from overlapckpt.cli import main

    results, root = fsdp_results
    run = root / "run" / "w3-replay"
    (info,) = list_checkpoints(str(run))
    assert main(["ls", str(run)]) == 0
    line = capsys.readouterr().out.splitlines()[1].split()
    assert line[:5] == [str(info.step), "3", "replay", "3", "2"], line
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "ranks        2 (mesh 2); each wrote its share:" in out, out
    for rank, _r in enumerate(results):
        assert f"  rank {rank}: " in out and "groups at versions [3, 4, 5]" in out, out
    assert main(["verify", str(run)]) == 0
    capsys.readouterr()
    shard = os.path.join(info.path, "__1_0.distcp")
    with open(shard, "r+b") as f:  # one flipped bit in rank 1's shard
        f.seek(os.path.getsize(shard) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    try:
        assert main(["verify", str(run)]) == 1
        assert "__1_0.distcp" in capsys.readouterr().out
    finally:
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            f.write(byte)


def test_distributed_verification_reads_each_stored_byte_once_and_a_flip_fails_every_rank(fsdp_results):
    results, _ = fsdp_results
    shares = [r["verify_share"] for r in results]
    stored = shares[0]["stored"]
    shards = sum(v for n, v in stored.items() if n.endswith(".distcp"))
    # Before reading: .metadata on rank 0 only, and each rank the size of one of the two shard files.
    assert [s["reports"][0]["nbytes"] for s in shares] == [stored[".metadata"], 0]
    assert [s["reports"][0]["files"] for s in shares] == [1, 1]
    # Then each blob checked as it arrives, once per rank that needs it: every stored blob by some
    # rank, none twice by one, and about one checkpoint in all (each rank's own shards, plus the
    # few small items every rank needs, such as param_groups), not one per rank.
    stored_blobs = {tuple(b) for b in shares[0]["blobs_stored"]}
    read = [[tuple(b) for b in s["blobs_read"]] for s in shares]
    assert all(len(r) == len(set(r)) for r in read)
    assert set(read[0]) | set(read[1]) == stored_blobs
    shared = set(read[0]) & set(read[1])
    assert sum(n for _, _, n in shared) < shards // 10, shared
    for rank, s in enumerate(shares):
        flipped = s["flipped"]
        assert flipped is not None and flipped["error_type"] == "CorruptCheckpointError", (rank, flipped)
        assert "__1_0.distcp" in flipped["error"] or "on rank 1" in flipped["error"], (rank, flipped)


def test_malformed_manifest_fields_are_a_named_error_on_every_rank(fsdp_results):
    results, _ = fsdp_results
    for rank, r in enumerate(results):
        m = r["malformed_manifest"]
        assert m["error_type"] == "CorruptCheckpointError" and "malformed field" in m["error"], (rank, m)


def _check_replanned(r: dict) -> None:
    # The layout grew after step 5 (a param group added): more state at 6 than at 4.
    assert r["state_keys"]["6"] > r["state_keys"]["4"], r["state_keys"]
    assert r["versions"] == [2, 4, 6, 8], r
    # The writers' plan round ran at the first checkpoint of each layout only (writer/save_plans.py);
    # with DCP's own save, every checkpoint gathered and scattered the plans.
    assert r["plan_rounds"] == [True, False, True, False], r["plan_rounds"]
    assert r["loaded_equal"] == {"2": True, "4": True, "6": True, "8": True}, r["loaded_equal"]


def _check_write_fails(results: list[dict], failing_rank: int) -> None:
    for rank, r in enumerate(results):
        assert r["error"] is not None and "No space left on device (injected at write 1)" in r["error"], (rank, r)
        assert r["listed_after_failure"] == [], (rank, r)
        # The fault survived: the next checkpoint commits on every rank.
        assert r["later_error"] is None and r["listed"] == [4], (rank, r)
    # Every other rank learns whose write failed, from the coordinator's commit barrier.
    for rank, r in enumerate(results):
        if rank != failing_rank:
            assert f"the writer of rank {failing_rank} failed writing its shards" in r["error"], (rank, r["error"])


def test_the_plan_round_runs_once_per_layout_and_every_checkpoint_is_exact_at_two_ranks(ddp_results):
    for r in ddp_results:
        _check_replanned(r["replan"])


def test_a_shard_write_failing_on_one_rank_fails_every_rank_by_name_and_the_next_checkpoint_commits(ddp_results):
    _check_write_fails([r["write_fails"] for r in ddp_results], failing_rank=1)


def test_at_four_ranks_the_plans_are_reused_and_a_rank_s_write_failure_reaches_every_rank(hsdp_results):
    for r in hsdp_results:
        _check_replanned(r["replan"])
    _check_write_fails([r["write_fails"] for r in hsdp_results], failing_rank=2)


def _check_cannot_make_writer(results: list[dict], failing_rank: int) -> None:
    for rank, r in enumerate(results):
        errors = r["cannot_make_writer"]["errors"]
        assert errors["4"] is None and errors["8"] is None, (rank, errors)
        assert r["cannot_make_writer"]["listed"] == [4, 8], (rank, r["cannot_make_writer"])
        for step in ("2", "6"):  # 2: in the plan round's gather; 6: in the write round's (plans reused)
            assert f"injected: cannot make the writer of step-00000000{step}" in errors[step], (rank, step, errors[step])
            if rank == failing_rank:  # its own error, as the trainer reports a writer's
                assert "builtins.PermissionError" in errors[step] and "the writer of rank" not in errors[step], (rank, step, errors[step])
            else:
                assert f"the writer of rank {failing_rank} failed" in errors[step], (rank, step, errors[step])
        # The committed checkpoints: 4 planned again (the round of 2 failed), 8 reused 4's plans.
        assert r["cannot_make_writer"]["plan_rounds"] == [True, False], (rank, r["cannot_make_writer"])


def test_a_writer_that_cannot_be_set_up_on_one_rank_fails_every_rank_by_name_in_either_round(ddp_results, hsdp_results):
    """Before, making the writer ran outside every collective's failure sharing: the others waited out the collective timeout."""
    _check_cannot_make_writer(ddp_results, failing_rank=1)
    _check_cannot_make_writer(hsdp_results, failing_rank=3)
