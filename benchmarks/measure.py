"""Clocks, memory readings, the copy-bandwidth ceiling and the machine's description."""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import platform
import time
from collections.abc import Iterator
from typing import Any

import torch


class StepTimer:
    """Per-step times: CUDA events on the compute stream on GPU, ``perf_counter`` on CPU.

    On the GPU the host runs ahead, so a host clock would time kernel launches; an
    event per iteration boundary times what the device did, including any idle gap
    a blocking call left in its queue. ``untimed()`` leaves a gap that no step time
    spans (the harness waits for a commit, or reads /proc, there).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._segments: list[list[Any]] = [[]]

    def mark(self) -> None:
        """Call at every iteration boundary (before the first and after each iteration)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._segments[-1].append(event)
        else:
            self._segments[-1].append(time.perf_counter())

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """Between two iterations: the work inside counts in no step's time."""
        self._segments.append([])
        try:
            yield
        finally:
            self.mark()

    def step_times_s(self) -> list[float]:
        out: list[float] = []
        for marks in self._segments:
            if self.cuda and marks:
                marks[-1].synchronize()
            pairs = zip(marks, marks[1:])
            out += [a.elapsed_time(b) / 1000.0 for a, b in pairs] if self.cuda else [b - a for a, b in pairs]
        return out


def _proc_kib(path: str, field: str) -> int:
    """A "Field:  N kB" line of a /proc file (status, meminfo); 0 where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _status_kib(pid: int | str, field: str) -> int:
    return _proc_kib(f"/proc/{pid}/status", field)


def _children() -> list[int]:
    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


class HostMemory:
    """Peak resident memory of this process (VmHWM, reset per method) and of its child processes."""

    def __init__(self) -> None:
        self.start_rss_bytes = 0
        self.children_peak_bytes = 0
        self.can_reset_peak = True

    def begin(self) -> None:
        try:
            # "5" resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0).
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.can_reset_peak = False
        self.start_rss_bytes = _status_kib("self", "VmRSS") * 1024
        self.children_peak_bytes = 0

    def sample_children(self) -> None:
        """Outside the timed region: reads /proc for each child (the writer, DCP's daemon)."""
        total = sum(_status_kib(pid, "VmRSS") for pid in _children()) * 1024
        self.children_peak_bytes = max(self.children_peak_bytes, total)

    def peak_extra_bytes(self) -> int:
        return max(0, _status_kib("self", "VmHWM") * 1024 - self.start_rss_bytes)


def pinned_copy_peak_bytes_per_s(device: torch.device, nbytes: int) -> dict[str, Any]:
    """The ceiling the copies are held against: one large device-to-pinned-host copy.

    On CPU there is no device-to-host copy; a plain host memcpy of the same size is
    the proxy, and is labelled so.
    """
    nbytes = max(1 << 20, nbytes)
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        best = 0.0
        for attempt in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            if attempt:  # the first copy warms the DMA path and the page tables
                best = max(best, nbytes / (start.elapsed_time(end) / 1000.0))
        del src, dst
        torch.cuda.empty_cache()
        return {"kind": "device-to-host into pinned memory, one copy, best of 5", "nbytes": nbytes, "bytes_per_s": best}
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    best = 0.0
    for attempt in range(6):
        started = time.perf_counter()
        dst.copy_(src)
        if attempt:
            best = max(best, nbytes / (time.perf_counter() - started))
    return {"kind": "CPU proxy: host memcpy, best of 5", "nbytes": nbytes, "bytes_per_s": best}


def machine_description(device: torch.device) -> dict[str, Any]:
    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_total_kib = _proc_kib("/proc/meminfo", "MemTotal")
    out: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model,
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem_total_kib * 1024,
        "device": str(device),
        "commit": _git_commit(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return out


def _git_commit() -> str | None:
    """The source checkout's commit, so a figure can be traced to the code that made it."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_header() -> dict[str, Any]:
    """What every result starts with: the machine (CPU) and the command that ran."""
    import sys

    return {"machine": machine_description(torch.device("cpu")), "command": "python " + " ".join(sys.argv)}


def write_results(out: str, stem: str, result: dict[str, Any], report_text: str) -> None:
    """``<out>/<stem>.json`` (every figure) and ``<out>/<stem>.md`` (the report, printed too)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(report_text)
    print(report_text)  # noqa: T201 - a benchmark's report
