"""``make soak``: many seeded fault-schedule trials (tests/fault_schedule.py); prints the figures, exits 1 on a violation.

    python tests/workers/soak.py [--trials 200] [--first-seed 1000] [--jobs 2]

Each trial runs its own training processes (``--jobs`` trials at once, each in its own
temporary root); the figures are printed when all have ended.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes

from fault_schedule import Trial, describe, run_trial, twin_states  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2, help="trials at once (each is its own processes)")
    args = parser.parse_args()
    started = time.monotonic()
    seeds = list(range(args.first_seed, args.first_seed + args.trials))
    twins = {steps: twin_states(steps) for steps in sorted({Trial.draw(seed).steps for seed in seeds})}
    faults = fired = checked = starts = 0
    failed = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # the work is in the trials' own processes
        results = pool.map(lambda seed: run_trial(seed, twins[Trial.draw(seed).steps]), seeds)
        for result in results:
            faults += len(result.trial.trainer_faults) + len(result.trial.writer_faults)
            fired += len(result.faults_fired)
            checked += len(result.checked)
            starts += result.trainer_starts
            print(f"{'VIOLATION' if result.violations else 'ok'}: {describe(result)}", flush=True)
            for v in result.violations:
                print(f"    {v}", flush=True)
            if result.violations:
                failed.append(result.trial.seed)
    print(
        f"soak: {args.trials} trials in {time.monotonic() - started:.0f} s; faults scheduled {faults}, injected {fired}; "
        f"trainer starts {starts}; listed checkpoints checked against the twin {checked}; violations "
        f"{len(failed)}{' (seeds ' + ', '.join(map(str, failed)) + ')' if failed else ''}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
