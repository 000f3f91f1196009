"""What a first touch of memory costs here: memory the guest handed back to its host, against memory just freed.

The build VM is a Firecracker guest whose balloon device reports free pages to the
host (virtio-balloon ``VIRTIO_BALLOON_F_REPORTING``, ``page_reporting_order`` on the
kernel command line): a while after memory is freed, the host takes its backing away,
and the next touch of those pages faults in the host too. Memory freed a moment ago
is still backed, and the allocator hands it out first. So a buffer that needs more
pages than were freed recently (a fresh load target, a new checkpoint file on tmpfs,
a fresh host slot) is several times slower to fill the first time than the second,
whichever method fills it. This is the mechanism behind the bimodal loads and the long
tails of ``durable.py``'s saves on this machine, and why the library fills memory it
already holds (``direct_read.py``, the host slots) instead of fresh buffers.

Each repeat: the machine idles ``--idle-s`` seconds (the reporter runs), then
``--mib`` MiB of new anonymous memory are touched (mostly reported pages), freed, and
touched again at once (the pages just freed), then the same for a file on tmpfs.

    python benchmarks/page_reporting.py --out benchmarks/results/page-reporting
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import statistics
import tempfile
import time
from typing import Any

from measure import write_results
from stats import MIN_REPEATS, parse_repeated, spread_text

MIB = 2**20
PAGE = mmap.PAGESIZE
VIRTIO_BALLOON = 0x0005  # virtio device id
VIRTIO_BALLOON_F_REPORTING = 5  # feature bit: free page reporting


def free_page_reporting() -> str:
    """Whether this machine's balloon reports free pages to its host, in words."""
    for device in sorted(os.listdir("/sys/bus/virtio/devices")) if os.path.isdir("/sys/bus/virtio/devices") else []:
        base = os.path.join("/sys/bus/virtio/devices", device)
        try:
            with open(os.path.join(base, "device")) as f:
                kind = int(f.read().strip(), 16)
            with open(os.path.join(base, "features")) as f:
                features = f.read().strip()
        except (OSError, ValueError):
            continue
        if kind == VIRTIO_BALLOON and len(features) > VIRTIO_BALLOON_F_REPORTING:
            on = features[VIRTIO_BALLOON_F_REPORTING] == "1"
            order = ""
            try:
                with open("/proc/cmdline") as f:
                    found = re.search(r"page_reporting\.page_reporting_order=(\d+)", f.read())
                if found:
                    order = f", blocks of order {found.group(1)} ({PAGE << int(found.group(1)) >> 20} MiB)"
            except OSError:
                pass
            return f"virtio-balloon free page reporting {'on' if on else 'off'}{order}"
    return "no virtio-balloon device: free pages stay with this machine"


def _touch_anonymous_s(nbytes: int) -> float:
    """Seconds to fault in ``nbytes`` of new anonymous memory (one byte per page), which is then freed."""
    started = time.perf_counter()
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, nbytes, PAGE):
        area[offset] = 1
    elapsed = time.perf_counter() - started
    area.close()
    return elapsed


def _write_tmpfs_s(directory: str, data: bytes) -> float:
    """Seconds to write ``data`` into a new file on tmpfs (the file's pages are new memory), which is then removed."""
    path = os.path.join(directory, "page-reporting.bin")
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
    elapsed = time.perf_counter() - started
    os.remove(path)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS)
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle time before each repeat's first touch (the reporter's turn)")
    parser.add_argument("--tmpfs", default="/dev/shm")
    parser.add_argument("--out", default="benchmarks/results/page-reporting")
    args = parse_repeated(parser)
    nbytes = args.mib * MIB
    data = bytes(nbytes)  # the source, touched once here: only the destination's pages are new
    series: dict[str, list[float]] = {k: [] for k in ("anonymous, after idle", "anonymous, just freed", "tmpfs file, after idle", "tmpfs file, just freed")}
    directory = tempfile.mkdtemp(dir=args.tmpfs, prefix="page-reporting-")
    try:
        for _ in range(args.repeats):
            time.sleep(args.idle_s)  # the condition measured: memory left free this long
            series["anonymous, after idle"].append(_touch_anonymous_s(nbytes))
            series["anonymous, just freed"].append(_touch_anonymous_s(nbytes))
            time.sleep(args.idle_s)
            series["tmpfs file, after idle"].append(_write_tmpfs_s(directory, data))
            series["tmpfs file, just freed"].append(_write_tmpfs_s(directory, data))
    finally:
        os.rmdir(directory)
    reporting = free_page_reporting()
    lines = [
        f"# First touch of {args.mib} MiB: memory left free {args.idle_s:g} s, against memory freed a moment ago",
        "",
        f"Machine: {os.cpu_count()} CPUs; {reporting}.",
        "",
        f"`python benchmarks/page_reporting.py --mib {args.mib} --repeats {args.repeats} --idle-s {args.idle_s:g}`",
        "",
        "| memory | seconds: median (min / p90 / max) | GiB/s, median |",
        "|---|---|---|",
    ]
    result: dict[str, Any] = {"mib": args.mib, "idle_s": args.idle_s, "free_page_reporting": reporting, "seconds": series}
    for name, values in series.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {spread_text(values, 's')} | {nbytes / 2**30 / median:.2f} |")
    write_results(args.out, "page_reporting", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
