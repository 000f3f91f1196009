"""``make soak``: many seeded fault-schedule trials (tests/fault_schedule.py); prints the figures, exits 1 on a violation.

    python tests/soak.py [--trials 200] [--first-seed 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fault_schedule import Trial, describe, run_trial, twin_states  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--first-seed", type=int, default=1000)
    args = parser.parse_args()
    started = time.monotonic()
    twins: dict[int, dict] = {}
    faults = fired = checked = starts = 0
    failed = []
    for seed in range(args.first_seed, args.first_seed + args.trials):
        steps = Trial.draw(seed).steps
        if steps not in twins:
            twins[steps] = twin_states(steps)
        result = run_trial(seed, twins[steps])
        faults += len(result.trial.trainer_faults) + len(result.trial.writer_faults)
        fired += len(result.faults_fired)
        checked += len(result.checked)
        starts += result.trainer_starts
        status = "VIOLATION" if result.violations else "ok"
        print(f"{status}: {describe(result)}", flush=True)
        for v in result.violations:
            print(f"    {v}", flush=True)
        if result.violations:
            failed.append(seed)
    print(
        f"soak: {args.trials} trials in {time.monotonic() - started:.0f} s; faults scheduled {faults}, injected {fired}; "
        f"trainer starts {starts}; listed checkpoints checked against the twin {checked}; violations "
        f"{len(failed)}{' (seeds ' + ', '.join(map(str, failed)) + ')' if failed else ''}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
