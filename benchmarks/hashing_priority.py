"""What the snapshot's hashing thread at the lowest priority saves: time to durable on tmpfs, the real writer both ways.

On two cores a pipelined persist has three busy threads: the trainer's copy into the slot,
the writer's write, and the writer's hashing thread (``overlapckpt/writer/snapshot_sums.py``).
At the writer's own priority (nice 10) the hashing thread took half the write's core while
the copy ran. This times two Checkpointers on the same state, one with the thread at the
lowest priority (nice 19, the default) and one at the writer's (nice 10, through
``OVERLAPCKPT_HASHING_THREAD_NICE``), beside the raw write of the same bytes, the three
alternated in every repeat, each after ``os.sync()``.

    python benchmarks/hashing_priority.py --out benchmarks/results/limits/hashing-priority
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch
from durable import _Overlapckpt, _quiet, _raw_write_s, _state_bytes
from load import build_model
from measure import machine_description, write_results
from stats import parse_repeated, spread, spread_text

from overlapckpt.writer.snapshot_sums import HASHING_THREAD_NICE_ENV

LOWEST = "overlapckpt window=1, hashing at nice 19 (the default)"
WRITERS = "overlapckpt window=1, hashing at nice 10 (the writer's)"
RAW = "raw write"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tmpfs", default="/dev/shm")
    parser.add_argument("--out", default="benchmarks/results/limits/hashing-priority")
    args = parse_repeated(parser)
    model, opt = build_model(args.mib)
    os.environ.pop(HASHING_THREAD_NICE_ENV, None)  # the default is the default's
    base = tempfile.mkdtemp(dir=args.tmpfs, prefix="hashing-priority-")
    times: dict[str, list[float]] = {LOWEST: [], WRITERS: [], RAW: []}
    try:
        # durable.py's Checkpointer (its first save, the cold one, in the constructor: not counted).
        methods = {
            LOWEST: _Overlapckpt(model, opt, os.path.join(base, "lowest"), None),
            WRITERS: _Overlapckpt(model, opt, os.path.join(base, "writers"), None, environment={HASHING_THREAD_NICE_ENV: "10"}),
        }
        for i in range(args.repeats):
            order = [LOWEST, WRITERS, RAW]
            for label in order[i % 3 :] + order[: i % 3]:  # each position in turn
                if label == RAW:
                    times[RAW].append(_quiet(_raw_write_s, _state_bytes(model), os.path.join(base, "raw")))
                else:
                    times[label].append(_quiet(methods[label].save_s))
        for method in methods.values():
            method.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    raw = spread(times[RAW])["median"]
    machine = machine_description(torch.device("cpu"))
    lines = [
        f"# The hashing thread's priority: time to durable on tmpfs ({machine['date_utc']}, {machine['cpu_count']} CPUs, "
        f"torch {machine['torch']}, {args.mib} MiB of AdamW state, commit {machine.get('commit')})",
        "",
        f"`python benchmarks/hashing_priority.py --repeats {args.repeats} --out {args.out}`",
        "",
        "| method | request→durable: median (min / p90 / max) | share of the raw write, median |",
        "|---|---|---|",
    ]
    for label, values in times.items():
        lines.append(f"| {label} | {spread_text(values)} | {100 * raw / spread(values)['median']:.0f}% |")
    result = {"machine": machine, "mib": args.mib, "times_s": times, "spreads": {k: spread(v) for k, v in times.items()}}
    write_results(args.out, "hashing-priority", result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
