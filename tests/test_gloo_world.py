"""What forming the writers' gloo group asks of the store (``writer/gloo_world.py``), counted in real processes.

Three processes form one gloo group with ``form_gloo_world`` over a TCPStore, each through a
``Store`` subclass that counts the requests gloo's C++ makes and the entries it reads. The
writers' settings read every rank's address in one ``multi_get`` (fewer than 128 ranks) and
name pairs by rank, so every entry is the same address-only record; a job's own settings are
kept, and with them gloo waits and reads once per rank, and each entry carries a pair number
per rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 3

WORKER = r"""
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from overlapckpt.writer.gloo_world import form_gloo_world

class Counting(dist.Store):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls, self.entries = inner, {}, []
    def _count(self, op):
        self.calls[op] = self.calls.get(op, 0) + 1
    def set(self, key, value):
        self._count("set")
        return self.inner.set(key, value)
    def get(self, key):
        self._count("get")
        value = self.inner.get(key)
        self.entries.append(len(value))
        return value
    def multi_get(self, keys):
        self._count("multi_get")
        values = self.inner.multi_get(keys)
        self.entries.extend(len(v) for v in values)
        return values
    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
    def add(self, key, n):
        self._count("add")
        return self.inner.add(key, n)
    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)
    def has_extended_api(self):
        return self.inner.has_extended_api()
    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
timeout = timedelta(seconds=60)
inner = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0, timeout=timeout)
store = Counting(inner)
form_gloo_world(store, rank, WORLD, timeout)
formed = {"calls": store.calls, "entries": store.entries}
dist.barrier()  # the group works
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(formed, f)
dist.barrier()
os._exit(0)
""".replace("WORLD", str(WORLD))


def _form(tmp_path, job_env: dict[str, str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for name in ("GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER", "GLOO_ENABLE_STORE_V2_API", "TORCH_GLOO_LAZY_INIT"):
        env.pop(name, None)
    env.update(job_env)
    out = tmp_path / ("job" if job_env else "writers")
    out.mkdir()
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(port), str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * WORLD, outputs
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_the_writers_read_every_address_in_one_request_and_each_entry_holds_the_address_alone(tmp_path):
    writers = _form(tmp_path, {})
    for formed in writers:
        # one set of its own address, one multi_get of all three (gloo reads in batches of 128 ranks)
        assert formed["calls"] == {"set": 1, "multi_get": 1}, formed
        assert len(formed["entries"]) == WORLD and len(set(formed["entries"])) == 1, formed
    # a job that set both off keeps its settings: a wait and a get per rank, and each entry
    # carries one 8-byte pair number per rank on top of the address
    job = _form(tmp_path, {"GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "0", "GLOO_ENABLE_STORE_V2_API": "0"})
    for formed in job:
        assert formed["calls"] == {"set": 1, "wait": WORLD, "get": WORLD}, formed
        assert formed["entries"] == [writers[0]["entries"][0] + 8 * WORLD] * WORLD, formed
