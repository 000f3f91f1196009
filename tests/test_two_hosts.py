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

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "dist_worker.py")
LAUNCH_TIMEOUT_S = 240
PORT = 29517  # a fresh namespace has every port free


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def _two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, interface, address)] of two hosts joined by a veth pair; removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    subnet = 1 + int(tag[:2], 16) % 250  # another run's pair, if one is left, has another subnet
    hosts = [(f"oc{tag}{side}", f"oc{tag}v{side}", f"10.231.{subnet}.{n}") for n, side in ((1, "a"), (2, "b"))]
    made: list[str] = []
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, ifname, address in hosts:
            _ip("link", "set", ifname, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        detail = getattr(e, "stderr", None) or str(e)
        pytest.skip(f"network namespaces cannot be made here ({getattr(e, 'cmd', 'ip')}: {detail.strip()}); they need root with CAP_NET_ADMIN and iproute2")
    try:
        yield hosts
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # removes the veth pair too


def test_writers_rendezvous_across_two_network_namespaces(tmp_path):
    with _two_hosts() as hosts:
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
    results = []
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no result:\n" + "\n".join(o[-3000:] for o in outputs)
        result = json.loads(path.read_text())
        assert "crashed" not in result, result.get("crashed")
        results.append(result)
    addresses = {address for _, _, address in hosts}
    for rank, result in enumerate(results):
        assert result["committed"] == [2], (rank, result)
        connections = result["writer_connections"]
        assert connections, (rank, "the writer holds no TCP connection: it could not have joined the group")
        for local, remote in connections:
            assert local.split(":")[0] in addresses and remote.split(":")[0] in addresses, (rank, local, remote)
        other = hosts[1 - rank][2]
        assert any(remote.split(":")[0] == other for _, remote in connections), (rank, connections)  # reached the other host
