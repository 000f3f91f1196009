"""What forming a gloo group asks of the store: the writers' group at construction, and at every regroup.

    python benchmarks/group_formation.py [--worlds 2,4,8,16] [--out benchmarks/results/scale]

Each world size runs that many processes on this machine, each joining one gloo group
(``init_process_group``) over a TCPStore, four ways: as torch makes it by default (every pair
of ranks connected when the group is made, each pair named by a number each rank draws, every
rank's address read with a wait and a get); with ``GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1``
(pairs named by the ranks' numbers); with ``GLOO_ENABLE_STORE_V2_API=1`` as well, as the writers
make theirs (``overlapckpt/writer/gloo_world.py``: the addresses read with one ``multi_get`` per
128 ranks); and with ``TORCH_GLOO_LAZY_INIT=1`` (a pair connected at its first message). The
counts are of the store's calls; a TCPStore ``get`` or ``multi_get`` waits for its keys first,
one more round trip to the server each. The store each
rank hands gloo is a ``torch.distributed.Store`` subclass around the TCPStore client that
counts the requests gloo's C++ makes through it, the values it reads and their bytes, until
the group is made; then each rank's open sockets once a first barrier ran. Counts are exact
and machine-independent (they depend on torch's gloo); writes ``group_formation.txt`` and
``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist

sys.path.insert(0, sys.argv[5])  # benchmarks/
from open_sockets import open_sockets as sockets

class Counting(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.requests, self.reads, self.read_bytes = inner, 0, 0, 0
    def set(self, key, value):
        self.requests += 1
        return self.inner.set(key, value)
    def get(self, key):
        value = self.inner.get(key)
        self.requests, self.reads, self.read_bytes = self.requests + 1, self.reads + 1, self.read_bytes + len(value)
        return value
    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self.requests, self.reads = self.requests + 1, self.reads + len(keys)
        self.read_bytes += sum(len(v) for v in values)
        return values
    def wait(self, keys, timeout=None):
        self.requests += 1
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
    def add(self, key, n):
        self.requests += 1
        return self.inner.add(key, n)
    def check(self, keys):
        self.requests += 1
        return self.inner.check(keys)
    def compare_set(self, key, expected, desired):
        self.requests += 1
        return self.inner.compare_set(key, expected, desired)
    def delete_key(self, key):
        self.requests += 1
        return self.inner.delete_key(key)
    def has_extended_api(self):
        return self.inner.has_extended_api()
    def num_keys(self):
        return self.inner.num_keys()
    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
inner = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))
store = Counting(inner)
before = sockets()
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
formed = dict(requests=store.requests, reads=store.reads, read_bytes=store.read_bytes)
dist.barrier()
result = dict(rank=rank, formed=formed, sockets_after_barrier=sockets() - before)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
dist.barrier()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# (label, the environment that makes it)
MODES = (
    ("full mesh (torch's default)", {}),
    ("full mesh, pairs named by rank (GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER=1)", {"GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}),
    (
        "full mesh, pairs named by rank, addresses read in batches (GLOO_ENABLE_STORE_V2_API=1 too: the writers')",
        {"GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1", "GLOO_ENABLE_STORE_V2_API": "1"},
    ),
    ("lazy (TORCH_GLOO_LAZY_INIT=1)", {"TORCH_GLOO_LAZY_INIT": "1"}),
)


def measure(world: int, mode: str, mode_env: dict[str, str], work: str) -> list[dict[str, Any]]:
    out = tempfile.mkdtemp(dir=work, prefix=f"w{world}-")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("TORCH_GLOO_LAZY_INIT", "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "GLOO_ENABLE_STORE_V2_API"):
        env.pop(name, None)
    env.update(mode_env)
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(world), str(port), out, os.path.dirname(os.path.abspath(__file__))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    for p in procs:
        p.communicate(timeout=600)
    results = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"world {world} ({mode}): rank {r} wrote no result")
        with open(path) as f:
            results.append(json.load(f))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4,8,16")
    parser.add_argument("--out", default="benchmarks/results/scale")
    args = parser.parse_args()
    import torch

    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for world in worlds:
            for mode, mode_env in MODES:
                ranks = measure(world, mode, mode_env, work)
                rows.append(
                    {
                        "world": world,
                        "mode": mode,
                        "requests_per_rank_max": max(r["formed"]["requests"] for r in ranks),
                        "reads_per_rank_max": max(r["formed"]["reads"] for r in ranks),
                        "read_bytes_per_rank_max": max(r["formed"]["read_bytes"] for r in ranks),
                        "read_bytes_all_ranks": sum(r["formed"]["read_bytes"] for r in ranks),
                        "sockets_after_barrier_max": max(r["sockets_after_barrier"] for r in ranks),
                    }
                )
    lines = [
        f"$ python benchmarks/group_formation.py --worlds {args.worlds} --out {args.out}",
        "",
        f"torch {torch.__version__}; one gloo group over a TCPStore per world size, counted through a Store subclass "
        "(requests, values read and their bytes, until init_process_group returned; sockets opened by the group once a barrier ran)",
        "",
        "| N | gloo | store requests / rank | values read / rank | bytes read / rank | bytes read, all ranks | sockets / rank after a barrier |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['world']} | {row['mode']} | {row['requests_per_rank_max']} | "
            f"{row['reads_per_rank_max']} | {row['read_bytes_per_rank_max']:,} | {row['read_bytes_all_ranks']:,} | {row['sockets_after_barrier_max']} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "group_formation.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "group_formation.json"), "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
