"""Time to durable with a signing key against without: the cost of the shards' MACs (``format/blob_macs.py``).

    python benchmarks/signing.py [--mib 768] [--repeats 9] [--disk DIR] [--tmpfs DIR] [--out benchmarks/results/signing]

One process holds AdamW state of about ``--mib`` MiB, as in ``durable.py``. On each storage
(the local disk, tmpfs), two ``Checkpointer``s are kept open on two roots, one with a
signing key and one without, and their saves alternate (``request()`` to the commit, fsync
on), and which goes first alternates per repeat. With the key, every blob is also MACed on its way to storage (AES-256-GMAC where the
``cryptography`` package is installed, else HMAC-SHA256: the MAC is named in the report),
and the manifest is signed. The first save of each is reported apart (cold). Reported:
min / median / p90 / max of each, their medians' ratio (goal: at most 1.10), and the
writer's ``write.checksums`` phase, which holds the CRCs and, with a key, the MACs.
On the 2-core build VM the saves themselves vary 0.4 to 2.3 s, whatever the key: the
balloon takes back freed pages and a save's first touch of them faults in the host
(``benchmarks/results/page-reporting/``). The MACs' own time on the path is the stable
figure; the ratios are given as measured. Writes ``signing.json`` and ``signing.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from durable import _model, _Overlapckpt, _state_bytes
from measure import run_header, write_results
from stats import MIN_REPEATS, spread, spread_text

KEY = "benchmark signing key, 32 bytes!"
GOAL_RATIO = 1.10


def _wait_for_purge(root: str, timeout_s: float = 120.0) -> None:
    from overlapckpt.format.storage import RETIRED_PREFIX

    deadline = time.monotonic() + timeout_s
    while any(name.startswith(RETIRED_PREFIX) for name in os.listdir(root)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{root}: retired checkpoints still there after {timeout_s} s")
        time.sleep(0.01)  # a benchmark's poll of the writer's deletion, which has no completion to wait on


def _storage_run(directory: str, mib: int, repeats: int) -> dict[str, Any]:
    model, opt = _model(mib)
    scratch = tempfile.mkdtemp(prefix="signing-", dir=directory)
    try:
        methods = {
            "without a key": _Overlapckpt(model, opt, os.path.join(scratch, "plain"), None),
            "with a key": _Overlapckpt(model, opt, os.path.join(scratch, "signed"), None, signing_key=KEY),
        }
        times: dict[str, list[float]] = {label: [] for label in methods}
        macs: dict[str, list[float]] = {label: [] for label in methods}
        roots = {label: os.path.join(scratch, name) for label, name in (("without a key", "plain"), ("with a key", "signed"))}
        for repeat in range(repeats):
            # Which goes first alternates: the second of a pair lands on pages the first's retention
            # freed a moment ago, which the balloon has not taken back yet (fast); the first on older ones.
            order = list(methods.items()) if repeat % 2 == 0 else list(reversed(methods.items()))
            for label, method in order:
                times[label].append(method.save_s())
                # The writer deletes what retention retired after answering; the other's next save
                # must not share the machine with that deletion (it made saves vary 0.4 to 2.4 s).
                _wait_for_purge(roots[label])
                macs[label].append(method.splits[-1].get("writer: write.checksums", float("nan")))
        cold = {label: method.cold_s for label, method in methods.items()}
        # Each phase's median over the steady saves (the first, cold, save's split is left out).
        phases = {
            label: {name: statistics.median(split[name] for split in method.splits[1:] if name in split) for name in method.splits[-1]}
            for label, method in methods.items()
        }
        for method in methods.values():
            method.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratio = statistics.median(times["with a key"]) / statistics.median(times["without a key"])
    # The MACs' own time, paired per repeat: the same save's checksums phase with a key less without.
    mac_cost = [signed - plain for signed, plain in zip(macs["with a key"], macs["without a key"])]
    return {
        "directory": directory,
        "state_bytes": _state_bytes(model),
        "request_to_durable_s": {label: spread(values) for label, values in times.items()},
        "samples_s": times,
        "checksums_phase_s": {label: spread(values) for label, values in macs.items()},
        "samples_checksums_s": macs,
        "cold_s": cold,
        "phases_median_s": phases,
        "median_ratio": ratio,
        "min_ratio": min(times["with a key"]) / min(times["without a key"]),
        # Each repeat's two saves ran back to back: their ratio shares the machine's state of the moment.
        "paired_ratio": spread([signed / plain for signed, plain in zip(times["with a key"], times["without a key"])]),
        "mac_cost_s": spread(mac_cost),
        "mac_cost_share_of_median": statistics.median(mac_cost) / statistics.median(times["without a key"]),
        "goal_ratio": GOAL_RATIO,
        "meets_goal": ratio <= GOAL_RATIO,
    }


def mac_cost_values(run: dict[str, Any]) -> list[float]:
    return [s - p for s, p in zip(run["samples_checksums_s"]["with a key"], run["samples_checksums_s"]["without a key"])]


def _report(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        f"# Time to durable with a signing key ({machine['date_utc']}, {machine['cpu_count']} CPUs, torch {machine['torch']}, "
        f"{result['mib']} MiB of AdamW state, commit {result.get('commit') or '?'})",
        "",
        f"`{result['command']}`",
        "",
        f"Blob MAC: `{result['mac_algorithm']}`. Alternated per repeat; the first save of each is apart (cold).",
        "",
    ]
    for storage, run in result["storages"].items():
        lines += [
            f"## {storage} ({run['directory']})",
            "",
            "| | request→durable: median (min / p90 / max) | write.checksums phase (CRCs, and MACs with a key) | cold |",
            "|---|---|---|---|",
        ]
        for label in ("without a key", "with a key"):
            lines.append(
                f"| {label} | {spread_text(run['samples_s'][label])} | "
                f"{run['checksums_phase_s'][label]['median'] * 1000:.0f} ms median | {run['cold_s'][label]:.2f} s |"
            )
        lines += ["", "| phase, median s | without a key | with a key |", "|---|---|---|"]
        plain, signed = run["phases_median_s"]["without a key"], run["phases_median_s"]["with a key"]
        for name in signed:
            lines.append(f"| {name} | {plain.get(name, float('nan')):.3f} | {signed[name]:.3f} |")
        verdict = "meets" if run["meets_goal"] else "misses"
        lines += [
            "",
            f"Median with a key / without: **{run['median_ratio']:.3f}×** ({verdict} the goal ≤ {GOAL_RATIO:.2f}×); "
            f"fastest against fastest {run['min_ratio']:.3f}×; each repeat's pair, with / without: "
            f"{run['paired_ratio']['median']:.3f}× median ({run['paired_ratio']['min']:.2f} / {run['paired_ratio']['p90']:.2f} / "
            f"{run['paired_ratio']['max']:.2f}). "
            f"The MACs' own time (the checksums phase with a key less without, per repeat): "
            f"{spread_text(mac_cost_values(run), unit='ms', scale=1000, digits=0)}, "
            f"{run['mac_cost_share_of_median'] * 100:.1f}% of the median without a key.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--disk", default=None, help="a directory on the local disk (default: the system's temporary directory)")
    parser.add_argument("--tmpfs", default="/dev/shm", help="a directory on tmpfs ('' skips it)")
    parser.add_argument("--out", default="benchmarks/results/signing")
    args = parser.parse_args()
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats {args.repeats}: at least {MIN_REPEATS}, so that min / median / p90 / max mean something")
    from overlapckpt.format.blob_macs import default_mac_algorithm

    result: dict[str, Any] = {**run_header(), "mib": args.mib, "repeats": args.repeats, "mac_algorithm": default_mac_algorithm()}
    result["commit"] = result["machine"].get("commit")
    storages = {"local disk": args.disk or tempfile.gettempdir()}
    if args.tmpfs and os.path.isdir(args.tmpfs):
        storages["tmpfs"] = args.tmpfs
    result["storages"] = {name: _storage_run(directory, args.mib, args.repeats) for name, directory in storages.items()}
    write_results(args.out, "signing", result, _report(result))


if __name__ == "__main__":
    main()
