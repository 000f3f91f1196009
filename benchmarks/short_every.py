"""``every=2`` on a tiny model: which window each scheduled checkpoint gets, and what the loop waits, by step length.

    .venv/bin/python benchmarks/short_every.py [--repeats 7] [--steps 40] [--root DIR] [--out FILE]

The small-checkpoint model (two ``Linear(256, 256)``, AdamW, 1.5 MiB of state) trains
``--steps`` steps with ``window=4, every=2`` (replay), each step padded by a busy wait to a
fixed length (2, 10 and 30 ms), with one host slot (``max_inflight=1``) and with the default
(``"auto"``: two for this state). With ``every=2`` a replay window opens a step before its
version (W=2); it is cut to 1 when no slot is free by then, and the hook waits at the
version's step while the previous persist still holds every slot. Per setting, over
``--repeats`` fresh processes: the share of checkpoints that kept window 2, and the loop's
wait for a slot per checkpoint (``waited_for_slot_s``), as min / median / p90 / max.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

STEP_MS = (2, 10, 30)
SLOTS = ("1", "auto")


def one_process(step_ms: float, max_inflight: str, steps: int, root: str) -> dict[str, object]:
    import torch
    from torch import nn

    from overlapckpt import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    inflight: int | str = max_inflight if max_inflight == "auto" else int(max_inflight)
    with Checkpointer(model, optimizer, root, window=4, every=2, max_inflight=inflight) as ckpt:
        for _ in range(steps):
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            ckpt.step()
            while time.perf_counter() - started < step_ms / 1000.0:
                pass  # the rest of a step of this length: the device's compute, on a real run
        ckpt.wait(timeout_s=120)
        stats = list(ckpt.stats)
    return {
        "windows": [s["window"] for s in stats],
        "waited_s": [s.get("waited_for_slot_s") or 0.0 for s in stats],
        "steps": [s["step"] for s in stats],
    }


def main() -> None:
    from stats import parse_repeated, spread_text

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--root", default=None, help="the disk the checkpoints go to (default: a directory under build/)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=2, metavar=("STEP_MS", "MAX_INFLIGHT"), help=argparse.SUPPRESS)
    args = parse_repeated(parser)
    if args.one:
        print(json.dumps(one_process(float(args.one[0]), args.one[1], args.steps, args.root)))
        return
    base = args.root or os.path.join(os.path.dirname(HERE), "build", "short-every")
    os.makedirs(base, exist_ok=True)
    import torch
    from measure import machine_description

    machine = machine_description(torch.device("cpu"))
    lines = [
        f"$ .venv/bin/python benchmarks/short_every.py --repeats {args.repeats} --steps {args.steps}",
        f"{machine['date_utc']}, {machine['cpu_count']} CPUs ({machine['cpu']}), torch {machine['torch']}, commit {machine['commit']}",
        f"window=4, every=2, replay, {args.steps} steps: {args.steps // 2} checkpoints a run, {args.repeats} runs a setting",
        "",
        "| step | max_inflight | checkpoints that kept window 2 | wait for a slot per checkpoint |",
        "|---|---|---|---|",
    ]
    for step_ms in STEP_MS:
        for slots in SLOTS:
            runs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(dir=base) as root:
                    done = subprocess.run(
                        [sys.executable, __file__, "--one", str(step_ms), slots, "--steps", str(args.steps), "--root", root],
                        capture_output=True, text=True, timeout=600, check=True,
                    )
                    runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            kept = [sum(1 for w in r["windows"] if w == 2) / max(1, len(r["windows"])) for r in runs]
            waited = [w for r in runs for w in r["waited_s"]]
            lines.append(
                f"| {step_ms} ms | {slots} | {spread_text(kept, '%', 100.0, 0)} | {spread_text(waited, 'ms', 1000.0, 1)} |"
            )
            print(lines[-1], flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
