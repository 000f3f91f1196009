"""A small checkpoint, request to durable: the first one of a process and the later ones, in every mode.

    .venv/bin/python benchmarks/small_checkpoint.py [--repeats 7] [--later 9] [--root DIR] [--out FILE]

A two-layer MLP whose AdamW state is 1.5 MiB (131,584 parameters: the parameters and two
moments, float32) trains on the CPU; each mode (window 1, replay W=4, stage W=4) runs in
``--repeats`` fresh processes. In each, one Checkpointer is built (its time reported apart),
then ``--later + 1`` checkpoints are requested, each waited for: the time from ``request()``
through the window's steps to the commit's ``wait()`` returning, durable (fsynced) on
``--root``'s disk. The first of each process pays whatever the first checkpoint still pays;
the figures are min / median / p90 / max over the processes (first) and over every later
checkpoint of every process (later).
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

MODES = {"window 1": (1, "replay"), "replay W=4": (4, "replay"), "stage W=4": (4, "stage")}


def one_process(window: int, consistency: str, later: int, root: str) -> dict[str, object]:
    import torch
    from torch import nn

    from overlapckpt import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    started = time.perf_counter()
    ckpt = Checkpointer(model, optimizer, root, window=window, consistency=consistency)
    built_s = time.perf_counter() - started
    step()
    ckpt.step()
    times = []
    for _ in range(later + 1):
        step()
        ckpt.step()
        started = time.perf_counter()
        ckpt.request()
        for _ in range(window):
            step()
            ckpt.step()
        ckpt.wait(timeout_s=120)
        times.append(time.perf_counter() - started)
    ckpt.close()
    state = sum(p.numel() for p in model.parameters()) * 3 * 4
    return {"built_s": built_s, "first_s": times[0], "later_s": times[1:], "state_bytes": state}


def _spread(values: list[float]) -> str:
    from stats import spread_text

    return spread_text(values, "ms", 1000.0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--later", type=int, default=9)
    parser.add_argument("--root", default=None, help="the disk the checkpoints go to (default: a directory under build/)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", nargs=2, metavar=("WINDOW", "CONSISTENCY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_process(int(args.one[0]), args.one[1], args.later, args.root)))
        return
    base = args.root or os.path.join(os.path.dirname(HERE), "build", "small-checkpoint")
    os.makedirs(base, exist_ok=True)
    lines = [f"$ .venv/bin/python benchmarks/small_checkpoint.py --repeats {args.repeats} --later {args.later}"]
    for name, (window, consistency) in MODES.items():
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(dir=base) as root:
                done = subprocess.run(
                    [sys.executable, __file__, "--one", str(window), consistency, "--later", str(args.later), "--root", root],
                    capture_output=True, text=True, timeout=600, check=True,
                )
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        state_mib = runs[0]["state_bytes"] / (1 << 20)
        lines.append(f"{name} ({state_mib:.2f} MiB of AdamW state), request to durable:")
        lines.append(f"  first of a process: {_spread([r['first_s'] for r in runs])}")
        lines.append(f"  later:              {_spread([t for r in runs for t in r['later_s']])}")
        lines.append(f"  Checkpointer built: {_spread([r['built_s'] for r in runs])}")
        print("\n".join(lines[-4:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
