"""Several "hosts" on this machine: network namespaces joined by a veth pair (``two_hosts``:
tests/test_two_hosts.py, test_tier_nodes.py), or by a bridge (``bridged_hosts``, three or more).

Each namespace has its own interfaces and addresses (10.231.N.1 and 10.231.N.2) and
its own loopback, so a process in one reaches the other only through the pair, as two
nodes of a cluster reach each other through their NICs. Making namespaces needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; where they cannot be made, the test is
skipped, naming the command that failed and why.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
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
        _remove(made)
        detail = getattr(e, "stderr", None) or str(e)
        pytest.skip(f"network namespaces cannot be made here ({getattr(e, 'cmd', 'ip')}: {detail.strip()}); they need root with CAP_NET_ADMIN and iproute2")
    try:
        yield hosts
    finally:
        _remove(made)


@contextmanager
def bridged_hosts(count: int) -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, interface, address)] of ``count`` hosts, each with a veth pair to a bridge in a namespace of its own.

    The bridge is a switch: every host reaches every other through it, as the nodes of a
    cluster do. Removed afterwards.
    """
    tag = uuid.uuid4().hex[:6]
    subnet = 1 + int(tag[:2], 16) % 250
    switch, bridge = f"oc{tag}sw", f"oc{tag}br"
    hosts = [(f"oc{tag}h{n}", f"oc{tag}v{n}", f"10.232.{subnet}.{n + 1}") for n in range(count)]
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", switch, "link", "set", bridge, "up")
        for n, (ns, ifname, address) in enumerate(hosts):
            _ip("netns", "add", ns)
            made.append(ns)
            port = f"oc{tag}p{n}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", ifname, "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", bridge)
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", ifname)
            _ip("-n", ns, "link", "set", ifname, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (OSError, subprocess.SubprocessError) as e:
        _remove(made)
        detail = getattr(e, "stderr", None) or str(e)
        pytest.skip(f"network namespaces cannot be made here ({getattr(e, 'cmd', 'ip')}: {detail.strip()}); they need root with CAP_NET_ADMIN and iproute2")
    try:
        yield hosts
    finally:
        _remove(made)


def _remove(namespaces: Sequence[str]) -> None:
    for ns in namespaces:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # removes its veth pairs (and bridge) too
