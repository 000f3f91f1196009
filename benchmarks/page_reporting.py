"""What a first touch of memory costs here: memory the guest handed back to its host, against memory just freed.

The build VM is a Firecracker guest whose balloon device reports free pages to the
host (virtio-balloon ``VIRTIO_BALLOON_F_REPORTING``, ``page_reporting_order`` on the
kernel command line): some time after memory is freed, the host takes its backing
away, and the next touch of those pages faults in the host too. Memory freed a moment
ago is still backed, and the allocator hands it out first. So a buffer that needs more
pages than were freed recently (a fresh load target, a new checkpoint file on tmpfs, a
fresh host slot) is several times slower to fill than the same buffer filled again,
whichever method fills it. This is the mechanism behind the bimodal loads and the long
tails of ``durable.py``'s saves on this machine, and why the library fills memory it
already holds (``direct_read.py``, the host slots) instead of fresh buffers.

A diagnostic, not a figure: ``--chunks`` files of ``--mib`` MiB are written to tmpfs and
kept (the first land on pages freed recently, the later ones on pages free for long,
which the host has taken back), then removed and written again at once (every page just
freed). Each file's time is printed, in order.

    python benchmarks/page_reporting.py --out benchmarks/results/page-reporting
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import tempfile
import time

from measure import write_results

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


def _write_s(path: str, data: bytes) -> float:
    """Seconds to write ``data`` into a new file (on tmpfs, the file's pages are new memory)."""
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
    return time.perf_counter() - started


def _round(directory: str, data: bytes, chunks: int) -> list[float]:
    """Write ``chunks`` files, keeping them all; then remove them. Each file's seconds."""
    paths = [os.path.join(directory, f"chunk-{i}.bin") for i in range(chunks)]
    try:
        return [_write_s(path, data) for path in paths]
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--chunks", type=int, default=6, help="files kept at once (their total should exceed what was freed lately)")
    parser.add_argument("--tmpfs", default="/dev/shm")
    parser.add_argument("--out", default="benchmarks/results/page-reporting")
    args = parser.parse_args()
    data = bytes(args.mib * MIB)  # the source, touched here once: only the files' pages are new
    directory = tempfile.mkdtemp(dir=args.tmpfs, prefix="page-reporting-")
    try:
        first = _round(directory, data, args.chunks)
        again = _round(directory, data, args.chunks)
    finally:
        os.rmdir(directory)
    reporting = free_page_reporting()
    lines = [
        f"# {args.chunks} files of {args.mib} MiB written to tmpfs and kept, then removed and written again",
        "",
        f"Machine: {os.cpu_count()} CPUs; {reporting}.",
        "",
        f"`python benchmarks/page_reporting.py --mib {args.mib} --chunks {args.chunks}` (a diagnostic: one round each)",
        "",
        "| file | first round, s | again at once, s |",
        "|---|---|---|",
    ]
    lines += [f"| {i + 1} | {a:.2f} | {b:.2f} |" for i, (a, b) in enumerate(zip(first, again))]
    write_results(args.out, "page_reporting", {"mib": args.mib, "free_page_reporting": reporting, "first_s": first, "again_s": again}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
