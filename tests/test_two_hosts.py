"""Two "hosts": two network namespaces on this machine, joined by a veth pair, one rank in each.

Each namespace has its own interfaces and addresses (10.231.N.1 and 10.231.N.2) and
its own loopback, so a rank can reach the other only through the pair, as two nodes
of a cluster reach each other through their NICs. Both ranks train under DDP (gloo)
and commit one checkpoint; the test checks that it committed on both, and that every
TCP connection of each rank's writer process runs between the two hosts' addresses.

Making namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; where
they cannot be made, the test is skipped, naming the command that failed and why.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import read_rank_results
from netns_hosts import two_hosts

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_worker.py")
LAUNCH_TIMEOUT_S = 240
PORT = 29517  # a fresh namespace has every port free


def test_writers_rendezvous_across_two_network_namespaces(tmp_path):
    with two_hosts() as hosts:
        master = hosts[0][2]
        procs = []
        for rank, (ns, ifname, _) in enumerate(hosts):
            env = dict(
                os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR=master, MASTER_PORT=str(PORT),
                OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname,  # as on a cluster: gloo's interface named
            )
            procs.append(
                subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, WORKER, "netns", str(tmp_path)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        outputs = []
        try:
            outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    results = read_rank_results([str(tmp_path / f"rank{rank}.json") for rank in range(2)], outputs)
    addresses = {address for _, _, address in hosts}
    for rank, result in enumerate(results):
        assert result["committed"] == [2], (rank, result)
        connections = result["writer_connections"]
        assert connections, (rank, "the writer holds no TCP connection: it could not have joined the group")
        for local, remote in connections:
            assert local.split(":")[0] in addresses and remote.split(":")[0] in addresses, (rank, local, remote)
        other = hosts[1 - rank][2]
        assert any(remote.split(":")[0] == other for _, remote in connections), (rank, connections)  # reached the other host
