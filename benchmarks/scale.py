"""How a checkpoint's and a restore's coordination grows with the world size: the real writer protocol, tiny state, N ranks on one machine.

    python benchmarks/scale.py --worlds 2,4,8,16 --out benchmarks/results/scale

Per world size N it launches ``torchrun --standalone --nproc-per-node N`` of this file
(gloo, ``OMP_NUM_THREADS=1``). Every rank builds the same small MLP, sharded with FSDP2
(``--parallelism fsdp``: every rank writes a shard of every tensor, so DCP's plans and
``.metadata`` grow as at scale) or wrapped in DDP, constructs a real ``Checkpointer`` (real
writer processes, real writers' gloo group, the job's real TCPStore), and takes
``--checkpoints`` checkpoints (``every=2``; the first is the warm-up: the writer's plan and
DCP's plan cache are cold), waiting for each to commit. Then it restores ``--restores``
times (``ckpt.restore()``: the newest checkpoint, read back through DCP with the training
group).

What is counted, from this benchmark only (the library is unchanged):

* **Store operations and bytes.** ``torch.distributed.Store``'s methods are wrapped in every
  training process and in every writer process: each Python-level call on a ``TCPStore`` or
  ``PrefixStore`` (one round trip to the store's server) is counted by operation, with the
  value bytes sent and received. The writers run ``python -I`` from a fork server
  (``overlapckpt/train/writer_client/launcher.py``), which ignores PYTHONPATH and
  sitecustomize: the training process therefore prefixes the launcher's bootstrap
  (``_SERVER_BOOTSTRAP``, ``WRITER_BOOTSTRAP``) with an import of this file's probe. Gloo's own
  rendezvous talks to the store from C++ (at group formation only) and is not seen. The server
  total is the sum over every client process; the store's server is torchrun's agent.
* **Collectives.** ``torch.distributed``'s collectives are wrapped (in both namespaces): a
  *call* is a top-level API call (``gather_object``, ``broadcast_object_list``...), a *round* a
  tensor collective underneath (an object collective is two or three: sizes, then payloads),
  with the tensor bytes this rank sent and received.
* **Per checkpoint**, in each writer: ``overlapckpt.writer.process._persist`` is wrapped, so
  each checkpoint's counts are the difference around it (exact, whatever else the machine
  runs); the time it is entered is when that rank's snapshot reached its writer. The traffic
  between checkpoints (the idle writer's polls) is reported per second.
* **Coordinator time**: ``ckpt.stats[i]["persist_phases_s"]`` of rank 0 (the writer's own
  laps: agree_and_replay, snapshot_checksums, write, manifest, commit), and, from the probe,
  the plan round (``overlapckpt.writer.group_save.plan``: the gather of local plans, the global
  plan, the scatter, where the claims' verdict asks for one; ``_DistWrapper.reduce_scatter``
  where DCP's own ``save`` runs) and the write round (``group_save.write`` and ``finish``: the
  data, the gather of results and sections, ``.metadata``; ``_DistWrapper.all_reduce``), and
  ``create_global_plan`` alone.
* **Last snapshot to global commit**: rank 0's ``committed_at_unix_s`` (its writer's clock
  after the commit's publish) less the latest ``_persist`` entry over the ranks (one
  machine: one clock).
* **Server connections**: established TCP connections on the store's port, counted on rank 0
  from ``/proc/net/tcp`` while every writer is up.

Each figure is then fitted over the world sizes as constant, ``a + b·log2 N``, ``a + b·N`` and
``a + b·N + c·N²`` (least squares); the simplest whose RMS residual is within 2% (counts) or
10% (times) of the mean is chosen, else the one of least residual.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Any

from open_sockets import open_sockets  # benchmarks/, on the path of every process the probe runs in

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
PROBE_DIR_ENV = "OVERLAPCKPT_SCALE_PROBE_DIR"

# ---- the probe: store and collective counters, in training and writer processes -------------------------------------

STORE_OPS = (
    "set", "get", "add", "check", "wait", "delete_key", "compare_set", "multi_get", "multi_set", "append",
    "num_keys", "list_keys", "queue_push", "queue_pop", "queue_len",
)
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")
TENSOR_COLLECTIVES = (
    "all_gather", "gather", "broadcast", "all_reduce", "scatter", "barrier", "reduce_scatter", "all_to_all",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "monitored_barrier",
)


class Counters:
    """Every count of one process, flat: ``store.<op>.calls``, ``store.<op>.bytes_out``, ``coll.<name>.calls``, ``round.<name>``..."""

    def __init__(self) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self.local = threading.local()

    def add(self, key: str, by: float = 1.0) -> None:
        self.values[key] += by

    def snapshot(self) -> dict[str, float]:
        return dict(self.values)


COUNTERS = Counters()


def _nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8"))
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _tensor_bytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _wrap_store() -> None:
    import torch.distributed as dist

    def wrap(op: str, original: Any) -> Any:
        def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            COUNTERS.add(f"store.{op}.calls")
            out = 0
            if op in ("set", "append", "queue_push") and len(args) >= 2:
                out = _nbytes(args[1])
            elif op == "compare_set" and len(args) >= 3:
                out = _nbytes(args[1]) + _nbytes(args[2])
            elif op == "multi_set" and len(args) >= 2:
                out = _nbytes(args[1])
            elif op in ("check", "wait", "multi_get") and args:
                COUNTERS.add(f"store.{op}.keys", len(args[0]))
            elif op == "add":
                out = 8
            inbound = _nbytes(result) if op in ("get", "compare_set", "multi_get", "queue_pop") else 0
            COUNTERS.add(f"store.{op}.bytes_out", out)
            COUNTERS.add(f"store.{op}.bytes_in", inbound)
            return result

        return counted

    for op in STORE_OPS:
        original = dist.Store.__dict__.get(op)
        if original is not None:
            setattr(dist.Store, op, wrap(op, original))


def _leaf_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int]:
    """(sent, received) tensor bytes of one tensor collective on this rank."""
    import torch.distributed as dist

    def arg(i: int, key: str) -> Any:
        return args[i] if len(args) > i else kwargs.get(key)

    rank = dist.get_rank() if dist.is_initialized() else 0
    if name == "all_gather":
        return _tensor_bytes(arg(1, "tensor")), _tensor_bytes(arg(0, "tensor_list"))
    if name == "gather":
        return _tensor_bytes(arg(0, "tensor")), _tensor_bytes(arg(1, "gather_list"))
    if name == "broadcast":
        n = _tensor_bytes(arg(0, "tensor"))
        src = arg(1, "src")
        return (n, 0) if src == rank else (0, n)
    if name == "all_reduce":
        n = _tensor_bytes(arg(0, "tensor"))
        return n, n
    if name == "scatter":
        src = arg(2, "src")
        return (_tensor_bytes(arg(1, "scatter_list")) if src == rank else 0), _tensor_bytes(arg(0, "tensor"))
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return _tensor_bytes(arg(1, "input_tensor")), _tensor_bytes(arg(0, "output_tensor"))
    return 0, 0


def _round_peers(name: str, kwargs: dict[str, Any]) -> tuple[int, int]:
    """(peers this rank exchanges a message with in the round, the round's sequential ring steps): a flat root
    talks to every other rank of the group, any other rank to the root; an all-gather is a ring of group size - 1 steps."""
    import torch.distributed as dist

    group = kwargs.get("group")
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if name in ("gather", "scatter", "broadcast"):
        root = kwargs.get("group_dst", kwargs.get("group_src"))
        if root is None:
            global_root = kwargs.get("dst", kwargs.get("src"))
            root = dist.get_group_rank(group, global_root) if group is not None and global_root is not None else global_root
        return (size - 1 if root == me else 1), 0
    if name in ("all_gather", "all_gather_into_tensor"):
        return size - 1, size - 1
    return size - 1, 0


def _wrap_collectives() -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def wrap(name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(COUNTERS.local, "depth", 0)
            if depth == 0:
                COUNTERS.add(f"coll.{name}.calls")
            if name in TENSOR_COLLECTIVES:
                sent, received = _leaf_bytes(name, args, kwargs)
                COUNTERS.add(f"round.{name}")
                COUNTERS.add("rounds")
                peers, ring = _round_peers(name, kwargs)
                COUNTERS.add("round_peers", peers)
                COUNTERS.add("ring_steps", ring)
                COUNTERS.add("coll_bytes_sent", sent)
                COUNTERS.add("coll_bytes_received", received)
            elif depth == 0 and name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"):
                # The object this rank contributes: all_gather_object(list, obj), gather_object(obj, list),
                # broadcast_object_list(list), scatter_object_list(out, in_list).
                payload = args[1] if name in ("all_gather_object", "scatter_object_list") and len(args) > 1 else (args[0] if args else None)
                if name == "scatter_object_list" and len(args) < 2:
                    payload = kwargs.get("scatter_object_input_list")
                try:
                    COUNTERS.add(f"coll.{name}.pickled_bytes", len(pickle.dumps(payload)) if payload is not None else 0)
                except Exception:  # noqa: BLE001 - an unpicklable argument: the rounds' bytes still count it
                    pass
            COUNTERS.local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                COUNTERS.local.depth = depth

        counted.__wrapped__ = original  # type: ignore[attr-defined]
        return counted

    for name in OBJECT_COLLECTIVES + TENSOR_COLLECTIVES:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapped = wrap(name, original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)


def _timed(key: str, original: Any) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            COUNTERS.add(f"time.{key}_s", time.perf_counter() - started)
            COUNTERS.add(f"time.{key}.calls")

    return timed


def _wrap_dcp() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    _DistWrapper.reduce_scatter = _timed("dcp_plan_round", _DistWrapper.reduce_scatter)  # type: ignore[method-assign]
    _DistWrapper.all_reduce = _timed("dcp_write_round", _DistWrapper.all_reduce)  # type: ignore[method-assign]
    DefaultSavePlanner.create_local_plan = _timed("create_local_plan", DefaultSavePlanner.create_local_plan)  # type: ignore[method-assign]
    DefaultSavePlanner.create_global_plan = _timed("create_global_plan", DefaultSavePlanner.create_global_plan)  # type: ignore[method-assign]
    # The writers' own rounds where the coordinator commits alone (overlapckpt/writer/group_save.py).
    from overlapckpt.writer import group_save

    group_save.plan = _timed("dcp_plan_round", group_save.plan)  # type: ignore[assignment]
    group_save.write = _timed("dcp_write_round", group_save.write)  # type: ignore[assignment]
    group_save.finish = _timed("dcp_write_round", group_save.finish)  # type: ignore[assignment]


def _wrap_writer_persist(out_dir: str) -> None:
    """Each checkpoint's counts in this writer, and the counts since the previous one (idle polls), one JSON line each."""
    from overlapckpt.writer import process

    original = process._persist
    last = {"t": time.time(), "counts": COUNTERS.snapshot()}

    def persist(conn: Any, state: Any, req: Any) -> Any:
        entered = time.time()
        before = COUNTERS.snapshot()
        try:
            return original(conn, state, req)
        finally:
            left = time.time()
            after = COUNTERS.snapshot()
            record = {
                "pid": os.getpid(),
                "rank": None if state.group is None else state.group.rank,
                "name": req.name,
                "entered_unix_s": entered,
                "left_unix_s": left,
                "counts": _delta(after, before),
                "idle_s": entered - last["t"],
                "idle_counts": _delta(before, last["counts"]),
                "sockets": open_sockets(),  # its gloo groups' connections, the store's client, its pipes to the trainer
            }
            last["t"], last["counts"] = left, after
            with open(os.path.join(out_dir, f"writer-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    process._persist = persist  # type: ignore[assignment]


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def install_probe(role: str) -> None:
    """Count this process's store calls and collectives (``role``: "training" or "writer")."""
    _wrap_store()
    _wrap_collectives()
    _wrap_dcp()
    if role == "writer":
        _wrap_writer_persist(os.environ[PROBE_DIR_ENV])


def _probe_bootstrap(original: str) -> str:
    """The launcher's ``python -I -c`` bootstrap, with this probe installed first (argv[1] is the package's parent)."""
    return (
        f"import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, {_HERE!r}); "
        "import scale; scale.install_probe('writer'); " + original
    )


# ---- one rank --------------------------------------------------------------------------------------------------------


def _server_connections(port: int) -> int:
    """Established TCP connections whose local port is the store's (its server's side), on this machine."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local_port = int(fields[1].rsplit(":", 1)[1], 16)
                    if local_port == port and fields[3] == "01":
                        count += 1
        except OSError:
            continue
    return count


def _build(parallelism: str, width: int, layers: int) -> tuple[Any, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks[:-1])
    if parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model:
            if isinstance(block, nn.Linear):
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif parallelism == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    else:
        raise ValueError(f"--parallelism {parallelism!r}: use fsdp or ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, opt


def _worker(spec_path: str) -> None:
    install_probe("training")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    with open(spec_path) as f:
        spec = json.load(f)
    os.environ[PROBE_DIR_ENV] = spec["probe_dir"]
    from overlapckpt.train.writer_client import launcher

    launcher._SERVER_BOOTSTRAP = _probe_bootstrap(launcher._SERVER_BOOTSTRAP)
    launcher.WRITER_BOOTSTRAP = _probe_bootstrap(launcher.WRITER_BOOTSTRAP)
    from overlapckpt import Checkpointer

    dist.init_process_group("gloo", timeout=timedelta(seconds=spec["timeout_s"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"rank": rank, "world": world}
    try:
        model, opt = _build(spec["parallelism"], spec["width"], spec["layers"])
        before = COUNTERS.snapshot()
        started = time.perf_counter()
        ckpt = Checkpointer(model, opt, spec["root"], every=spec["every"], keep=spec["keep"])
        result["construct_s"] = time.perf_counter() - started
        result["construct_counts"] = _delta(COUNTERS.snapshot(), before)
        generator = torch.Generator().manual_seed(1 + rank)
        steps = spec["every"] * spec["checkpoints"]
        before = COUNTERS.snapshot()
        for step in range(1, steps + 1):
            x = torch.randn(8, spec["width"], generator=generator)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
            if step % spec["every"] == 0:
                ckpt.wait(timeout_s=spec["timeout_s"])  # each checkpoint committed before the next: one at a time
        result["train_counts"] = _delta(COUNTERS.snapshot(), before)
        # One more checkpoint after an idle pause: the writers' traffic between checkpoints, per second
        # (the checkpoints above come faster than the idle writer's first poll). Not in the figures.
        time.sleep(spec["idle_s"])
        for _ in range(spec["every"]):
            x = torch.randn(8, spec["width"], generator=generator)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.step()
        ckpt.wait(timeout_s=spec["timeout_s"])
        result["stats"] = ckpt.stats
        result["server_connections"] = _server_connections(int(os.environ["MASTER_PORT"])) if rank == 0 else None
        restores = []
        for _ in range(spec["restores"]):
            dist.barrier()  # every rank starts the restore together: its time is the restore's, not the wait for the last rank
            before = COUNTERS.snapshot()
            started = time.perf_counter()
            info = ckpt.restore()
            restores.append(
                {
                    "wall_s": time.perf_counter() - started,
                    "counts": _delta(COUNTERS.snapshot(), before),
                    "figures": ckpt.restore_figures,
                    "step": info.step,
                }
            )
        result["restores"] = restores
        result["files_in_root"] = {name: len(os.listdir(os.path.join(spec["root"], name))) for name in sorted(os.listdir(spec["root"])) if name.startswith("step-")}
    except BaseException:
        import traceback

        result["crashed"] = traceback.format_exc()
    with open(os.path.join(spec["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f, default=str)
    try:
        dist.barrier()
    finally:
        sys.stdout.flush()
        os._exit(0)  # gloo's teardown can abort at exit; the writers follow their lifeline


# ---- the launcher: one torchrun per world size -----------------------------------------------------------------------


def _launch(world: int, args: argparse.Namespace, work: str) -> dict[str, Any]:
    out_dir = os.path.join(work, f"world{world}")
    probe_dir = os.path.join(out_dir, "probe")
    root = os.path.join(out_dir, "root")
    os.makedirs(probe_dir)
    spec = {
        "probe_dir": probe_dir, "out_dir": out_dir, "root": root, "every": args.every, "keep": args.keep,
        "checkpoints": args.checkpoints, "restores": args.restores, "parallelism": args.parallelism,
        "width": args.width, "layers": args.layers, "timeout_s": args.timeout_s, "idle_s": args.idle_s,
    }
    spec_path = os.path.join(out_dir, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    per_node = args.ranks_per_node
    if per_node and world > per_node:
        proc = _launch_on_nodes(world, per_node, spec_path, env, args.timeout_s + 600)
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            os.path.abspath(__file__), "--worker", spec_path,
        ]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout_s + 600)
    ranks = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"world {world}: rank {r} wrote no result (torchrun exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(path) as f:
            ranks.append(json.load(f))
    crashed = [r for r in ranks if "crashed" in r]
    if crashed:
        raise RuntimeError(f"world {world}: rank {crashed[0]['rank']} crashed:\n{crashed[0]['crashed']}")
    writers: list[dict[str, Any]] = []
    for name in sorted(os.listdir(probe_dir)):
        with open(os.path.join(probe_dir, name)) as f:
            writers += [json.loads(line) for line in f if line.strip()]
    return {"world": world, "launch_s": time.perf_counter() - started, "ranks": ranks, "writers": writers}


def _launch_on_nodes(world: int, per_node: int, spec_path: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """``world`` ranks as nodes of ``per_node`` ranks: one network namespace per node, joined by a bridge, each with
    its torchrun agent (``tests/netns_hosts.py``; needs root and iproute2). Node 0's agent hosts the store."""
    sys.path.insert(0, os.path.join(_REPO, "tests"))
    from netns_hosts import bridged_hosts

    if world % per_node:
        raise SystemExit(f"--ranks-per-node {per_node} does not divide world size {world}; pick world sizes that are multiples of it")
    nodes = world // per_node
    with bridged_hosts(nodes) as hosts:
        agents = []
        for node, (ns, ifname, _) in enumerate(hosts):
            command = [
                "ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                f"--nproc-per-node={per_node}", f"--node-rank={node}", f"--master-addr={hosts[0][2]}", "--master-port=29500",
                os.path.abspath(__file__), "--worker", spec_path,
            ]
            node_env = {**env, "GLOO_SOCKET_IFNAME": ifname, "TORCHELASTIC_ERROR_FILE": ""}
            agents.append(subprocess.Popen(command, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [agent.communicate(timeout=timeout_s) for agent in agents]
    failed = next((a.returncode for a in agents if a.returncode), 0)
    return subprocess.CompletedProcess(agents[0].args, failed, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))


# ---- the store's own cost: one client's round trip, and the server's rate under several clients ---------------------

_STORE_CLIENT = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=60))
store.add("ready", 1)
store.wait(["go"])
done, deadline = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    store.check(["claim/0/0"]); store.get("claim/0/0")
    done += 2
print(done)
"""


def measure_store(clients: int, seconds: float) -> dict[str, float]:
    """A TCPStore server (as torchrun's agent hosts one): one client's sequential round trip, and ops/s with ``clients`` processes."""
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    server.set("claim/0/0", "x" * 160)  # a sealed claim's size
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
    rtts = []
    for _ in range(7):
        started = time.perf_counter()
        for _ in range(1000):
            client.check(["claim/0/0"])
            client.get("claim/0/0")
        rtts.append((time.perf_counter() - started) / 2000)
    procs = [
        subprocess.Popen([sys.executable, "-c", _STORE_CLIENT, "127.0.0.1", str(server.port), str(seconds)], stdout=subprocess.PIPE, text=True)
        for _ in range(clients)
    ]
    while int(server.add("ready", 0)) < clients:
        time.sleep(0.05)  # the clients import torch: nothing to wait on but the counter
    server.set("go", "1")
    total = sum(int(p.communicate(timeout=seconds + 120)[0].split()[-1]) for p in procs)
    return {"rtt_s": statistics.median(rtts), "rtt_spread": _spread(rtts), "server_ops_per_s": total / seconds, "clients": clients}


# ---- figures ---------------------------------------------------------------------------------------------------------


def _store_totals(counts: dict[str, float]) -> tuple[float, float]:
    """(store round trips, value bytes both ways) in ``counts``."""
    ops = sum(v for k, v in counts.items() if k.startswith("store.") and k.endswith(".calls"))
    nbytes = sum(v for k, v in counts.items() if k.startswith("store.") and (k.endswith(".bytes_out") or k.endswith(".bytes_in")))
    return ops, nbytes


def _coll_totals(counts: dict[str, float]) -> tuple[float, float, float]:
    """(top-level collective calls, tensor rounds, bytes sent + received) in ``counts``."""
    calls = sum(v for k, v in counts.items() if k.startswith("coll.") and k.endswith(".calls"))
    return calls, counts.get("rounds", 0.0), counts.get("coll_bytes_sent", 0.0) + counts.get("coll_bytes_received", 0.0)


def _by_op(counts: dict[str, float], prefix: str) -> dict[str, int]:
    return {k[len(prefix) + 1 : -len(".calls")]: int(v) for k, v in sorted(counts.items()) if k.startswith(prefix + ".") and k.endswith(".calls")}


def _spread(values: list[float]) -> dict[str, Any]:
    from stats import spread

    return spread(values)


def summarize(run: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One world size's figures: per checkpoint (steady state and the warm-up), per restore, idle."""
    world = run["world"]
    by_name: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for w in run["writers"]:
        by_name[w["name"]].append(w)
    names = sorted(by_name)
    incomplete = [n for n in names if len(by_name[n]) != world]
    if incomplete:
        raise RuntimeError(f"world {world}: checkpoints {incomplete} were persisted by fewer than {world} writers")
    rank0 = next(r for r in run["ranks"] if r["rank"] == 0)
    stats_by_name = {os.path.basename(s["path"]): s for s in rank0["stats"]}

    per_ckpt = []
    for name in names:
        recs = sorted(by_name[name], key=lambda w: w["rank"])
        rank_store = [_store_totals(w["counts"]) for w in recs]
        rank_coll = [_coll_totals(w["counts"]) for w in recs]
        stat = stats_by_name[name]
        phases = stat["persist_phases_s"]
        coord = recs[0]["counts"]
        last_snapshot = max(w["entered_unix_s"] for w in recs)
        per_ckpt.append(
            {
                "name": name,
                "store_ops_per_rank_max": max(o for o, _ in rank_store),
                "store_ops_per_rank_min": min(o for o, _ in rank_store),
                "store_bytes_per_rank_max": max(b for _, b in rank_store),
                "store_ops_server": sum(o for o, _ in rank_store),
                "store_bytes_server": sum(b for _, b in rank_store),
                "store_by_op_rank0": _by_op(coord, "store"),
                "store_by_op_rank1": _by_op(recs[-1]["counts"], "store") if world > 1 else {},
                "coll_calls_per_rank": max(c for c, _, _ in rank_coll),
                "coll_rounds_per_rank": max(r for _, r, _ in rank_coll),
                "coll_bytes_coordinator": rank_coll[0][2],
                "coll_bytes_other_max": max((b for _, _, b in rank_coll[1:]), default=0.0),
                "coll_bytes_total": sum(b for _, _, b in rank_coll),
                "round_peers_coordinator": coord.get("round_peers", 0.0),
                "round_peers_other_max": max((w["counts"].get("round_peers", 0.0) for w in recs[1:]), default=0.0),
                "ring_steps_max": max(w["counts"].get("ring_steps", 0.0) for w in recs),
                "sockets_per_writer_max": max(w.get("sockets", 0) for w in recs),
                "coll_by_name_rank0": _by_op(coord, "coll"),
                "pickled_bytes_rank0": {k[5:]: int(v) for k, v in coord.items() if k.endswith(".pickled_bytes")},
                "round_nodes": stat.get("writer_round_nodes", 1),
                "phases_s": phases,
                "persist_s_rank0": stat["persist_s"],
                "dcp_plan_round_s": coord.get("time.dcp_plan_round_s", 0.0),
                "dcp_write_round_s": coord.get("time.dcp_write_round_s", 0.0),
                "create_global_plan_s": coord.get("time.create_global_plan_s", 0.0),
                "last_snapshot_to_commit_s": stat["committed_at_unix_s"] - last_snapshot,
                "first_to_last_snapshot_s": last_snapshot - min(w["entered_unix_s"] for w in recs),
            }
        )
    steady = per_ckpt[warmup:-1]  # the last one follows the idle pause
    # Idle: the writers' store traffic during the pause before the last checkpoint, per second, per writer.
    idle_rates = [_store_totals(w["idle_counts"])[0] / w["idle_s"] for w in by_name[names[-1]] if w["idle_s"] > 0]
    restores = []
    for i in range(len(rank0["restores"])):
        recs = [r["restores"][i] for r in sorted(run["ranks"], key=lambda r: r["rank"])]
        rank_store = [_store_totals(r["counts"]) for r in recs]
        rank_coll = [_coll_totals(r["counts"]) for r in recs]
        restores.append(
            {
                "wall_s_max": max(r["wall_s"] for r in recs),
                "choose_s_rank0": (recs[0]["figures"] or {}).get("restore_choose_s"),
                "read_s_rank0": (recs[0]["figures"] or {}).get("restore_read_s"),
                "store_ops_per_rank_max": max(o for o, _ in rank_store),
                "store_ops_server": sum(o for o, _ in rank_store),
                "coll_calls_per_rank": max(c for c, _, _ in rank_coll),
                "coll_rounds_per_rank": max(r for _, r, _ in rank_coll),
                "coll_bytes_per_rank_max": max(b for _, _, b in rank_coll),
                "coll_bytes_total": sum(b for _, _, b in rank_coll),
                "coll_by_name_rank0": _by_op(recs[0]["counts"], "coll"),
                "pickled_bytes_rank0": {k[5:]: int(v) for k, v in recs[0]["counts"].items() if k.endswith(".pickled_bytes")},
            }
        )
    return {
        "world": world,
        "launch_s": run["launch_s"],
        "server_connections": rank0["server_connections"],
        "construct_s_max": max(r["construct_s"] for r in run["ranks"]),
        "construct_store_ops_training": sum(_store_totals(r["construct_counts"])[0] for r in run["ranks"]),
        "train_store_ops": sum(_store_totals(r["train_counts"])[0] for r in run["ranks"]),
        "train_coll_calls": sum(_coll_totals(r["train_counts"])[0] for r in run["ranks"]),
        "files_per_checkpoint": max(rank0["files_in_root"].values()) if rank0["files_in_root"] else 0,
        "checkpoints": per_ckpt,
        "steady": steady,
        "warmup": per_ckpt[:warmup],
        "idle_store_ops_per_s_per_rank": statistics.median(idle_rates) if idle_rates else None,
        "restores": restores,
    }


# Figures fitted over world sizes: (label, where in a summary, kind). kind "count" must be the same on every
# steady-state checkpoint (the median is fitted and any spread reported); "time" is fitted on the median.
CKPT_FIGURES = [
    ("store ops / rank (max)", "store_ops_per_rank_max", "count"),
    ("store bytes / rank (max)", "store_bytes_per_rank_max", "count"),
    ("store ops at server", "store_ops_server", "count"),
    ("store bytes at server", "store_bytes_server", "count"),
    ("writer collective calls / rank", "coll_calls_per_rank", "count"),
    ("writer collective rounds / rank", "coll_rounds_per_rank", "count"),
    ("collective bytes, coordinator", "coll_bytes_coordinator", "count"),
    ("collective bytes, other rank (max)", "coll_bytes_other_max", "count"),
    ("collective bytes, all ranks", "coll_bytes_total", "count"),
    ("peer messages, coordinator", "round_peers_coordinator", "count"),
    ("peer messages, other rank (max)", "round_peers_other_max", "count"),
    ("ring steps, longest rank", "ring_steps_max", "count"),
    ("open sockets per writer (max)", "sockets_per_writer_max", "count"),
    ("coordinator persist_s", "persist_s_rank0", "time"),
    ("coord. agree_and_replay s", "phases_s.agree_and_replay", "time"),
    ("coord. write s (DCP save)", "phases_s.write", "time"),
    ("coord. DCP plan round s", "dcp_plan_round_s", "time"),
    ("coord. create_global_plan s", "create_global_plan_s", "time"),
    ("coord. DCP write round s", "dcp_write_round_s", "time"),
    ("coord. manifest s", "phases_s.manifest", "time"),
    ("coord. commit s", "phases_s.commit", "time"),
    ("last snapshot -> commit s", "last_snapshot_to_commit_s", "time"),
]
RESTORE_FIGURES = [
    ("restore store ops / rank", "store_ops_per_rank_max", "count"),
    ("restore store ops at server", "store_ops_server", "count"),
    ("restore collective calls / rank", "coll_calls_per_rank", "count"),
    ("restore collective rounds / rank", "coll_rounds_per_rank", "count"),
    ("restore collective bytes / rank (max)", "coll_bytes_per_rank_max", "count"),
    ("restore collective bytes, all ranks", "coll_bytes_total", "count"),
    ("restore wall s (slowest rank)", "wall_s_max", "time"),
    ("restore choose s (rank 0)", "choose_s_rank0", "time"),
    ("restore read s (rank 0)", "read_s_rank0", "time"),
]


def _get(record: dict[str, Any], path: str) -> float:
    value: Any = record
    for part in path.split("."):
        value = value.get(part, 0.0) if isinstance(value, dict) else 0.0
    return float(value or 0.0)


MODELS = {
    "constant": (lambda n: [1.0], ["a"]),
    "log": (lambda n: [1.0, math.log2(n)], ["a", "b·log2 N"]),
    "linear": (lambda n: [1.0, float(n)], ["a", "b·N"]),
    "quadratic": (lambda n: [1.0, float(n), float(n) ** 2], ["a", "b·N", "c·N²"]),
}


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return [float(x) for x in torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1)]


def fit(worlds: list[int], ys: list[float], kind: str) -> dict[str, Any]:
    """Least squares of each model; the simplest within tolerance of the mean (2% counts, 10% times), else the least residual.

    Counts are exact, so N² may be chosen (a server total of per-rank O(N) terms); times are noisy and
    measured at four sizes at most, so they are fitted with the two-term models only.
    """
    tolerance = 0.02 if kind == "count" else 0.10
    scale = max(statistics.fmean(abs(y) for y in ys), 1e-12)
    fits = {}
    for name, (basis, terms) in MODELS.items():
        if len(basis(1)) > len(worlds) or (kind == "time" and name == "quadratic"):
            continue
        coef = _lstsq([basis(n) for n in worlds], ys)
        residuals = [y - sum(c * x for c, x in zip(coef, basis(n))) for n, y in zip(worlds, ys)]
        rms = math.sqrt(statistics.fmean(r * r for r in residuals))
        fits[name] = {"coefficients": dict(zip(terms, coef)), "rms": rms, "relative_rms": rms / scale}
    chosen = next((name for name, f in fits.items() if f["relative_rms"] <= tolerance), None)
    if chosen is None:
        chosen = min(fits, key=lambda name: fits[name]["rms"])
    return {"chosen": chosen, "fits": fits, "dominant_at_max": _dominant(chosen, fits[chosen]["coefficients"], max(worlds))}


def predict(chosen: str, coefficients: dict[str, float], n: int) -> float:
    basis, terms = MODELS[chosen]
    return sum(coefficients[t] * x for t, x in zip(terms, basis(n)))


def _dominant(chosen: str, coefficients: dict[str, float], n: int) -> str:
    basis, terms = MODELS[chosen]
    contributions = {t: abs(coefficients[t] * x) for t, x in zip(terms, basis(n))}
    return max(contributions, key=lambda t: contributions[t])


def _formula(chosen: str, coefficients: dict[str, float]) -> str:
    parts = []
    for term, c in coefficients.items():
        parts.append(f"{c:.4g}" if term == "a" else f"{c:.4g}·{term.split('·', 1)[1]}")
    return " + ".join(parts).replace("+ -", "- ")


def figures_over_worlds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    worlds = [s["world"] for s in summaries]
    out: dict[str, Any] = {}
    for section, figures, key in (("checkpoint", CKPT_FIGURES, "steady"), ("restore", RESTORE_FIGURES, "restores")):
        for label, path, kind in figures:
            per_world = []
            for s in summaries:
                values = [_get(r, path) for r in s[key]]
                per_world.append({"world": s["world"], "values": values, "spread": _spread(values), "exact": len(set(values)) == 1})
            medians = [w["spread"]["median"] for w in per_world]
            out[f"{section}: {label}"] = {"kind": kind, "per_world": per_world, "fit": fit(worlds, medians, kind)}
    return out


def _cell(w: dict[str, Any], kind: str) -> str:
    s = w["spread"]
    if kind == "count":
        return f"{s['median']:.0f}" if w["exact"] else f"{s['median']:.0f} [{s['min']:.0f}..{s['max']:.0f}]"
    return f"{s['median'] * 1000:.1f} ({s['min'] * 1000:.1f}/{s['p90'] * 1000:.1f}/{s['max'] * 1000:.1f})"


def render(command: str, machine: str, summaries: list[dict[str, Any]], figures: dict[str, Any], args: argparse.Namespace) -> str:
    worlds = [s["world"] for s in summaries]
    lines = [
        f"$ {command}",
        "",
        f"machine: {machine}",
        f"state: {args.layers} Linear({args.width}, {args.width}) layers, AdamW, {args.parallelism}; every={args.every}, keep={args.keep}; "
        f"{args.checkpoints} checkpoints per world size (the first {args.warmup} warm-up, not in the figures), then one after "
        f"{args.idle_s:g} s idle (its idle writers' polls only), {args.restores} restores; "
        + (f"nodes of {args.ranks_per_node} ranks (a network namespace each)" if args.ranks_per_node else "one node"),
        "counts: steady-state median over the checkpoints (exact: the same on every one, else [min..max]);",
        "times: median (min/p90/max) in ms over the steady-state checkpoints, or over the restores",
        "",
    ]
    label_width = max(len(k) for k in figures) + 2
    header = "figure".ljust(label_width) + "".join(f"N={n}".rjust(34) for n in worlds) + "   fit (chosen: formula; dominant term at N max)"
    lines.append(header)
    lines.append("-" * len(header))
    for label, f in figures.items():
        fitted = f["fit"]
        chosen = fitted["chosen"]
        formula = _formula(chosen, fitted["fits"][chosen]["coefficients"])
        cells = "".join(_cell(w, f["kind"]).rjust(34) for w in f["per_world"])
        lines.append(f"{label.ljust(label_width)}{cells}   {chosen}: {formula}; {fitted['dominant_at_max']}")
    lines += ["", "per world size:"]
    for s in summaries:
        first = s["warmup"][0] if s["warmup"] else None
        steady = s["steady"][0]
        lines.append(
            f"  N={s['world']}: store server connections {s['server_connections']}, files per checkpoint directory "
            f"{s['files_per_checkpoint']}, idle writer store ops/s/rank {s['idle_store_ops_per_s_per_rank']:.2f}, "
            f"training-side store ops during the steps {s['train_store_ops']:.0f}, training-side collective calls during the steps "
            f"{s['train_coll_calls']:.0f}, launch {s['launch_s']:.0f} s; the writers' rounds through {steady['round_nodes']} node(s)' leaders"
        )
        lines.append(f"    steady checkpoint, rank 0 store ops by kind {steady['store_by_op_rank0']}; last rank {steady['store_by_op_rank1']}")
        lines.append(f"    steady checkpoint, rank 0 collective calls {steady['coll_by_name_rank0']}; pickled bytes {steady['pickled_bytes_rank0']}")
        if first is not None:
            lines.append(
                f"    warm-up checkpoint: store ops/rank {first['store_ops_per_rank_max']:.0f}, collective calls/rank "
                f"{first['coll_calls_per_rank']:.0f}, rounds/rank {first['coll_rounds_per_rank']:.0f}, coordinator collective bytes "
                f"{first['coll_bytes_coordinator']:.0f}, pickled {first['pickled_bytes_rank0']}"
            )
        r = s["restores"][0]
        lines.append(f"    restore, rank 0 collective calls {r['coll_by_name_rank0']}; pickled bytes {r['pickled_bytes_rank0']}")
    return "\n".join(lines) + "\n"


def _machine() -> str:
    import platform

    import torch

    return f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", default="2,4,8,16", help="world sizes, comma-separated")
    parser.add_argument("--checkpoints", type=int, default=8, help="checkpoints per world size, the warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="leading checkpoints left out of the figures")
    parser.add_argument("--restores", type=int, default=7)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--parallelism", choices=("fsdp", "ddp"), default="fsdp")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument(
        "--ranks-per-node", type=int, default=0,
        help="run each world larger than this as nodes of this many ranks, one network namespace each (root, iproute2); 0: one node",
    )
    parser.add_argument("--idle-s", type=float, default=5.0, help="idle pause before a last checkpoint, which measures the idle writers' polls")
    parser.add_argument("--store-clients", type=int, default=4, help="client processes of the store's rate measurement")
    parser.add_argument("--store-seconds", type=float, default=5.0)
    parser.add_argument("--out", help="write DIR/run1.txt and DIR/run1.json")
    parser.add_argument("--name", default="run1", help="the result files' name in --out")
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    from stats import MIN_REPEATS

    if args.checkpoints - args.warmup < MIN_REPEATS or args.restores < MIN_REPEATS:
        parser.error(f"a spread needs at least {MIN_REPEATS} steady-state checkpoints and restores")
    worlds = [int(w) for w in args.worlds.split(",")]
    command = "python " + " ".join([os.path.relpath(__file__, _REPO), *sys.argv[1:]])
    work = tempfile.mkdtemp(prefix="overlapckpt-scale-")
    summaries = []
    try:
        for world in worlds:
            run = _launch(world, args, work)
            summaries.append(summarize(run, args.warmup))
            print(f"N={world}: {len(run['writers'])} persists, launch {run['launch_s']:.0f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    figures = figures_over_worlds(summaries)
    store_cost = measure_store(args.store_clients, args.store_seconds)
    text = render(command, _machine(), summaries, figures, args)
    text += (
        f"\nthe store itself (a TCPStore server in one process, as torchrun's agent hosts it): one client's round trip (check or get "
        f"of a 160-byte value) {store_cost['rtt_s'] * 1e6:.0f} us median (min {store_cost['rtt_spread']['min'] * 1e6:.0f} / "
        f"p90 {store_cost['rtt_spread']['p90'] * 1e6:.0f} / max {store_cost['rtt_spread']['max'] * 1e6:.0f}, 7 x 2000 ops); "
        f"{store_cost['server_ops_per_s']:.0f} ops/s at the server with {store_cost['clients']} client processes for "
        f"{args.store_seconds:g} s (this machine's 2 cores bound it)\n"
    )
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}.txt"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump(
                {"command": command, "machine": _machine(), "args": vars(args), "store": store_cost, "figures": figures, "summaries": summaries},
                f, indent=1, default=str,
            )


if __name__ == "__main__":
    sys.path.insert(0, _HERE)
    main()
