"""The writers' rounds through each node's leader (``writer/node_tree.py``): the same values as the flat rounds, and a broken hop raised.

Real gloo ranks (``workers/node_tree_worker.py``) on one machine, each layout of ranks on
"nodes" given to the tree directly; ``test_tier_nodes.py`` runs it on two real nodes
(network namespaces) through the Checkpointer, where its checkpoints match the
uninterrupted twin bit for bit.
"""

from __future__ import annotations

import os

from helpers import launch_ranks

WORKER = os.path.join(os.path.dirname(__file__), "workers", "node_tree_worker.py")


def test_the_tree_gathers_and_broadcasts_what_the_flat_rounds_do_at_2_and_4_ranks(tmp_path):
    two = launch_ranks(WORKER, "same", 2, str(tmp_path / "two"), timeout_s=120)
    for result in two:  # one node, or a node per rank: no tree
        assert {k: v["wanted"] for k, v in result["layouts"].items()} == {"0,0": False, "0,1": False}, result
    four = launch_ranks(WORKER, "same", 4, str(tmp_path / "four"), timeout_s=180)
    trees = ["0,0,1,1", "0,1,0,1", "0,0,0,1", "0,1,1,1", "0,1,1,2"]
    for rank, result in enumerate(four):
        layouts = result["layouts"]
        assert not layouts["0,0,0,0"]["wanted"] and not layouts["0,1,2,3"]["wanted"], layouts
        for nodes in trees:
            entry = layouts[nodes]
            assert entry["wanted"] and entry["gather_same"] and entry["broadcast_same"], (rank, nodes, entry)
            # Rank 0 gets every rank's value, in rank order, however the ranks sit on the nodes.
            assert entry["gathered_ranks"] == ([0, 1, 2, 3] if rank == 0 else None), (rank, nodes, entry)
            node_of = [int(n) for n in nodes.split(",")]
            alone = node_of.count(node_of[rank]) == 1
            leader = node_of.index(node_of[rank]) == rank
            assert entry["groups"] == [not alone, leader], (rank, nodes, entry)


def test_a_writer_gone_from_its_node_fails_the_gather_on_its_leader_and_the_coordinator_by_name(tmp_path):
    # The groups' timeout (600 s) is longer than this launch may take (180 s): each rank's
    # answer came from the failure itself, carried, never from waiting out a timeout.
    results = launch_ranks(WORKER, "member_dies", 4, str(tmp_path), timeout_s=180)
    assert results[3] == {"ended": True}
    assert results[1] == {"gathered": None}  # its node's gather reached its leader: its part is done
    assert "error" in results[2], results[2]  # the leader whose node's gather broke
    assert results[0]["error"].startswith("a round of the writers' group failed on the writer of rank 2, which leads its node: "), results[0]
