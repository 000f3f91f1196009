"""The local tier on 2 nodes x 2 ranks: peer replicas, and a restore that reaches the newest complete version.

Two "nodes" are two network namespaces (``netns_hosts.py``); each runs torchrun with 2
ranks, and its tier is a directory of its own. One run of ``first`` (DDP, AdamW, a
local-tier checkpoint at steps 3 and 6, the root at step 6, trained on to step 8 and
then gone without closing, as a killed job) is the uninterrupted twin of every resume:

1. node 1's tier wiped and the root moved away (an empty root in its place, so a read
   from it finds nothing): every rank resumes version 6 from the local tier, node 1
   through its partners' replicas, and steps 7 and 8 match the twin bit for bit;
2. a replica on node 0 corrupted: refused with a warning naming the file, and the root
   is read;
3. the root newer than the tiers (their step 6 removed): the root wins;
4. both tiers lost: the job resumes from the root.

And a writer killed while replicas are being sent (``kill``): that version is listed on
no node, the writers regroup around its replacement, and the next version commits on both.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from overlapckpt.format.manifest import MANIFEST_NAME, step_of_name
from overlapckpt.format.storage import CheckpointStore

from helpers import read_child_line, read_rank_results
from netns_hosts import bridged_hosts, two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "workers", "tier_nodes_worker.py")
LAUNCH_TIMEOUT_S = 300
FIRST_PORT = 29531  # fresh namespaces: every port free; each launch takes the next
WORLD = 4


def _start(
    hosts: list[tuple[str, str, str]], phase: str, out: str, root: str, tiers: str, port: int, ranks_per_node: int = 2
) -> list[subprocess.Popen]:
    """Each node's torchrun agent (``ranks_per_node`` ranks of ``WORKER``), in its namespace; stdout and stderr in one binary pipe."""
    os.makedirs(out, exist_ok=True)
    procs = []
    for node, (ns, ifname, _) in enumerate(hosts):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname, TORCHELASTIC_ERROR_FILE="", PYTHONUNBUFFERED="1")
        command = [
            "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(hosts)), "--nproc-per-node", str(ranks_per_node),
            "--node-rank", str(node), "--master-addr", hosts[0][2], "--master-port", str(port), WORKER, phase, out, root, tiers,
        ]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _finish(procs: list[subprocess.Popen], phase: str, out: str, started: tuple[str, ...] = ()) -> list[str]:
    """Each agent's whole output (after ``started``, what was read of it already), once both ended."""
    outputs = []
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        _kill_processes_naming(out)  # the workers hold the output pipes open
        outputs = [p.communicate(timeout=30)[0].decode(errors="replace") for p in procs]
        for node, output in enumerate(outputs):
            with open(os.path.join(out, f"node{node}.log"), "w") as f:
                f.write(output)
        raise AssertionError(f"{phase}: the job did not end within {LAUNCH_TIMEOUT_S} s") from None
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        _kill_processes_naming(out)
    return [before + after for before, after in zip(started or ("",) * len(outputs), outputs)]


def _launch(
    hosts: list[tuple[str, str, str]], phase: str, out: str, root: str, tiers: str, port: int, ranks_per_node: int = 2
) -> list[dict[str, Any]]:
    outputs = _finish(_start(hosts, phase, out, root, tiers, port, ranks_per_node), phase, out)
    world = len(hosts) * ranks_per_node
    return read_rank_results([os.path.join(out, f"{phase}-rank{rank}.json") for rank in range(world)], outputs)


def _kill_processes_naming(out: str) -> None:
    """SIGKILL whatever of this launch outlived its agents: torchrun starts each worker in a session of its own,
    so a killed agent leaves its workers (and their writers) running, holding the output pipe open."""
    needle = out.encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def _final_state(out: str, phase: str, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(out, f"{phase}-rank{rank}.pt"), weights_only=True)


def _assert_equal_states(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal_states(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b)):
            _assert_equal_states(x, y, f"{where}[{k}]")
    else:
        assert a == b, where


def _assert_matches_twin(
    results: list[dict[str, Any]], out: str, phase: str, twin: list[dict[str, Any]], twin_out: str, twin_phase: str = "first"
) -> None:
    for rank, result in enumerate(results):
        assert result["losses"] == {k: v for k, v in twin[rank]["losses"].items() if int(k) > 6}, (phase, rank)
        _assert_equal_states(_final_state(out, phase, rank), _final_state(twin_out, twin_phase, rank), f"{phase} rank {rank}")


def _checkpoint_dir(tiers: str, node: int, step: int) -> str:
    (name,) = [n for n in os.listdir(os.path.join(tiers, f"node{node}")) if step_of_name(n) == step]
    return os.path.join(tiers, f"node{node}", name)


def test_two_nodes_replicate_the_local_tier_and_resume_from_the_newest_reachable_version(tmp_path):
    root, tiers = str(tmp_path / "root"), str(tmp_path / "tiers")
    with two_hosts() as hosts:
        port = iter(range(FIRST_PORT, FIRST_PORT + 10))
        twin_out = str(tmp_path / "first")
        twin = _launch(hosts, "first", twin_out, root, tiers, next(port))

        # Every node's tier holds step 6 whole: its ranks' shards and its partner's (R=1 on 2 nodes).
        for rank, result in enumerate(twin):
            # One answer per checkpoint, naming the last tier it went to: step 6 went to both.
            committed = [(step, path.startswith(tiers)) for step, path in result["committed"]]
            assert committed == [(3, True), (6, False)], (rank, result["committed"])
            # The writers' group formed its rounds through the 2 nodes' leaders (writer/node_tree.py) for each checkpoint.
            assert result["round_nodes"] == [2, 2], (rank, result["round_nodes"])
        shard_sets = []
        for node in (0, 1):
            directory = _checkpoint_dir(tiers, node, 6)
            shards = sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))
            assert {n.split("_")[2] for n in shards} == {str(r) for r in range(WORLD)}, (node, shards)  # __<rank>_<n>.distcp
            assert {".metadata", MANIFEST_NAME} <= set(os.listdir(directory)), (node, os.listdir(directory))
            shard_sets.append({n: open(os.path.join(directory, n), "rb").read() for n in shards})
        assert shard_sets[0] == shard_sets[1]  # the replicas are the very bytes their rank wrote

        # 1. Node 1 replaced (its tier wiped); the root unreachable: an empty root in its place.
        shutil.rmtree(os.path.join(tiers, "node1"))
        aside = root + ".aside"
        os.rename(root, aside)
        out = str(tmp_path / "replaced")
        resumed = _launch(hosts, "resume", out, root, tiers, next(port))
        for rank, result in enumerate(resumed):
            node = result["node"]
            assert result["restored_step"] == 6, (rank, result)
            assert result["restored_path"] == _checkpoint_dir(tiers, node, 6), (rank, result["restored_path"])
            assert not result["warnings"], (rank, result["warnings"])
        assert any("fetched" in line and "partner nodes" in line for r in resumed for line in r["log"]), [r["log"] for r in resumed]
        _assert_matches_twin(resumed, out, "resume", twin, twin_out)
        shutil.rmtree(root)
        os.rename(aside, root)

        # 2. A corrupt replica on node 0 (rank 2's largest shard there): refused by name, then the root.
        directory = _checkpoint_dir(tiers, 0, 6)
        victim = max((n for n in os.listdir(directory) if n.startswith("__2_") or n.startswith("__3_")), key=lambda n: os.path.getsize(os.path.join(directory, n)))
        with open(os.path.join(directory, victim), "r+b") as f:
            f.seek(os.path.getsize(os.path.join(directory, victim)) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        out = str(tmp_path / "corrupt")
        resumed = _launch(hosts, "resume", out, root, tiers, next(port))
        for rank, result in enumerate(resumed):
            assert result["restored_step"] == 6 and result["restored_path"].startswith(root), (rank, result["restored_path"])
            assert any("refused" in w and "restoring from the root" in w for w in result["warnings"]), (rank, result["warnings"])
            assert result["restore_figures"]["restore_source"] == "root", (rank, result["restore_figures"])
            assert isinstance(result["restore_figures"]["restore_refused_local_read_s"], float), (rank, result["restore_figures"])
        assert any(victim in w for r in resumed for w in r["warnings"]), [r["warnings"] for r in resumed]
        _assert_matches_twin(resumed, out, "resume", twin, twin_out)

        # 3. The root newer than every tier (their step 6 gone, step 3 left): the root wins.
        for node in (0, 1):
            shutil.rmtree(_checkpoint_dir(tiers, node, 6))
        out = str(tmp_path / "root-newer")
        resumed = _launch(hosts, "resume", out, root, tiers, next(port))
        for rank, result in enumerate(resumed):
            assert result["restored_step"] == 6 and result["restored_path"].startswith(root), (rank, result["restored_path"])
        assert any("newer than the local tier's newest complete version" in line for r in resumed for line in r["log"])
        _assert_matches_twin(resumed, out, "resume", twin, twin_out)

        # 4. Both nodes' tiers lost: the root.
        shutil.rmtree(tiers)
        out = str(tmp_path / "both-lost")
        resumed = _launch(hosts, "resume", out, root, tiers, next(port))
        for rank, result in enumerate(resumed):
            assert result["restored_step"] == 6 and result["restored_path"].startswith(root), (rank, result["restored_path"])
        _assert_matches_twin(resumed, out, "resume", twin, twin_out)


def _files_of(tiers: str, node: int, step: int) -> set[str]:
    return set(os.listdir(_checkpoint_dir(tiers, node, step)))


def test_three_nodes_restore_fetches_to_each_node_only_the_shards_its_ranks_read(tmp_path):
    """FSDP2 on 3 nodes x 1 rank, R=1: node n's tier holds its rank's shard and node n-1's (the ring).

    A rank's restore reads its own shard, and the file of rank 0, where the items every rank
    holds (the optimizer's param_groups, BatchNorm's statistics) are written. With node 1
    replaced, node 1 fetches shards 0 and 1 and node 2 fetches shard 0: no node gets the
    whole checkpoint, and every rank resumes version 6 bit for bit, the root unreachable.
    """
    root, tiers = str(tmp_path / "root"), str(tmp_path / "tiers")
    head = {".metadata", MANIFEST_NAME}
    with bridged_hosts(3) as hosts:
        port = iter(range(FIRST_PORT, FIRST_PORT + 10))
        twin_out = str(tmp_path / "first")
        twin = _launch(hosts, "sharded_first", twin_out, root, tiers, next(port), ranks_per_node=1)
        for node in range(3):  # its own rank's shard, and the replica of the previous node's
            assert _files_of(tiers, node, 6) == head | {f"__{node}_0.distcp", f"__{(node - 1) % 3}_0.distcp"}, node

        shutil.rmtree(os.path.join(tiers, "node1"))
        aside = root + ".aside"
        os.rename(root, aside)
        out = str(tmp_path / "replaced")
        resumed = _launch(hosts, "sharded_resume", out, root, tiers, next(port), ranks_per_node=1)
        for rank, result in enumerate(resumed):
            assert result["restored_step"] == 6, (rank, result)
            assert result["restored_path"] == _checkpoint_dir(tiers, rank, 6), (rank, result["restored_path"])
            assert not result["warnings"], (rank, result["warnings"])
        assert _files_of(tiers, 0, 6) == head | {"__0_0.distcp", "__2_0.distcp"}  # it had what rank 0 reads
        assert _files_of(tiers, 1, 6) == head | {"__0_0.distcp", "__1_0.distcp"}  # replaced: what rank 1 reads
        assert _files_of(tiers, 2, 6) == head | {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}  # rank 0's file added
        # Reported to the figures callback: 5 files fetched (2 + 2 to node 1, 1 to node 2), on every rank.
        fetched = {(1, f) for f in head | {"__0_0.distcp", "__1_0.distcp"}} | {(2, "__0_0.distcp")}
        fetched_bytes = sum(os.path.getsize(os.path.join(_checkpoint_dir(tiers, node, 6), f)) for node, f in fetched)
        for rank, result in enumerate(resumed):
            figures = result["restore_figures"]
            assert (figures["restore_source"], figures["restore_step"]) == ("partner replicas", 6), (rank, figures)
            assert (figures["restore_fetched_files"], figures["restore_fetched_bytes"]) == (5, fetched_bytes), (rank, figures)
        _assert_matches_twin(resumed, out, "sharded_resume", twin, twin_out, "sharded_first")


def test_a_writer_killed_while_replicas_are_sent_leaves_that_version_unlisted_and_the_next_commits(tmp_path):
    # Rank 3 SIGKILLs its own writer once a replica file is arriving on its node (the worker's
    # replica cap spreads version 2's copies over seconds, so the kill lands during them).
    # Before the writers freed their old group on a regroup, most runs failed here: a writer
    # whose peer had already left waited out the collective timeout in the old group, and
    # the others gave up joining the new one before it came (writer/group.py, regroup).
    root, tiers = str(tmp_path / "root"), str(tmp_path / "tiers")
    with two_hosts() as hosts:
        out = str(tmp_path / "kill")
        results = _launch(hosts, "kill", out, root, tiers, FIRST_PORT + 20)
    assert results[3]["killed"], "no replica was seen arriving on rank 3's node: the writer was never killed"
    assert results[3]["restarts"] == 1, results[3]
    for rank, result in enumerate(results):
        assert [step for step, _ in result["committed"]] == [4], (rank, result)
    for node in (0, 1):
        listed = CheckpointStore(os.path.join(tiers, f"node{node}")).committed_names()
        assert [step_of_name(n) for n in listed] == [4], (node, listed)  # version 2 never listed, on either node
        directory = _checkpoint_dir(tiers, node, 4)
        shards = {n.split("_")[2] for n in os.listdir(directory) if n.endswith(".distcp")}
        assert shards == {str(r) for r in range(WORLD)}, (node, os.listdir(directory))
        assert not [n for n in os.listdir(directory) if n.endswith(".replica-part")]


def test_a_writer_killed_in_the_roots_write_round_through_the_nodes_leaders_loses_that_version_and_the_next_commit(tmp_path):
    # Root checkpoints only, through the rounds of each node's leader: rank 3's writer hangs in
    # its shard write of version 2 and is SIGKILLed there, while its node's leader (rank 2)
    # waits for it in the write round's gather. The leader carries the failure to rank 0's
    # writer; the writers regroup around rank 3's replacement; versions 4 and 6 commit everywhere.
    root = str(tmp_path / "root")
    with two_hosts() as hosts:
        out = str(tmp_path / "root-kill")
        results = _launch(hosts, "root_kill", out, root, str(tmp_path / "tiers"), FIRST_PORT + 30)
    assert results[3]["killed"] and results[3]["restarts"] == 1, results[3]
    for rank, result in enumerate(results):
        assert result["committed"] == [4, 6], (rank, result)
        assert result["round_nodes"] == [2, 2], (rank, result)
        assert result["errors"] == [], (rank, result)  # no rank raises while max_writer_restarts lasts
    assert [step_of_name(n) for n in CheckpointStore(root).committed_names()] == [4, 6]
    # Rank 0's writer heard of it from rank 2, which leads rank 3's node, in the leaders' gather.
    lost = [line for line in results[0]["log"] if "checkpoint step-000000002 was lost" in line]
    assert lost and "a round of the writers' group failed on the writer of rank 2, which leads its node" in lost[0], results[0]["log"]


def test_a_preemption_lifts_the_replicas_rate_cap_so_its_checkpoint_reaches_every_node_within_the_grace(tmp_path):
    # Replicas are capped at 1 KiB/s here: a rank's ~200 KiB shard would take minutes, far
    # beyond the grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT 30 s, less a margin). Before the cap
    # was lifted on a preemption, the last checkpoint never reached the tiers (nor the root
    # after them) within it, and the job exited without one.
    root, tiers = str(tmp_path / "root"), str(tmp_path / "tiers")
    out = str(tmp_path / "preempt")
    with two_hosts() as hosts:
        procs = _start(hosts, "preempt", out, root, tiers, FIRST_PORT + 30)
        started = []
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        try:
            for p in procs:  # each node's 2 ranks are training
                lines: list[str] = []
                while sum("READY" in line for line in lines) < 2:
                    lines.append(read_child_line(p, timeout_s=max(1.0, deadline - time.monotonic())))
                started.append("".join(lines))
        except BaseException:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            _kill_processes_naming(out)
            raise
        for p in procs:
            p.send_signal(signal.SIGTERM)  # each node's agent, as a scheduler preempting the job does; it forwards it to its ranks
        outputs = _finish(procs, "preempt", out, tuple(started))
    results = read_rank_results([os.path.join(out, f"preempt-rank{rank}.json") for rank in range(WORLD)], outputs)
    steps = {r["last_step"] for r in results}
    assert len(steps) == 1, results  # every rank stopped at the agreed step
    (agreed,) = steps
    for rank, result in enumerate(results):
        assert result["local"] == [agreed], (rank, result)  # the local tier first, on every node
        assert result["root"] == [agreed], (rank, result)  # and the root within the grace too
    for node in (0, 1):
        directory = _checkpoint_dir(tiers, node, agreed)
        shards = {n.split("_")[2] for n in os.listdir(directory) if n.endswith(".distcp")}
        assert shards == {str(r) for r in range(WORLD)}, (node, os.listdir(directory))  # every shard on both nodes
    # A second look, in torch's own words (its agent logs this when it escalates to SIGKILL):
    # the checks above, of what every rank and tier holds, are the test.
    assert not any("forcefully exiting via" in o for o in outputs), [o[-3000:] for o in outputs]
