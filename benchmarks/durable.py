"""Time to durable, writer memory and load time: overlapckpt against dcp.async_save PROCESS and stock dcp.load.

    python benchmarks/durable.py [--mib 768] [--repeats 7] [--disk DIR] [--tmpfs DIR]
                                 [--scale-mib 205,512,1024,2048] [--writer-threads 1,2]
                                 [--out benchmarks/results/durable]

One process holds AdamW state of about ``--mib`` MiB (8 linear layers, parameters and
both moments); between two checkpoints an optimizer step changes all of it. On each
storage (a directory on the local disk, and one on tmpfs), with fsync on:

- overlapckpt, window 1: ``request()`` to the commit, from one ``Checkpointer`` kept
  open, as in a job (its writer process and host slot exist already);
- the same with ``OVERLAPCKPT_PIPELINED_PERSIST=0``: the request sent once every copy
  landed, so the write follows the copy (what the pipelined persist saves);
- ``dcp.async_save(..., async_checkpointer_type=PROCESS)``: the call to its future's
  result, DCP's checkpoint process kept between saves as DCP keeps it;
- the same with ``DefaultStager`` (shared memory; asynchronous staging needs CUDA):
  the configuration TorchTitan calls its fastest, where this torch has it;
- ``torch_checkpointing``'s asynchronous saver, TorchTitan 0.3's second checkpoint
  manager, where it is installed (``benchmarks/peer_torch_checkpointing.py``);
- the raw figure: one file of the same bytes written and fsynced.

They alternate per repeat. The first checkpoint of each method is reported apart
("cold": it starts the helper process and allocates its memory). Reported: the median
of the later ones with min / p90 / max (``stats.py``: at least 7 repeats), the share of
the raw write's bandwidth, the writer's and DCP's
process peak RSS (``VmHWM``), and the training process's RSS added by the Checkpointer.

Then, on disk: loads of the same checkpoint with a warm page cache, alternated:
``load(verify=True)``, ``load(verify=False)`` and stock ``dcp.load`` into the same
kind of objects; and the scale run: time to durable and writer RSS from
``--scale-mib``'s smallest to largest state, plotted in ``scale.svg``.
Writes ``durable.json``, ``durable.md`` and ``scale.svg`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from harness import init_single_rank_group
from load import build_model
from measure import machine_description, write_results
from stats import MIN_REPEATS, spread, spread_text
from torch import nn

MIB = 2**20
T = TypeVar("T")


# overlapckpt with OVERLAPCKPT_PIPELINED_PERSIST=0: each snapshot sent once all its copies landed.
SERIAL_LABEL = "overlapckpt window=1, copy then write (not pipelined)"
# The raw write into a new file each repeat, the one before removed: a checkpoint's own pattern. The raw
# write above rewrites one file, whose pages (or blocks) it freed a moment before (docs/benchmarks.md,
# "Why the tails on this VM"). Shown beside it; the shares stay against the raw write.
RAW_NEW_FILE_LABEL = "raw write, a new file each time"


def _model(mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    # The moments exist; the gradients stay, so each later step changes every byte.
    return build_model(mib)


def _state_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() * 3 for p in model.parameters())


def _status_mib(pid: int | str, field: str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class _Overlapckpt:
    """One Checkpointer for the whole run, as a training job keeps it."""

    def __init__(
        self,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        root: str,
        writer_threads: int | None,
        signing_key: str | None = None,
        pipelined: bool = True,
        environment: dict[str, str] | None = None,
    ) -> None:
        """``environment``: variables set while the Checkpointer is built (its writer reads them when spawned then)."""
        from overlapckpt import Checkpointer
        from overlapckpt.train.lifecycle.pipelined_persist import PIPELINED_PERSIST_ENV

        self.opt = opt
        rss_before = _status_mib("self", "VmRSS")
        # Read when the Checkpointer is built: "0" sends each snapshot once its copies landed (the write follows the copy).
        settings = {PIPELINED_PERSIST_ENV: "1" if pipelined else "0", **(environment or {})}
        previous = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)
        try:
            self.ckpt = Checkpointer(model, opt, root, lease=False, keep=2, writer_threads=writer_threads, signing_key=signing_key)
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self.splits: list[dict[str, float]] = []  # per save: where its time to durable went
        self.cold_s = self.save_s()
        self.trainer_extra_rss_mib = _status_mib("self", "VmRSS") - rss_before  # the host slot, mostly

    def save_s(self) -> float:
        self.opt.step()
        self.ckpt.step()  # the boundary of that step
        started = time.perf_counter()
        self.ckpt.request()
        self.ckpt.step()
        self.ckpt.wait(timeout_s=900)
        elapsed = time.perf_counter() - started
        last = self.ckpt.stats[-1]
        split = {"copy (trainer: state into the host slot)": last["copy_s"]}
        split.update({f"writer: {k}": v for k, v in last["persist_phases_s"].items() if not k.startswith("write.")})
        parts = {k: v for k, v in last["persist_phases_s"].items() if k.startswith("write.")}
        split.update({f"writer: {k}": v for k, v in parts.items()})
        if "write" in last["persist_phases_s"]:
            split["writer: write.the rest (serialization, DCP's planning)"] = last["persist_phases_s"]["write"] - sum(parts.values())
        laps = sum(v for k, v in last["persist_phases_s"].items() if not k.startswith("write."))
        split["the rest (request to writer, answer, hooks)"] = elapsed - last["copy_s"] - laps
        split["request→durable"] = elapsed
        self.splits.append(split)
        return elapsed

    def close(self) -> float:
        peak = _status_mib(self.ckpt.writer_pid, "VmHWM")
        self.ckpt.close()
        return peak


def _async_checkpointer_type() -> Any:
    import torch.distributed.checkpoint as dcp

    kind = getattr(dcp, "AsyncCheckpointerType", None)
    if kind is None:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType as kind  # type: ignore[no-redef]
    return kind


def _dcp_save_s(model: nn.Module, opt: torch.optim.Optimizer, path: str) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt.step()
    msd, osd = get_state_dict(model, opt)
    started = time.perf_counter()
    future = dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, async_checkpointer_type=_async_checkpointer_type().PROCESS)
    future.result()
    return time.perf_counter() - started


class _DcpWithStager:
    """``dcp.async_save`` PROCESS with ``DefaultStager`` in shared memory (pinned and asynchronous staging need CUDA)."""

    label = "dcp.async_save PROCESS + DefaultStager"

    def __init__(self) -> None:
        from methods import _stager_closes_itself
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.options = StagingOptions(use_pinned_memory=False, use_shared_memory=True, use_async_staging=False, use_non_blocking_copy=False)
        self.per_save = _stager_closes_itself()  # torch 2.11's stager closes itself after one save
        self.stager: Any = DefaultStager(self.options)

    @staticmethod
    def available() -> bool:
        import inspect

        import torch.distributed.checkpoint as dcp

        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError:
            return False
        return "async_stager" in inspect.signature(dcp.async_save).parameters

    def save_s(self, model: nn.Module, opt: torch.optim.Optimizer, path: str) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager
        from torch.distributed.checkpoint.state_dict import get_state_dict

        opt.step()
        msd, osd = get_state_dict(model, opt)
        if self.per_save:
            self.stager = DefaultStager(self.options)
        started = time.perf_counter()
        response = dcp.async_save(
            {"model": msd, "optimizer": osd}, checkpoint_id=path, async_checkpointer_type=_async_checkpointer_type().PROCESS,
            async_stager=self.stager,
        )
        upload = getattr(response, "upload_completion", response)
        upload.result()
        return time.perf_counter() - started

    def close(self) -> None:
        self.stager.close()


def _dcp_daemon_pid() -> int | None:
    """DCP's checkpoint process (torch keeps one per training process), where this torch names it."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return None
    process = getattr(getattr(executor, "_CHECKPOINT_PROCESS", None), "_save_process", None)
    return getattr(process, "pid", None)


def _raw_write_s(nbytes: int, path: str) -> float:
    data = torch.ones(nbytes, dtype=torch.uint8).numpy()  # touched: the source is in memory, as the state is
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def _quiet(timed: Callable[..., T], *args: Any) -> T:
    """``timed(*args)`` after ``os.sync()``, outside the timing: no method pays for another's pending writes.

    On this VM's ext4 (mounted with ``discard``) the blocks an earlier method's deletion
    freed are discarded at the next journal commit, and the pages a peer left unsynced are
    written back by the kernel's flusher; either landed in whichever save came next. A
    training job's checkpoints are minutes apart, with the disk quiet at each one's start.
    """
    os.sync()
    return timed(*args)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _storage_run(model: nn.Module, opt: torch.optim.Optimizer, base: str, repeats: int, writer_threads: int | None) -> dict[str, Any]:
    """Cold and steady times to durable of every method on one storage, alternated."""
    nbytes = _state_bytes(model)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    ours = _Overlapckpt(model, opt, os.path.join(base, "ours"), writer_threads)
    # The same Checkpointer with its write after the copy, not beside it: what the pipelined persist saves.
    serial = _Overlapckpt(model, opt, os.path.join(base, "serial"), writer_threads, pipelined=False)
    staged = _DcpWithStager() if _DcpWithStager.available() else None
    titan2 = _torch_checkpointing(os.path.join(base, "tc"))
    steady: dict[str, list[float]] = {
        "overlapckpt window=1": [], SERIAL_LABEL: [], "dcp.async_save PROCESS": [], "raw write": [], RAW_NEW_FILE_LABEL: []
    }
    if staged is not None:
        steady[staged.label] = []
    if titan2 is not None:
        steady[titan2.label] = []
        steady[titan2.synced_label] = []
    dcp_cold = None
    dcp_was_running = _dcp_daemon_pid() is not None  # DCP keeps its process: only the run's first save starts it
    try:
        for i in range(repeats + 1):
            dcp_s = _quiet(_dcp_save_s, model, opt, os.path.join(base, f"dcp-{i}"))
            shutil.rmtree(os.path.join(base, f"dcp-{i - 1}"), ignore_errors=True)  # keep one, as ours keeps two
            staged_s = None if staged is None else _quiet(staged.save_s, model, opt, os.path.join(base, f"staged-{i}"))
            shutil.rmtree(os.path.join(base, f"staged-{i - 1}"), ignore_errors=True)
            titan2_s, synced_s = (None, None) if titan2 is None else _quiet(titan2.save_and_sync_s, model, opt, i)
            raw_s = _quiet(_raw_write_s, nbytes, os.path.join(base, "raw"))
            if i == 0:
                dcp_cold = None if dcp_was_running else dcp_s
                continue
            # The two of ours alternate which goes first: the disk's state after the raw write (its old
            # blocks freed) and after the other's retention differs, and would favour one position.
            pair = [("overlapckpt window=1", ours), (SERIAL_LABEL, serial)]
            for label, method in pair if i % 2 else pair[::-1]:
                steady[label].append(_quiet(method.save_s))
            steady["dcp.async_save PROCESS"].append(dcp_s)
            if staged is not None and staged_s is not None:
                steady[staged.label].append(staged_s)
            if titan2 is not None and titan2_s is not None and synced_s is not None:
                steady[titan2.label].append(titan2_s)
                steady[titan2.synced_label].append(synced_s)
            steady["raw write"].append(raw_s)
            steady[RAW_NEW_FILE_LABEL].append(_quiet(_raw_write_s, nbytes, os.path.join(base, f"raw-{i}")))
            if os.path.exists(os.path.join(base, f"raw-{i - 1}")):
                os.remove(os.path.join(base, f"raw-{i - 1}"))
    finally:
        writer_peak = ours.close()
        serial.close()
        if staged is not None:
            staged.close()
        if titan2 is not None:
            titan2.close()
    return {
        "state_bytes": nbytes,
        "writer_threads": writer_threads,
        "steady_s": steady,
        "cold_s": {"overlapckpt window=1": ours.cold_s, "dcp.async_save PROCESS": dcp_cold},
        "writer_peak_rss_mib": writer_peak,
        "split_s": ours.splits[1:],  # the steady saves' (the first is the cold one)
        "trainer_extra_rss_mib": ours.trainer_extra_rss_mib,
        "dcp_daemon_peak_rss_mib": _status_mib(_dcp_daemon_pid() or "none", "VmHWM"),
    }


def _torch_checkpointing(directory: str) -> Any:
    """torch_checkpointing's asynchronous saver where it can run here, else None (the report says why)."""
    try:
        import peer_torch_checkpointing as peer
    except ImportError:
        return None
    if peer.available() is not None:
        return None
    return peer.TorchCheckpointingAsync(directory)


def _load_run(root: str, mib: int, repeats: int) -> dict[str, list[float]]:
    """Loads as ``benchmarks/load.py`` measures them: fresh objects per load, methods rotated."""
    from load import measure

    from overlapckpt import list_checkpoints

    return {name: figures["s"] for name, figures in measure(list_checkpoints(root)[-1].path, mib, repeats).items()}


def _replay_run(model: nn.Module, opt: torch.optim.Optimizer, base: str, window: int) -> dict[str, Any]:
    """Time to durable at ``window`` with replay against window 1, on the same state: replay's share of it."""
    from overlapckpt import Checkpointer

    out: dict[str, Any] = {"window": window}
    for name, settings in (("window=1", {"window": 1}), (f"window={window} replay", {"window": window, "consistency": "replay"})):
        shutil.rmtree(base, ignore_errors=True)
        with Checkpointer(model, opt, base, lease=False, **settings) as ckpt:
            for _ in range(2):  # the first is cold (the writer starts, the slots fill)
                opt.step()
                ckpt.request()
                ckpt.step()
                for _ in range(window - 1):
                    opt.step()
                    ckpt.step()
                ckpt.wait(timeout_s=900)
            last = ckpt.stats[-1]
        out[name] = {"persist_s": last["persist_s"], "time_to_commit_s": last["time_to_commit_s"]}
    shutil.rmtree(base, ignore_errors=True)
    replay_s = out[f"window={window} replay"]["persist_s"] - out["window=1"]["persist_s"]
    # Copy group j (of window groups, equal in size) is rolled forward window-1-j steps.
    state_gb = _state_bytes(model) / 1e9
    rolled_gb = state_gb * sum(window - 1 - j for j in range(window)) / window
    out["replay_s"] = replay_s
    out["replay_gb_per_s"] = rolled_gb / replay_s if replay_s > 0 else float("nan")
    out["replay_share_of_time_to_durable"] = replay_s / out[f"window={window} replay"]["time_to_commit_s"]
    return out


def _moto_server() -> tuple[Any, str]:
    """A moto S3 server in a process of its own (its work must not share this process's GIL), with a bucket."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket="ckpts")
            return server, url
        except Exception:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                raise
            time.sleep(0.2)  # the server is still starting: no event to wait on


def _s3_run(mib: int, repeats: int, threads: list[int]) -> dict[str, Any]:
    """Time to durable on S3 (moto on 127.0.0.1) through s3fs: overlapckpt against DCP's FsspecWriter, by thread count."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from overlapckpt import Checkpointer
    from overlapckpt.format.storage import fsspec_dcp_classes

    server, url = _moto_server()
    options = {"key": "testing", "secret": "testing", "endpoint_url": url, "client_kwargs": {"region_name": "us-east-1"}}
    writer_cls, _ = fsspec_dcp_classes()
    model, opt = _model(mib)
    out: dict[str, Any] = {"state_bytes": _state_bytes(model), "endpoint": "moto server, 127.0.0.1", "by_threads": {}}
    try:
        for n in threads:
            ours: list[float] = []
            with Checkpointer(model, opt, f"s3://ckpts/ours-{n}", storage_options=options, lease=False, keep=1, writer_threads=n) as ckpt:
                for i in range(repeats + 1):
                    opt.step()
                    ckpt.step()
                    started = time.perf_counter()
                    ckpt.request()
                    ckpt.step()
                    ckpt.wait(timeout_s=900)
                    if i:
                        ours.append(time.perf_counter() - started)  # the first starts the writer
            theirs: list[float] = []
            for i in range(repeats + 1):
                opt.step()
                msd, osd = get_state_dict(model, opt)
                started = time.perf_counter()
                writer = writer_cls(f"s3://ckpts/dcp-{n}-{i}", thread_count=n, **options)
                dcp.async_save({"model": msd, "optimizer": osd}, storage_writer=writer,
                               async_checkpointer_type=_async_checkpointer_type().PROCESS).result()
                if i:
                    theirs.append(time.perf_counter() - started)
            out["by_threads"][str(n)] = {"overlapckpt window=1": ours, "dcp.async_save PROCESS + FsspecWriter": theirs}
    finally:
        server.kill()
        server.wait()
    return out


def _svg_plot(title: str, ylabel: str, series: dict[str, list[tuple[float, float]]]) -> str:
    """A line chart of ``series`` (name -> [(GiB of state, value)]), as standalone SVG."""
    width, height, left, bottom, top, right = 560, 320, 60, 40, 30, 170
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x_max, y_max = max(xs) * 1.05, max(ys) * 1.1
    plot_w, plot_h = width - left - right, height - top - bottom

    def at(x: float, y: float) -> tuple[float, float]:
        return left + x / x_max * plot_w, top + plot_h - y / y_max * plot_h

    colours = ["#d62728", "#1f77b4", "#7f7f7f", "#2ca02c"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
        f'<text x="{left}" y="18" font-size="13">{title}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
        f'<text x="{left + plot_w / 2}" y="{height - 6}" text-anchor="middle">state (GiB)</text>',
        f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" text-anchor="middle">{ylabel}</text>',
    ]
    for i in range(5):
        x, y = x_max * i / 4, y_max * i / 4
        px, _ = at(x, 0)
        _, py = at(0, y)
        parts.append(f'<text x="{px}" y="{top + plot_h + 14}" text-anchor="middle">{x:.2f}</text>')
        parts.append(f'<text x="{left - 4}" y="{py + 4}" text-anchor="end">{y:.1f}</text>')
    for n, (name, points) in enumerate(series.items()):
        colour = colours[n % len(colours)]
        path = " ".join(f"{'M' if i == 0 else 'L'}{at(x, y)[0]:.1f},{at(x, y)[1]:.1f}" for i, (x, y) in enumerate(sorted(points)))
        parts.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            cx, cy = at(x, y)
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="{colour}"/>')
        parts.append(f'<text x="{left + plot_w + 10}" y="{top + 14 + 16 * n}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _report(result: dict[str, Any]) -> str:
    machine, lines = result["machine"], []
    lines.append(
        f"# Time to durable ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"{result['mib']} MiB of AdamW state, commit {machine.get('commit')})"
    )
    lines += ["", f"`{result.get('command', '')}`"]
    if "quiet_before_each" in result:
        lines += ["", f"Before each timed save: {result['quiet_before_each']}, outside the timing (`_quiet`)."]
    for storage, run in result["storages"].items():
        raw = _median(run["steady_s"]["raw write"])
        lines += ["", f"## {storage} ({run['dir']}), writer threads {run['writer_threads'] or 'default'}", ""]
        lines += [
            "| method | request→durable: median (min / p90 / max) | share of raw bandwidth, median | first checkpoint (cold) |",
            "|---|---|---|---|",
        ]
        for name, ts in run["steady_s"].items():
            cold = run["cold_s"].get(name)
            cold_text = "–" if cold is None else f"{cold:.2f} s"
            lines.append(f"| {name} | {spread_text(ts)} | {raw / _median(ts):.0%} | {cold_text} |")
        ours = _median(run["steady_s"]["overlapckpt window=1"])
        peers = {k: _median(v) for k, v in run["steady_s"].items() if k not in ("overlapckpt window=1", SERIAL_LABEL, "raw write", RAW_NEW_FILE_LABEL) and v}
        strongest = min(peers, key=lambda k: peers[k])
        ratios = ", ".join(f"{ours / v:.2f}× {k}" for k, v in peers.items())
        # torch_checkpointing calls no fsync: its own figure is the time to the page cache.
        from peer_torch_checkpointing import TorchCheckpointingAsync

        durable_peers = {k: v for k, v in peers.items() if k != TorchCheckpointingAsync.label}
        strongest_durable = min(durable_peers, key=lambda k: durable_peers[k]) if durable_peers else strongest
        state_mib = run["state_bytes"] / MIB
        lines += [
            "",
            f"overlapckpt's median against each peer's: {ratios}; against the strongest ({strongest}): {ours / peers[strongest]:.2f}× "
            f"(goal ≤ 0.5×); against the strongest whose bytes are on the storage when it reports ({strongest_durable}): "
            f"{ours / peers[strongest_durable]:.2f}×. Share of the raw write's bandwidth: {raw / ours:.0%} (goal ≥ 50%). Peak RSS: overlapckpt's writer {run['writer_peak_rss_mib']:.0f} MiB "
            f"({run['writer_peak_rss_mib'] / state_mib:.2f}× the state; the goal 1.2× + 512 MiB is "
            f"{1.2 * state_mib + 512:.0f} MiB), DCP's checkpoint process {run['dcp_daemon_peak_rss_mib']:.0f} MiB; "
            f"the training process gained {run['trainer_extra_rss_mib']:.0f} MiB with the Checkpointer (its host slot).",
        ]
        splits = run.get("split_s") or []
        if splits:
            lines += [
                "",
                "Where overlapckpt's time to durable went (median of the steady saves; `write.*` are parts of the writer's "
                "write, summed over its threads; `Checkpointer.stats`' `persist_phases_s`):",
                "",
                "| phase | seconds, median | share |",
                "|---|---|---|",
            ]
            total = _median([sp["request→durable"] for sp in splits])
            for phase in splits[0]:
                value = _median([sp.get(phase, 0.0) for sp in splits])
                lines.append(f"| {phase} | {value:.3f} | {value / total:.0%} |")
    for threads, figures in result.get("writer_threads_sweep", {}).items():
        lines.append(f"\nwriter_threads={threads}: " + ", ".join(f"{k} {v:.2f} s" for k, v in figures.items()))
    loads = result["loads_s"]
    lines += [
        "", "## Loads (page cache warm, local disk, fresh objects per load: benchmarks/load.py)", "",
        "| load | median (min / p90 / max) | × stock dcp.load, median | × stock, p90 |", "|---|---|---|---|",
    ]
    stock = spread(loads["stock dcp.load"])
    for name, ts in loads.items():
        s = spread(ts)
        lines.append(f"| {name} | {spread_text(ts)} | {s['median'] / stock['median']:.2f}× | {s['p90'] / stock['p90']:.2f}× |")
    lines.append(
        f"\nThe cost of verification: {_median(loads['load(verify=True)']) - _median(loads['load(verify=False)']):+.2f} s "
        "(verify=True minus verify=False)."
    )
    replay = result.get("replay")
    if replay:
        w = replay["window"]
        lines += [
            "",
            f"## Replay at window {w} (local disk, the optimizer's own CPU kernel: AdamW's default on CPU)",
            "",
            f"Writer time: window 1 {replay['window=1']['persist_s']:.2f} s, window {w} replay {replay[f'window={w} replay']['persist_s']:.2f} s; "
            f"replay took {replay['replay_s']:.2f} s, {replay['replay_share_of_time_to_durable']:.0%} of the {replay[f'window={w} replay']['time_to_commit_s']:.2f} s "
            f"to durable, rolling state forward at {replay['replay_gb_per_s']:.2f} GB/s (state x replayed steps / time). "
            "The fused kernel's figures are in benchmarks/results/replay/.",
        ]
    s3 = result.get("s3")
    if s3:
        lines += [
            "",
            f"## S3 through s3fs ({s3['endpoint']}, {s3['state_bytes'] / MIB:.0f} MiB of state; moto is the limit here, reported only)",
            "",
            "| threads | overlapckpt window=1 | dcp.async_save PROCESS + FsspecWriter |",
            "|---|---|---|",
        ]
        for n, figures in s3["by_threads"].items():
            a, b = figures["overlapckpt window=1"], figures["dcp.async_save PROCESS + FsspecWriter"]
            lines.append(f"| {n} | {_median(a):.2f} s ({min(a):.2f}–{max(a):.2f}) | {_median(b):.2f} s ({min(b):.2f}–{max(b):.2f}) |")
    lines += ["", "## Scale (local disk, steady state)", "", "| state | overlapckpt | dcp.async_save PROCESS | raw write | writer peak RSS |", "|---|---|---|---|---|"]
    for row in result["scale"]:
        lines.append(
            f"| {row['state_bytes'] / 2**30:.2f} GiB | {row['overlapckpt_s']:.2f} s | {row['dcp_s']:.2f} s | {row['raw_s']:.2f} s | "
            f"{row['writer_peak_rss_mib']:.0f} MiB ({row['writer_peak_rss_mib'] * MIB / row['state_bytes']:.2f}×) |"
        )
    lines.append("\n![time to durable and writer RSS by state size](scale.svg)")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--disk", default=None, help="a directory on the local disk (default: the system's temporary directory)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="a directory on tmpfs ('' skips it)")
    parser.add_argument("--scale-mib", default="205,512,1024,2048", help="state sizes of the scale run ('' skips it)")
    parser.add_argument("--writer-threads", default="", help="also time overlapckpt on disk at each of these writer_threads")
    parser.add_argument("--s3-mib", type=int, default=256, help="state for the S3 run on a local moto server (0 skips it)")
    parser.add_argument("--s3-threads", default="1,4", help="writer threads (ours) and thread_count (FsspecWriter) for S3")
    parser.add_argument("--replay-window", type=int, default=8, help="replay's share of time to durable at this window (1 skips it)")
    parser.add_argument("--out", default="benchmarks/results/durable")
    args = parser.parse_args()
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats {args.repeats} is below {MIN_REPEATS}: a spread needs at least {MIN_REPEATS} repeats")
    torch.set_num_threads(1)  # the trainer's thread: the writer and DCP's process get the other core

    init_single_rank_group()  # DCP's PROCESS checkpointer needs one even for one rank; overlapckpt then sees one rank
    model, opt = _model(args.mib)
    disk = tempfile.mkdtemp(dir=args.disk, prefix="durable-")
    storages = {"local disk": disk}
    if args.tmpfs:
        storages["tmpfs"] = tempfile.mkdtemp(dir=args.tmpfs, prefix="durable-")
    import sys

    result: dict[str, Any] = {
        "machine": machine_description(torch.device("cpu")), "mib": args.mib, "storages": {}, "command": "python " + " ".join(sys.argv),
        "quiet_before_each": "os.sync()",
    }
    try:
        for storage, base in storages.items():
            run = _storage_run(model, opt, os.path.join(base, "run"), args.repeats, None)
            result["storages"][storage] = {"dir": base, **run}
        result["loads_s"] = _load_run(os.path.join(disk, "run", "ours"), args.mib, args.repeats)
        if args.s3_mib:
            result["s3"] = _s3_run(args.s3_mib, 2, _ints(args.s3_threads))
        if args.replay_window > 1:
            result["replay"] = _replay_run(model, opt, os.path.join(disk, "replay"), args.replay_window)
        if args.writer_threads:
            result["writer_threads_sweep"] = {}
            for threads in _ints(args.writer_threads):
                for storage, base in storages.items():
                    run = _storage_run(model, opt, os.path.join(base, "run"), args.repeats, threads)
                    result["writer_threads_sweep"][f"{threads} ({storage})"] = {
                        name: _median(ts) for name, ts in run["steady_s"].items()
                    }
        del model, opt
        result["scale"] = []
        for mib in _ints(args.scale_mib):
            model, opt = _model(mib)
            run = _storage_run(model, opt, os.path.join(disk, "run"), 2, None)
            result["scale"].append(
                {
                    "state_bytes": run["state_bytes"],
                    "overlapckpt_s": _median(run["steady_s"]["overlapckpt window=1"]),
                    "dcp_s": _median(run["steady_s"]["dcp.async_save PROCESS"]),
                    "raw_s": _median(run["steady_s"]["raw write"]),
                    "writer_peak_rss_mib": run["writer_peak_rss_mib"],
                }
            )
            del model, opt
    finally:
        for base in storages.values():
            shutil.rmtree(base, ignore_errors=True)
    report = _report(result)
    write_results(args.out, "durable", result, report)
    if result["scale"]:
        gib = [row["state_bytes"] / 2**30 for row in result["scale"]]
        times = _svg_plot(
            "Time to durable (local disk, steady state)",
            "seconds",
            {
                "overlapckpt W=1": list(zip(gib, [r["overlapckpt_s"] for r in result["scale"]])),
                "dcp.async_save PROCESS": list(zip(gib, [r["dcp_s"] for r in result["scale"]])),
                "raw write": list(zip(gib, [r["raw_s"] for r in result["scale"]])),
            },
        )
        rss = _svg_plot("Writer peak RSS", "GiB", {"overlapckpt writer": list(zip(gib, [r["writer_peak_rss_mib"] / 1024 for r in result["scale"]])), "state": list(zip(gib, gib))})
        with open(os.path.join(args.out, "scale.svg"), "w") as f:
            f.write(times)
        with open(os.path.join(args.out, "scale-rss.svg"), "w") as f:
            f.write(rss)


if __name__ == "__main__":
    main()
