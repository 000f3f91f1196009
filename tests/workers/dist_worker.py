"""One rank of a multi-process gloo run for tests/test_distributed.py.

    python tests/workers/dist_worker.py SCENARIO OUT_DIR [ARG]   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Each scenario runs several checks in one process-group launch and writes what it
observed to OUT_DIR/rank<R>.json; the test asserts on those files. A worker passes
a barrier after writing and leaves with os._exit(0) (gloo's teardown can abort).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt import Checkpointer, ConfigError, list_checkpoints, load  # noqa: E402
from overlapckpt.seams import engine_of

from helpers import StatefulSampler, TinyNet, exited_within, read_fifo_line, write_rank_result_and_leave  # noqa: E402

STEPS = 7
REQUEST_AT = 3
WIDTH = 255  # odd: FSDP2 shards dim 0 unevenly (128 and 127 rows on 2 ranks)
FEATURES = 64


def Net() -> TinyNet:  # noqa: N802 - the model's name in these tests
    """The shared TinyNet, wide and odd: FSDP2 shards dim 0 unevenly; BatchNorm and dropout as in every test."""
    return TinyNet(width=WIDTH, features=FEATURES, outputs=FEATURES, dropout=0.2)


TP_WIDTH = 256  # even: DTensor's tensor-parallel styles assume even shards of the activations
TP_KINDS = ("fsdp_tp", "plain_tp", "fsdp_sub")


def TpNet() -> TinyNet:  # noqa: N802 - the model's name in these tests
    """The 2-D mesh's net: TinyNet without BatchNorm, which has no tensor-parallel style."""
    model = TinyNet(width=TP_WIDTH, features=FEATURES, outputs=FEATURES, dropout=0.2)
    model.norm = nn.Identity()
    return model


class Sampler(StatefulSampler):
    """Per-rank data with its own generator: state that a resume must restore per rank."""

    def __init__(self, rank: int) -> None:
        super().__init__(seed=1000 + rank, features=FEATURES, outputs=FEATURES)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch(16)


def data_rank(kind: str) -> int:
    """Whose data this rank trains on: the two tensor-parallel ranks of a data-parallel group share it."""
    return dist.get_rank() // 2 if kind == "fsdp_tp" else dist.get_rank()


def build(kind: str, group: Any = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = Net() if kind not in TP_KINDS else TpNet()
    world = dist.get_world_size()
    if kind == "fsdp_tp":
        # A 2x2 mesh: FSDP2 over "dp", tensor parallel over "tp" (Colwise then Rowwise, uneven:
        # WIDTH is odd). FSDP2 shards the TP-sharded weights again on dim 0 (strided sharding).
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"inp": ColwiseParallel(), "out": RowwiseParallel()})
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif kind == "fsdp_sub":  # FSDP2 over the ranks of ``group`` (a 2-rank reshard target inside a 4-rank launch)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    elif kind in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if kind == "fsdp":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in (model.inp, model.out):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind not in ("plain", "plain_tp"):
        raise ValueError(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(100 + dist.get_rank())  # per-rank dropout masks
    return model, opt


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state, gathered on every rank, by DCP key (outside any hook)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items() if isinstance(v, torch.Tensor)}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optimizer.state.{fqn}.{k}"] = v.detach().clone()
    return out


def train(model, opt, sampler, steps, ckpt=None, requests=(), losses=None, states=None, start=1):
    for it in range(start, steps + 1):
        x, y = sampler.batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if losses is not None:
            losses[it] = float(loss.detach())
        if ckpt is not None:
            if it in requests:
                ckpt.request()
            ckpt.step()
        if states is not None:
            states[it] = full_state(model, opt)


class CollectiveWatch:
    """Wraps torch.distributed's collectives and records any called from inside an overlapckpt hook."""

    NAMES = (
        "all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
        "gather_object", "scatter_object_list", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
        "scatter", "reduce", "all_to_all", "send", "recv", "monitored_barrier",
    )
    HOOKS = ("_pre_hook", "_post_hook", "mark_iteration_end", "request")

    def __init__(self) -> None:
        self.calls_in_hooks: list[str] = []
        self.calls_outside = 0
        import torch.distributed.distributed_c10d as c10d

        self._saved = []
        for module in (dist, c10d):
            for name in self.NAMES:
                fn = getattr(module, name, None)
                if fn is not None:
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None:
                code = frame.f_code
                if code.co_name in self.HOOKS and code.co_filename.endswith(os.path.join("overlapckpt", "engine.py")):
                    self.calls_in_hooks.append(f"{name} from {code.co_name}")
                    break
                frame = frame.f_back
            else:
                self.calls_outside += 1
            return fn(*args, **kwargs)

        return wrapped

    def restore(self) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def shard_files(path: str) -> dict[str, int]:
    return {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path)) if f.endswith(".distcp")}


def exactness(kind: str, out: str, settings: dict[str, Any], name: str) -> dict[str, Any]:
    """A checkpointed run against its uninterrupted twin, each committed checkpoint loaded back."""
    rank = dist.get_rank()
    twin: dict[int, dict[str, torch.Tensor]] = {}
    model, opt = build(kind)
    train(model, opt, Sampler(data_rank(kind)), STEPS, states=twin)
    model, opt = build(kind)
    path = os.path.join(out, name)
    watch = CollectiveWatch()
    try:
        ckpt = Checkpointer(model, opt, path, **settings)
        train(model, opt, Sampler(data_rank(kind)), STEPS, ckpt=ckpt, requests=(REQUEST_AT,))
        infos = ckpt.wait(timeout_s=120)
        stats = ckpt.stats
        ckpt.close()
    finally:
        watch.restore()
    # The reference is rank 0's twin: DDP broadcasts rank 0's buffers, the others' drift.
    box = [twin]
    dist.broadcast_object_list(box, src=0)
    twin = box[0]
    result: dict[str, Any] = {
        "versions": [i.step for i in infos],
        "copied_nbytes": [s["copied_nbytes"] for s in stats],
        "nbytes": [s["nbytes"] for s in stats],
        "collectives_in_hooks": watch.calls_in_hooks,
        "state_bytes": sum(v.numel() * v.element_size() for v in twin[1].values()),
        # The test judges: what each rank loaded back, against rank 0's twin at that version.
        "loaded_files": {},
        "twin_files": {},
    }
    for info in infos:
        fresh, fresh_opt = build(kind)
        load(info.path, fresh, fresh_opt, per_rank_state="skip")
        loaded_file = os.path.join(out, f"{name}-loaded-{info.step}-rank{rank}.pt")
        torch.save(full_state(fresh, fresh_opt), loaded_file)
        result["loaded_files"][str(info.step)] = loaded_file
        result["files"] = shard_files(info.path)
        twin_file = os.path.join(path, f"twin-{info.step}.pt")  # also the one-process reshard's reference
        if rank == 0:
            torch.save(twin[info.step], twin_file)
        result["twin_files"][str(info.step)] = twin_file
    return result


def scenario_exact(kind: str, out: str) -> dict[str, Any]:
    configs = {"w1": dict(window=1), "w3-replay": dict(window=3, consistency="replay"), "w3-stage": dict(window=3, consistency="stage")}
    if kind in ("hsdp", "fsdp_tp"):
        configs.pop("w3-stage")
    return {name: exactness(kind, out, settings, name) for name, settings in configs.items()}


def scenario_ddp(out: str) -> dict[str, Any]:
    result = scenario_exact("ddp", out)
    result["resume"] = resume("ddp", out)
    result["local_tier"] = local_tier("ddp", out)
    result["reshard_to_fsdp"] = reshard_into("fsdp", os.path.join(out, "w1"))
    result["mismatched_steps"] = mismatched_requests(out, {0: 2, 1: 3}, "steps")
    result["one_rank_only"] = mismatched_requests(out, {0: 2}, "one")
    result["writer_killed"] = writer_killed(out)
    result["settings_mismatch"] = settings_mismatch(out)
    result["export_refused"] = export_refused(out)
    result["auto_window"] = auto_window(out)
    result["commit_fails"] = commit_fails_on_the_coordinator(out, "CannotClearTheNameStore")
    result["begin_fails"] = commit_fails_on_the_coordinator(out, "CannotLookStore")
    result["listeners"] = listeners_opened(out)
    result["replan"] = replanned("ddp", out)
    result["write_fails"] = write_fails_on_a_rank(out, 1)
    result["cannot_make_writer"] = writer_cannot_be_made_on_a_rank(out, 1)
    return result


def _listening_sockets() -> set[int]:
    """Inodes of the TCP sockets this process holds in the LISTEN state (from /proc)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(int(target[len("socket:[") : -1]))
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        listening.add(int(fields[9]))
        except FileNotFoundError:
            continue
    return mine & listening


def _tcp_connections(pid: int) -> list[tuple[str, str]]:
    """(local, remote) "addr:port" of each established TCP socket process ``pid`` holds (IPv4, from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))

    def address(text: str) -> str:
        host, port = text.split(":")
        if len(host) == 32:  # /proc/net/tcp6: an IPv4-mapped address (::ffff:a.b.c.d) keeps its last 4 bytes
            host = host[24:]
        octets = [str(int(host[i : i + 2], 16)) for i in range(6, -1, -2)]  # little-endian hex
        return f"{'.'.join(octets)}:{int(port, 16)}"

    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):  # a dual-stack socket is listed in tcp6
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "01" and int(fields[9]) in inodes:  # TCP_ESTABLISHED
                    out.append((address(fields[1]), address(fields[2])))
    return out


def scenario_netns(out: str) -> dict[str, Any]:
    """One rank per network namespace ("host"): a checkpoint commits; the writers' TCP stays on the hosts' addresses."""
    model, opt = build("ddp")
    with Checkpointer(model, opt, os.path.join(out, "ckpts")) as ckpt:
        train(model, opt, Sampler(dist.get_rank()), 3, ckpt=ckpt, requests=(2,))
        committed = [i.step for i in ckpt.wait(timeout_s=120)]
        connections = _connections_reaching_another_host(ckpt.writer_pid, timeout_s=60)
        # Both writers stay up until both ranks have read: a rank that closed its Checkpointer
        # first would end its writer, and the other writer's gloo socket to it would leave
        # ESTABLISHED (CLOSE_WAIT) before a slower rank read it, leaving only the store connection.
        dist.barrier()
    return {"committed": committed, "writer_connections": connections}


def _connections_reaching_another_host(pid: int, timeout_s: float) -> list[tuple[str, str]]:
    """The writer's TCP connections, read again until one reaches another host's address or ``timeout_s`` passed.

    The writers' gloo pair is established before the first collective, and the caller keeps
    the other rank's writer alive until this returns; the test checks what the last reading holds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        connections = _tcp_connections(pid)
        if any(remote.split(":")[0] != local.split(":")[0] for local, remote in connections) or time.monotonic() > deadline:
            return connections
        time.sleep(0.05)  # polling /proc: there is nothing to wait on


def listeners_opened(out: str) -> dict[str, Any]:
    """Listening sockets a Checkpointer adds to this training process (the writers reuse the job's store)."""
    before = _listening_sockets()
    model, opt = build("ddp")
    ckpt = Checkpointer(model, opt, os.path.join(out, "listeners"))
    after = _listening_sockets()
    train(model, opt, Sampler(dist.get_rank()), 2, ckpt=ckpt, requests=(2,))
    committed = [i.step for i in ckpt.wait(timeout_s=120)]
    ckpt.close()
    return {"new_listeners": sorted(after - before), "committed": committed}


def settings_mismatch(out: str) -> dict[str, Any]:
    """Different settings on different ranks: ConfigError on every rank, naming the setting and each value."""
    model, opt = build("plain")
    try:
        Checkpointer(model, opt, os.path.join(out, "settings"), every=3 + dist.get_rank(), max_writer_restarts=2 - dist.get_rank())
    except Exception as e:
        return {"error_type": type(e).__name__, "error": str(e)}
    return {"error_type": None}


def export_refused(out: str) -> dict[str, Any]:
    """export_formats=("hf_trainer",) in a distributed run: refused on every rank, before any file is written.

    The Hugging Face Trainer resumes DDP from one rng_state_{rank}.pth per process, and a
    rank's writer holds only its share of the tensors; the export is for one process.
    """
    model, opt = build("ddp")
    path = os.path.join(out, "export")
    try:
        Checkpointer(model, opt, path, export_formats=("hf_trainer",))
    except Exception as e:
        return {"error_type": type(e).__name__, "error": str(e), "written": os.path.exists(path)}
    return {"error_type": None}


def auto_window(out: str) -> dict[str, Any]:
    """window="auto": every rank uses the same window, the writers' agreement after each commit."""
    model, opt = build("ddp")
    sampler = Sampler(dist.get_rank())
    with Checkpointer(model, opt, os.path.join(out, "auto"), window="auto", max_window=4) as ckpt:
        train(model, opt, sampler, 3, ckpt=ckpt, requests=(2,))
        ckpt.wait(timeout_s=120)
        train(model, opt, sampler, 12, ckpt=ckpt, requests=(8,), start=4)
        ckpt.wait(timeout_s=120)
        choices = [s["ledger"]["window_choice"] for s in ckpt.stats]
        return {"windows": [s["window"] for s in ckpt.stats], "versions": [s["step"] for s in ckpt.stats],
                "reasons": [c["reason"] for c in choices]}


def scenario_fsdp(out: str) -> dict[str, Any]:
    result = scenario_exact("fsdp", out)
    result["reshard_from_plain"] = reshard_into("fsdp", os.path.join(out, "..", "plain"), expect_file=os.path.join(out, "..", "plain.pt"))
    result["verify_share"] = verify_share(os.path.join(out, "w1"))
    result["malformed_manifest"] = malformed_manifest(os.path.join(out, "w1"), os.path.join(out, "malformed"))
    return result


def read_manifest_json(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "overlapckpt.json")) as f:
        return json.load(f)


def verify_share(root: str) -> dict[str, Any]:
    """load(verify=True): the bytes this rank's checks read (the test sums them), then a flipped bit."""
    import overlapckpt.format.blob_checks as blob_checks
    import overlapckpt.restore.check as loading

    reports: list[dict[str, int]] = []
    blobs_read: list[tuple[str, int, int]] = []
    real_verify, real_sums = loading.verify_checkpoint, blob_checks._blob_sums

    def recording(*args: Any, **kwargs: Any) -> Any:  # the real pre-read check, its report kept for the test
        report = real_verify(*args, **kwargs)
        reports.append({"nbytes": report.nbytes, "files": report.files})
        return report

    def recording_sums(relative_path: str, info: Any, expected: Any) -> Any:  # looked up once per blob read, in every read path
        if expected is not None:  # checked (the placing pass after the check does not check the same files again)
            blobs_read.append((relative_path, int(info.offset), int(info.length)))
        return real_sums(relative_path, info, expected)

    loading.verify_checkpoint = recording
    blob_checks._blob_sums = recording_sums
    try:
        info = list_checkpoints(root)[-1]
        model, opt = build("fsdp")
        load(info.path, model, opt, per_rank_state="skip", verify=True)
        out: dict[str, Any] = {
            "reports": list(reports),
            "blobs_read": list(blobs_read),
            "blobs_stored": [
                (f, b["offset"], b["length"])
                for f, e in read_manifest_json(info.path)["checksums"]["files"].items()
                for b in e["blobs"]
            ],
            "stored": {n: os.path.getsize(os.path.join(info.path, n)) for n in os.listdir(info.path)},
        }
        # A flipped bit in rank 1's shard: every rank refuses, naming it.
        dist.barrier()
        if dist.get_rank() == 0:
            target = os.path.join(info.path, "__1_0.distcp")
            with open(target, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0x01]))
        dist.barrier()
        started = time.monotonic()
        try:
            load(info.path, *build("fsdp"), per_rank_state="skip", verify=True)
            out["flipped"] = None
        except Exception as e:
            out["flipped"] = {"error_type": type(e).__name__, "error": str(e)[:2000], "elapsed_s": time.monotonic() - started}
        return out
    finally:
        loading.verify_checkpoint = real_verify
        blob_checks._blob_sums = real_sums


def malformed_manifest(source_root: str, root: str) -> dict[str, Any]:
    """A manifest whose own checksum matches but whose world_size is a string: a named error on every rank."""
    from overlapckpt.format.manifest import dump_manifest

    if dist.get_rank() == 0:
        shutil.copytree(source_root, root)
        name = sorted(n for n in os.listdir(root) if n.startswith("step-"))[-1]
        path = os.path.join(root, name, "overlapckpt.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest["world_size"] = "two"
        manifest.pop("manifest_crc32", None)
        with open(path, "wb") as f:
            f.write(dump_manifest(manifest))
    dist.barrier()
    started = time.monotonic()
    try:
        name = sorted(n for n in os.listdir(root) if n.startswith("step-"))[-1]
        load(os.path.join(root, name), *build("fsdp"), per_rank_state="skip")
        return {"error_type": None}
    except Exception as e:
        return {"error_type": type(e).__name__, "error": str(e)[:2000], "elapsed_s": time.monotonic() - started}


def reshard_into(kind: str, root: str, expect_file: str | None = None) -> dict[str, Any]:
    """Load the newest checkpoint under ``root`` into a ``kind`` model, with overlapckpt and with stock DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    info = list_checkpoints(root)[-1]
    rank = dist.get_rank()
    out: dict[str, Any] = {"step": info.step, "expected_file": expect_file}

    def keep(what: str, state: dict[str, torch.Tensor]) -> None:
        # The test judges: each way of loading, saved for it to compare with torch.equal.
        out[what] = os.path.join(root, f"judged-{kind}-{what}-rank{rank}.pt")
        torch.save(state, out[what])

    model, opt = build(kind)
    load(info.path, model, opt, per_rank_state="skip")
    keep("overlapckpt", full_state(model, opt))
    model2, opt2 = build(kind)
    msd, osd = get_state_dict(model2, opt2)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=info.path)
    set_state_dict(model2, opt2, model_state_dict=msd, optim_state_dict=osd)
    keep("stock_dcp", full_state(model2, opt2))
    plain, plain_opt = build("plain")
    load(info.path, plain, plain_opt, per_rank_state="skip")
    keep("plain_model", full_state(plain, plain_opt))
    return out


def resume(kind: str, out: str) -> dict[str, Any]:
    """Losses after a resume at the same world size against the uninterrupted twin's."""
    rank = dist.get_rank()
    twin_losses: dict[int, float] = {}
    model, opt = build(kind)
    sampler = Sampler(rank)
    path = os.path.join(out, "resume")
    with Checkpointer(model, opt, path, window=2, consistency="replay", stateful={"sampler": sampler}) as ckpt:
        train(model, opt, sampler, STEPS + 3, ckpt=ckpt, requests=(REQUEST_AT,), losses=twin_losses)
        (info,) = ckpt.wait(timeout_s=120)
    model, opt = build(kind)
    sampler = Sampler(rank)
    torch.manual_seed(12345)  # a different RNG: the restore must bring back this rank's
    load(path, model, opt, stateful={"sampler": sampler})
    resumed: dict[int, float] = {}
    train(model, opt, sampler, STEPS + 3, losses=resumed, start=info.step + 1)
    return {  # the test compares them
        "version": info.step,
        "twin_losses": {str(k): v for k, v in twin_losses.items()},
        "resumed_losses": {str(k): v for k, v in resumed.items()},
    }


def local_tier(kind: str, out: str) -> dict[str, Any]:
    """Two ranks on one host with a local tier: one writers' group commits each tier; restore() takes the newer local one.

    The root takes every=6 (version 6), the local tier local_every=2 (2, 4, 6, 8, 10, the
    last two kept). The root's shards are then corrupted, so a restore that read them would
    fail: restore() must take version 10 from the local tier, and training on reproduces
    the twin's losses.
    """
    rank = dist.get_rank()
    steps = STEPS + 3
    path, local = os.path.join(out, "tiered"), os.path.join(out, "tiered-local")
    # Rank 1 on "another node" (its host name told apart): 2 nodes cannot hold 2 replicas besides each shard's
    # own node, so local_replicas=2 is refused on every rank, before anything is written to the tier.
    import socket

    real_hostname = socket.gethostname
    if rank == 1:
        socket.gethostname = lambda: "another-node"  # type: ignore[assignment]
    refused = None
    try:
        model, opt = build(kind)
        Checkpointer(
            model, opt, os.path.join(out, "two-hosts"), local_every=2, local_replicas=2, local_dir=os.path.join(out, "two-hosts-local")
        ).close()
    except ConfigError as e:
        refused = str(e)
    finally:
        socket.gethostname = real_hostname  # type: ignore[assignment]
    twin_losses: dict[int, float] = {}
    model, opt = build(kind)
    sampler = Sampler(rank)
    with Checkpointer(model, opt, path, every=6, local_every=2, local_keep=2, local_dir=local, stateful={"sampler": sampler}) as ckpt:
        train(model, opt, sampler, steps, ckpt=ckpt, losses=twin_losses)
        ckpt.wait(timeout_s=120)
    train(model, opt, sampler, steps + 3, losses=twin_losses, start=steps + 1)
    dist.barrier()
    root_versions = [i.step for i in list_checkpoints(path)]
    local_versions = [i.step for i in list_checkpoints(local)]
    if rank == 0:  # a read of the root's data would now fail verification
        for info in list_checkpoints(path):
            for name in shard_files(info.path):
                with open(os.path.join(info.path, name), "r+b") as f:
                    f.seek(os.path.getsize(os.path.join(info.path, name)) // 2)
                    byte = f.read(1)
                    f.seek(-1, os.SEEK_CUR)
                    f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    model, opt = build(kind)
    sampler = Sampler(rank)
    torch.manual_seed(12345)  # a different RNG: the restore must bring back this rank's
    resumed: dict[int, float] = {}
    with Checkpointer(model, opt, path, every=6, local_every=2, local_keep=2, local_dir=local, stateful={"sampler": sampler}) as ckpt:
        info = ckpt.restore()
        step_count = ckpt.step_count
    train(model, opt, sampler, steps + 3, losses=resumed, start=info.step + 1)
    return {
        "two_hosts_refused": refused,
        "two_hosts_local_dir_made": os.path.exists(os.path.join(out, "two-hosts-local")),
        "root_versions": root_versions,
        "local_versions": local_versions,
        "restored_version": info.step,
        "restored_path": info.path,
        "step_count": step_count,
        "twin_losses": {str(k): v for k, v in twin_losses.items()},
        "resumed_losses": {str(k): v for k, v in resumed.items()},
    }


def mismatched_requests(out: str, request_at: dict[int, int], name: str) -> dict[str, Any]:
    """Ranks that request differently: a named error on every rank within a bounded time, nothing committed."""
    rank = dist.get_rank()
    # No DDP here: a rank that stops at its error must not leave the other in a backward all-reduce.
    model, opt = build("plain")
    path = os.path.join(out, f"mismatch-{name}")
    ckpt = Checkpointer(model, opt, path, window=1, agreement_timeout_s=4.0, collective_timeout_s=30.0)
    started = time.monotonic()
    error = None
    sampler = Sampler(rank)
    try:
        for it in range(1, 100_000):  # until the error arrives, or the deadline below
            x, y = sampler.batch()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if request_at.get(rank) == it:
                ckpt.request()
            ckpt.step()
            if it >= 5 and rank in request_at:
                ckpt.wait(timeout_s=60)
            if time.monotonic() - started > 60:
                break
    except Exception as e:  # what we are here to see
        error = e
    return _outcome(ckpt, path, error, time.monotonic() - started)


def commit_fails_on_the_coordinator(out: str, store_class_name: str) -> dict[str, Any]:
    """The coordinating writer's storage fails (a fakes store): every rank raises it, named, and nothing is listed.

    ``CannotClearTheNameStore``: its commit, after every rank wrote. ``CannotLookStore``:
    before the attempt begins, while the others wait for its answer."""
    import fakes

    rank = dist.get_rank()
    model, opt = build("plain")
    path = os.path.join(out, f"commit-fails-{store_class_name}")
    if rank == 0:  # what a retention removal cut short leaves: a directory at the name, without .metadata
        os.makedirs(os.path.join(path, "step-000000002"))
        open(os.path.join(path, "step-000000002", "leftover"), "w").close()
    dist.barrier()
    store_class = getattr(fakes, store_class_name)
    os.environ[fakes.TRAINER_PID_ENV] = str(os.getpid())  # the writer, forked later, inherits it
    ckpt = Checkpointer(model, opt, path, window=1, collective_timeout_s=60.0, store_class=store_class)
    started = time.monotonic()
    error = None
    try:
        train_requesting_at_2(model, opt, Sampler(rank), ckpt, steps=2)
        ckpt.wait(timeout_s=120)
    except Exception as e:  # what we are here to see
        error = e
    outcome = _outcome(ckpt, path, error, time.monotonic() - started)
    os.environ.pop(fakes.TRAINER_PID_ENV, None)
    return outcome


def train_requesting_at_2(model: nn.Module, opt: torch.optim.Optimizer, sampler: Sampler, ckpt: Checkpointer, steps: int) -> None:
    """``steps`` plain steps (no DDP: a rank that stops at an error leaves no peer in an all-reduce), a checkpoint requested at step 2."""
    for it in range(1, steps + 1):
        x, y = sampler.batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if it == 2:
            ckpt.request()
        ckpt.step()


def block_rank_1_in_step_2(out: str, fifo_name: str) -> str:
    """Make rank 1's writer hang in its first shard write of step-000000002 (fakes.BlockingStore), after
    announcing it on the FIFO returned; the writers of the other ranks write normally. Collective."""
    from fakes import BLOCK_FIFO_ENV, ONLY_NAME_ENV

    rank = dist.get_rank()
    fifo = os.path.join(out, fifo_name)
    if rank == 1:
        os.environ[BLOCK_FIFO_ENV] = fifo
        os.environ[ONLY_NAME_ENV] = "step-000000002"
    else:
        os.environ.pop(BLOCK_FIFO_ENV, None)
        os.environ[ONLY_NAME_ENV] = "none"
    if rank == 0:
        os.mkfifo(fifo)
    dist.barrier()
    return fifo


def writer_killed(out: str) -> dict[str, Any]:
    """Rank 1's writer SIGKILLed while it persists: every rank raises in bounded time, nothing is listed."""
    rank = dist.get_rank()
    fifo = block_rank_1_in_step_2(out, "block.fifo")
    model, opt = build("plain")
    path = os.path.join(out, "killed")
    # No restart budget: the death is raised on every rank, in bounded time.
    ckpt = Checkpointer(
        model, opt, path, window=1, store_class=__import__("fakes").BlockingStore, collective_timeout_s=20.0, max_writer_restarts=0
    )
    error = None
    started = None
    try:
        train_requesting_at_2(model, opt, Sampler(rank), ckpt, steps=3)
        if rank == 1:
            with open(fifo) as f:  # the writer announces it is inside a shard write
                f.readline()
            started = time.monotonic()
            os.kill(ckpt.writer_pid, signal.SIGKILL)
        else:
            started = time.monotonic()
        ckpt.wait(timeout_s=90)
    except Exception as e:
        error = e
    return _outcome(ckpt, path, error, time.monotonic() - (started or time.monotonic()))


def writer_restarted(out: str) -> dict[str, Any]:
    """Writers SIGKILLed mid-persist, idle, mid-persist with the death seen in a request's wait for a slot,
    and as the ranks agree: later checkpoints commit on every rank."""
    from fakes import BLOCK_FIFO_ENV, ONLY_NAME_ENV

    rank = dist.get_rank()
    fifo = block_rank_1_in_step_2(out, "restart.fifo")  # its replacement inherits this: only step 2 hangs
    fifo_7 = os.path.join(out, "restart-7.fifo")
    model, opt = build("ddp")
    path = os.path.join(out, "restarted")
    ckpt = Checkpointer(
        model, opt, path, window=1, store_class=__import__("fakes").BlockingStore, collective_timeout_s=60.0, agreement_timeout_s=30.0
    )
    sampler = Sampler(rank)
    result: dict[str, Any] = {"error": None}
    states: dict[int, dict[str, torch.Tensor]] = {}
    killed: list[float] = []
    late: list[int] = []
    killer = None
    if rank == 1:
        # Training must go on while the writer persists (rank 0's snapshot of step 2 is sent
        # from its next hook), so a thread waits for the writer to be inside the shard write.
        def kill_when_writing() -> None:
            with open(fifo) as f:
                f.readline()
            killed.append(time.monotonic())
            os.kill(ckpt.writer_pid, signal.SIGKILL)  # mid-persist

        killer = threading.Thread(target=kill_when_writing, daemon=True)
        killer.start()
    try:
        for it in range(1, 13):
            x, y = sampler.batch()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if it == 9:
                if rank == 0:
                    # Rank 0's writer hangs inside the shard write of step 7 (after the ranks agreed
                    # on it) and is killed there; the death is first seen by request(), as it waits
                    # for the slot step 7 holds. Rank 1's writer loses step 7 when its collective breaks.
                    read_fifo_line(fifo_7, timeout_s=120)
                    pid = ckpt.writer_pid
                    os.kill(pid, signal.SIGKILL)
                    assert exited_within(pid, 60), f"writer {pid} outlived SIGKILL by 60 s"
                    ckpt.request()
                # Rank 1 hands its snapshot of step 9 to its writer only after a collective that
                # follows rank 0's request() (as a rank whose copies land late does): request()
                # must not wait for checkpoint 9 to commit.
                dist.barrier()
                if rank == 1:
                    ckpt.request()
            if it == 10:
                late = [i.step for i in ckpt.wait(timeout_s=120)]  # 9 committed: nothing in flight
                if rank == 1:
                    # Killed as the ranks agree on checkpoint 10: rank 0's writer may be waiting
                    # for this rank's claim, or idle; this rank's request goes to the replacement.
                    os.kill(ckpt.writer_pid, signal.SIGKILL)
            if it in (2, 4, 7, 10, 12):
                ckpt.request()
            ckpt.step()
            states[it] = full_state(model, opt)
            if it == 3 and killer is not None:
                killer.join(timeout=120)  # the kill happened before the next request
                assert killed, "rank 1's writer never reached the shard write of step 2"
            if it == 4:
                result["committed_after_kill"] = [i.step for i in ckpt.wait(timeout_s=120)]
                if killed:
                    result["kill_to_next_commit_s"] = time.monotonic() - killed[0]
            if it == 5 and rank == 0:
                # Its replacement (started when the next hook sees this death) hangs in step 7's shard write.
                os.mkfifo(fifo_7)
                os.environ[BLOCK_FIFO_ENV] = fifo_7
                os.environ[ONLY_NAME_ENV] = "step-000000007"
                result["idle_writer_pid"] = pid = ckpt.writer_pid
                os.kill(pid, signal.SIGKILL)  # idle: nothing in flight
                # So that the next hook, before step 7 is requested, sees the death.
                assert exited_within(pid, 60), f"writer {pid} outlived SIGKILL by 60 s"
        result["committed_at_end"] = late + [i.step for i in ckpt.wait(timeout_s=120)]
        result["lost"] = engine_of(ckpt).parts.dispatcher.lost_to_regroup
        result["writer_restarts"] = ckpt.writer_restarts
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    try:
        ckpt.close(timeout_s=30)
    except Exception as e:
        result["error"] = result["error"] or f"close: {type(e).__name__}: {e}"
    result["listed"] = [i.step for i in list_checkpoints(path)]
    result["attempts_left"] = sorted(n for n in os.listdir(path) if ".attempt-" in n)
    if rank == 0:  # the reference: DDP stores rank 0's buffers
        result["state_files"] = {}
        for step in sorted({4, 9, 10, 12} & set(states)):
            result["state_files"][str(step)] = os.path.join(out, f"restart-state-{step}.pt")
            torch.save(states[step], result["state_files"][str(step)])
    return result


def _outcome(ckpt: Checkpointer, path: str, error: BaseException | None, elapsed_s: float) -> dict[str, Any]:
    """What a failure scenario observed: the error, how long it took, what was listed after."""
    try:
        ckpt.close(timeout_s=10)
    except Exception:
        pass  # the error under test was already recorded
    return {
        "error_type": None if error is None else type(error).__name__,
        "error": None if error is None else str(error)[:2000],
        "elapsed_s": elapsed_s,
        "listed": [i.step for i in list_checkpoints(path)],
    }


def scenario_fsdp_tp(out: str) -> dict[str, Any]:
    """FSDP2 x TP on a 2x2 mesh: exact at W=1 and W=3 replay; then a reshard into 2-rank FSDP2 on ranks 0-1."""
    result = scenario_exact("fsdp_tp", out)
    group = dist.new_group([0, 1])  # every rank creates it; only ranks 0 and 1 are in it
    if dist.get_rank() in (0, 1):
        info = list_checkpoints(os.path.join(out, "w3-replay"))[-1]
        model, opt = build("fsdp_sub", group)
        load(info.path, model, opt, per_rank_state="skip", process_group=group)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # The whole state, gathered over the 2-rank group (full_state's collectives run on the world).
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        state = {f"model.{k}": v.detach().clone() for k, v in msd.items() if isinstance(v, torch.Tensor)}
        for fqn, st in osd["state"].items():
            state.update({f"optimizer.state.{fqn}.{k}": v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
        result["reshard_to_fsdp2"] = os.path.join(out, f"judged-fsdp2-rank{dist.get_rank()}.pt")
        torch.save(state, result["reshard_to_fsdp2"])
        result["reshard_step"] = info.step
    dist.barrier()
    return result


def replanned(kind: str, out: str) -> dict[str, Any]:
    """A layout that changes mid-run (a param group added after step 5, as a fine-tune unfreezing layers does).

    Checkpoints at steps 2, 4, 6 and 8, window 1. The writers' plan round runs at the
    first checkpoint of each layout only (writer/save_plans.py): the test reads which
    checkpoints ran one, and each checkpoint loaded back against the uninterrupted twin.
    """
    requests, steps, unfreeze_after = (2, 4, 6, 8), 8, 5
    path = os.path.join(out, f"replan-{kind}")

    def param_groups(model: nn.Module, step: int) -> list[dict[str, Any]]:
        inner = getattr(model, "module", model)  # DDP's
        groups = [{"params": list(inner.inp.parameters())}]
        if step > unfreeze_after:
            groups.append({"params": [p for n, p in inner.named_parameters() if not n.startswith("inp.")]})
        return groups

    def run(checkpointed: bool) -> tuple[dict[int, dict[str, torch.Tensor]], dict[str, Any]]:
        model, _ = build(kind)
        opt = torch.optim.AdamW(param_groups(model, 0), lr=1e-2, foreach=True)
        ckpt = Checkpointer(model, opt, path, window=1) if checkpointed else None
        sampler = Sampler(data_rank(kind))
        states: dict[int, dict[str, torch.Tensor]] = {}
        train(model, opt, sampler, unfreeze_after, ckpt=ckpt, requests=requests, states=states)
        opt.add_param_group(param_groups(model, unfreeze_after + 1)[1])
        train(model, opt, sampler, steps, ckpt=ckpt, requests=requests, states=states, start=unfreeze_after + 1)
        if ckpt is None:
            return states, {}
        infos = ckpt.wait(timeout_s=120)
        stats = ckpt.stats
        ckpt.close()
        return states, {"infos": infos, "stats": stats}

    twin, _ = run(False)
    _, run_result = run(True)
    # The reference is rank 0's twin: DDP broadcasts rank 0's buffers, the others' drift.
    box = [twin]
    dist.broadcast_object_list(box, src=0)
    twin = box[0]
    loaded_equal = {}
    for info in run_result["infos"]:
        fresh, _ = build(kind)
        fresh_opt = torch.optim.AdamW(param_groups(fresh, info.step), lr=1e-2, foreach=True)
        load(info.path, fresh, fresh_opt, per_rank_state="skip")
        got, want = full_state(fresh, fresh_opt), twin[info.step]
        differing = sorted(set(got) ^ set(want)) + [k for k in want if k in got and not torch.equal(got[k], want[k])]
        loaded_equal[str(info.step)] = differing == []
        if differing:
            loaded_equal[f"{info.step} differing"] = differing[:6]
    return {
        "versions": [i.step for i in run_result["infos"]],
        "plan_rounds": ["plan_round" in s["persist_phases_s"] for s in run_result["stats"]],
        "loaded_equal": loaded_equal,
        "state_keys": {str(step): len(twin[step]) for step in requests},
    }


def write_fails_on_a_rank(out: str, failing_rank: int) -> dict[str, Any]:
    """The first shard write of ``failing_rank``'s writer fails (fakes.FailingStore, ENOSPC) at checkpoint 2.

    Every rank raises, named, and nothing is listed; the checkpoint of step 4 then commits
    on every rank (the writers and their group survive the fault).
    """
    import fakes

    rank = dist.get_rank()
    os.environ[fakes.FAIL_AT_ENV] = "1" if rank == failing_rank else str(10**9)
    os.environ[fakes.ONLY_NAME_ENV] = "step-000000002"
    model, opt = build("plain")
    path = os.path.join(out, "write-fails")
    ckpt = Checkpointer(model, opt, path, window=1, collective_timeout_s=60.0, store_class=fakes.FailingStore)
    sampler = Sampler(rank)
    error: BaseException | None = None
    try:
        train_requesting_at_2(model, opt, sampler, ckpt, steps=2)
        ckpt.wait(timeout_s=120)
    except Exception as e:  # what we are here to see
        error = e
    listed_after_failure = [i.step for i in list_checkpoints(path)]
    later_error = None
    try:
        for _ in range(2):  # steps 3 and 4, a checkpoint at 4
            x, y = sampler.batch()
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        ckpt.request()
        ckpt.step()
        ckpt.wait(timeout_s=120)
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        later_error = f"{type(e).__name__}: {e}"
    outcome = _outcome(ckpt, path, error, 0.0)
    os.environ.pop(fakes.FAIL_AT_ENV, None)
    os.environ.pop(fakes.ONLY_NAME_ENV, None)
    return {**outcome, "listed_after_failure": listed_after_failure, "later_error": later_error}


def writer_cannot_be_made_on_a_rank(out: str, failing_rank: int) -> dict[str, Any]:
    """``failing_rank``'s writer cannot make its DCP writer (fakes.CannotMakeTheWriterStore) at checkpoints 2 and 6 of 2, 4, 6, 8.

    Checkpoint 2 is the first of its layout (a plan round), 6 reuses the plans of 4: the
    failure rides in the plan round's gather at 2 and in the write round's at 6. Every rank
    raises both times, named, and 4 and 8 commit.
    """
    import fakes

    rank = dist.get_rank()
    if rank == failing_rank:
        os.environ[fakes.CANNOT_WRITE_NAMES_ENV] = "step-000000002,step-000000006"
    model, opt = build("plain")
    path = os.path.join(out, "cannot-make-writer")
    ckpt = Checkpointer(model, opt, path, window=1, collective_timeout_s=60.0, store_class=fakes.CannotMakeTheWriterStore)
    sampler = Sampler(rank)
    errors: dict[str, str | None] = {}
    for step in range(1, 9):
        x, y = sampler.batch()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if step % 2 == 0:
            ckpt.request()
        ckpt.step()
        if step % 2 == 0:
            try:
                ckpt.wait(timeout_s=120)
                errors[str(step)] = None
            except Exception as e:  # what we are here to see
                errors[str(step)] = f"{type(e).__name__}: {e}"[:1000]
    phases = [sorted(s["persist_phases_s"]) for s in ckpt.stats]
    outcome = _outcome(ckpt, path, None, 0.0)
    os.environ.pop(fakes.CANNOT_WRITE_NAMES_ENV, None)
    return {"errors": errors, "listed": outcome["listed"], "plan_rounds": ["plan_round" in p for p in phases]}


def scenario_hsdp(out: str) -> dict[str, Any]:
    result = scenario_exact("hsdp", out)
    result["replan"] = replanned("hsdp", out)
    result["write_fails"] = write_fails_on_a_rank(out, 2)
    result["cannot_make_writer"] = writer_cannot_be_made_on_a_rank(out, 3)
    return result


SCENARIOS = {
    "ddp": scenario_ddp,
    "fsdp": scenario_fsdp,
    "hsdp": scenario_hsdp,
    "fsdp_tp": scenario_fsdp_tp,
    "netns": scenario_netns,
    "restart": lambda out: {"writer_restarted": writer_restarted(out)},
}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    write_rank_result_and_leave(os.path.join(out, f"rank{dist.get_rank()}.json"), lambda: SCENARIOS[scenario](out))


if __name__ == "__main__":
    main()
