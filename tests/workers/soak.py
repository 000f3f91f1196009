"""``make soak``: many seeded fault-schedule trials (tests/fault_schedule.py); prints the figures, exits 1 on a violation.

    python tests/workers/soak.py [--trials 200] [--first-seed 1000] [--jobs 2]
    python tests/workers/soak.py --crash-loop 50 [--jobs 2]    # each entry point killed 50 times (tests/crash_loop.py)

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
    parser.add_argument("--crash-loop", type=int, default=0, metavar="CYCLES",
                        help="instead: kill and restart each entry point's script CYCLES times (tests/crash_loop.py)")
    args = parser.parse_args()
    if args.crash_loop:
        return crash_loops(args.crash_loop, args.jobs, args.first_seed)
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


# Steps enough for every cycle to be killed before the run ends: a cycle trains 1 to 5 steps past its resume.
CRASH_LOOP_STEPS = {"plain": 240, "tier": 240, "lightning": 240, "hf": 240}


def crash_loops(cycles: int, jobs: int, seed: int) -> int:
    """Each entry point's crash loop (a temporary directory each): bit-exact at the end, storage bounded throughout."""
    import tempfile

    from crash_loop import BOUNDS, crash_loop, differences, twin_state

    started = time.monotonic()

    def one(entry: str) -> tuple[str, list[str], str]:
        with tempfile.TemporaryDirectory(prefix=f"crash-loop-{entry}-") as workdir:
            steps = CRASH_LOOP_STEPS[entry]
            want = twin_state(entry, workdir, steps)
            report = crash_loop(entry, workdir, steps, cycles, seed)
            problems = list(report.failures)
            if not problems:
                problems += [f"differs from the twin: {d}" for d in differences(report.final, want)]
            if report.most_in_root > BOUNDS["root"] or report.most_in_tier > BOUNDS["tier"]:
                problems.append(f"held {report.most_in_root} in the root, {report.most_in_tier} in the tier")
            if report.cycles < cycles:
                problems.append(f"only {report.cycles} of {cycles} cycles were killed before the run ended")
            line = (f"{entry}: {report.cycles} SIGKILLs, resumed at {report.resumed_at[1:6]}... {report.resumed_at[-1:]}, "
                    f"final state {'equal' if not problems else 'checked'} to the twin; most held: root {report.most_in_root} "
                    f"(bound {BOUNDS['root']}), tier {report.most_in_tier} (bound {BOUNDS['tier']}); {time.monotonic() - started:.0f} s")
            return entry, problems, line

    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:  # the work is in the scripts' own processes
        for _, problems, line in pool.map(one, list(CRASH_LOOP_STEPS)):
            print(f"{'VIOLATION' if problems else 'ok'}: {line}", flush=True)
            for problem in problems:
                print(f"    {problem[:2000]}", flush=True)
            failed += bool(problems)
    print(f"crash loop: {cycles} cycles per entry point in {time.monotonic() - started:.0f} s; violations {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
