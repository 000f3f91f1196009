"""Host time of overlapckpt's hooks per training step, against the number of state tensors.

    .venv/bin/python benchmarks/hook_scaling.py [--tensors 300,3000,30000,100000]
        [--modes w1,replay,stage] [--schedules held,async] [--passes native,python]
        [--cycles 7] [--every 8] [--out benchmarks/results/hook-scaling] [--resume]

``--passes`` picks the road of the hooks' per-tensor passes (``tensor_passes.py``):
``native``, the torch extension ``make install`` builds (a row asked for it that finds it
not built stops the run), and ``python``, its twins (``OVERLAPCKPT_NATIVE=0`` for that row's
process). Each row names its road.

Each configuration's row is appended to ``OUT/rows.jsonl`` as it is measured. With
``--resume``, a run that finds a row of the same configuration (tensors, mode, schedule,
passes, cycles, every) there keeps it and goes on with the next: an interrupted run resumes where
it stopped, and the table written to OUT holds every row in OUT and names every command
that measured them. Without it, OUT's rows are measured anew.

The workload is the one a Mixture-of-Experts rank meets: many small tensors. N/8 layers
``nn.Linear(4, 4)`` under AdamW (foreach): each layer holds 8 state tensors (weight, bias,
and per parameter exp_avg, exp_avg_sq and step). Gradients are set once; the loop times
``optimizer.step()`` + ``ckpt.step()`` only, so the figure is ours and AdamW's, not a
model's forward.

Each configuration runs in a fresh process (a fresh Checkpointer, as a user's job meets
it) on the emulated CUDA device, with tensors placed as CUDA places them
(``torch_cuda_placement``: AdamW's step counters in host memory, the rest on the device),
taking CUDA's road for replay's gradients (``clone_is_cheap``: each window step's gradients
cloned on the training stream, then drained with no fence), under each of two schedules of its side stream (``--schedules``):

* ``held``, the hooks' host time apart from the copies' time: a side-stream copy runs only
  when something waits for it (a fence inside a hook, or the untimed wait between cycles),
  so, as a GPU's copy engine, it takes no host CPU from the hooks. The goal is checked here.
* ``async``: the copies run at once on the stream's worker thread, beside the hooks, and
  compete with them for this machine's cores and the GIL, which a GPU's copies do not.

A third, ``cuda``, runs the same loop on a real GPU with the copier's CUDA backend
(``cuda_device.py``, counting its launches): there the copies and fences are the GPU's
work, so the three columns differ only by the hooks' CPU time.

A cycle is
``--every`` steps ending at a scheduled checkpoint (``every=``, so a window opens its W-1
steps early, as in a real run); between cycles the loop waits, untimed, for the commit (the writer's persist is not the hooks' cost). Per step it reads
``Checkpointer.hook_host_s``: host time inside our hooks, ``step()`` and ``request()``,
which is what the training loop waits for on our account (on a GPU the copies are
asynchronous; this time is not).

Reported per configuration: the added host time per step, mean and worst over all
measured steps, three ways: as the loop waits for it (wall time in our hooks); less the
device work the emulated device runs on the host (a copy on the training stream, a fence's
wait: on a GPU a kernel and a stream wait, not host time); and the hooks' own CPU time on
the training thread (``Checkpointer.hook_cpu_s``: without the time lost to the emulated
stream's thread and the writer process sharing this machine's two cores). Then the per-cycle mean as min / median / p90 / max over ``--cycles`` cycles
(and whether max is within 1.5x of the median), and the copy launches per step (calls
that enqueue copies on the device: one grouped ``_foreach_copy_`` each) with the tensors
they carry.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {"w1": {"window": 1}, "replay": {"window": 4, "consistency": "replay"}, "stage": {"window": 4, "consistency": "stage"}}
GOAL_MEAN_MS, GOAL_WORST_MS, GOAL_AT_TENSORS = 2.0, 10.0, 30_000


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]


def spread(values: list[float]) -> dict[str, Any]:
    med = statistics.median(values)
    return {
        "min": min(values), "median": med, "p90": _p90(values), "max": max(values), "n": len(values),
        "within_1_5x": max(values) <= 1.5 * med if med > 0 else True,
    }


def measure_one(tensors: int, mode: str, cycles: int, every: int, schedule: str = "held") -> dict[str, Any]:
    """One configuration, in this process; schedule ``cuda`` runs it on the GPU, with the copier's CUDA backend."""
    import torch
    from torch import nn

    from overlapckpt.seams import Checkpointer
    from overlapckpt.train.copying import tensor_passes
    from overlapckpt.train.copying.emulated_device import EmulatedDevice, torch_cuda_placement
    from overlapckpt.train.copying.stream_copier import StreamCopier

    class Counts:
        """Copy launches asked of the device, the tensors in them, and the device work run on the host."""

        launches = 0
        tensors_copied = 0
        device_on_host_s = 0.0

    class CountingLaunches:
        """Counts each copy launch asked of the device it is mixed into, and the tensors in it."""

        def copy_(self, destinations: Any, sources: Any) -> None:
            if sources:
                Counts.launches += 1
                Counts.tensors_copied += len(sources)
            super().copy_(destinations, sources)  # type: ignore[misc]

        def flatten(self, sources: Any, dtype: Any, numel: int) -> Any:
            Counts.launches += 1
            Counts.tensors_copied += len(sources)
            return super().flatten(sources, dtype, numel)  # type: ignore[misc]

    class CountingDevice(CountingLaunches, EmulatedDevice):
        """The emulated device, counting its copy launches and the device work it runs on the host: a copy
        queued on the training stream (stage mode's clones, replay's packed gradient clone) and a wait on it
        (a fence) run at the call here, where on a GPU they are a kernel and a stream wait."""

        def copy_(self, destinations: Any, sources: Any) -> None:
            on_host = self.current_stream() is self.host_stream
            self._timed(on_host, lambda: super(CountingDevice, self).copy_(destinations, sources))

        def flatten(self, sources: Any, dtype: Any, numel: int) -> Any:
            out: list[Any] = []
            self._timed(self.current_stream() is self.host_stream, lambda: out.append(super(CountingDevice, self).flatten(sources, dtype, numel)))
            return out[0]

        def wait_event(self, stream: Any, event: Any) -> None:
            self._timed(stream is self.host_stream, lambda: super(CountingDevice, self).wait_event(stream, event))

        @staticmethod
        def _timed(on_host: bool, run: Any) -> None:
            """Run it; on the host's (synchronous) stream, count its time as device work run on the host."""
            started = time.perf_counter()
            try:
                run()
            finally:
                if on_host:
                    Counts.device_on_host_s += time.perf_counter() - started

    def counting_cuda_device() -> Any:
        """The CUDA backend itself, counting its copy launches; its device work is the GPU's, so none is run on the host."""
        from overlapckpt.train.copying.cuda_device import CudaDevice

        class CountingCudaDevice(CountingLaunches, CudaDevice):
            pass

        return CountingCudaDevice(torch.device("cuda"))

    torch.set_num_threads(1)  # the trainer on one thread; the writer and the copy thread take the other core
    torch.manual_seed(0)
    layers = max(1, round(tensors / 8))
    on_gpu = schedule == "cuda"
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]).to("cuda" if on_gpu else "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    state_tensors = sum(1 for _ in model.parameters()) + sum(
        1 for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )
    baseline = []
    for _ in range(2 * every):
        started = time.perf_counter()
        optimizer.step()
        baseline.append(time.perf_counter() - started)  # on the GPU: the host's launch time, as the hooks' figure
    if on_gpu:
        torch.cuda.synchronize()
    per_step: list[float] = []
    per_step_cpu: list[float] = []
    per_step_host_only: list[float] = []
    cycle_means: list[float] = []
    launches: list[int] = []
    carried: list[int] = []
    row_started = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        # Placed as CUDA places them: AdamW's step counters stay in host memory (copied by the host).
        # On the GPU, AdamW (foreach, not capturable) keeps its step counters in host memory itself.
        device = counting_cuda_device() if on_gpu else CountingDevice(schedule, clone_is_cheap=True, host_resident=torch_cuda_placement(optimizer))
        copier = StreamCopier(device)
        with Checkpointer(model, optimizer, root, every=every, keep=1, copier=copier, **MODES[mode]) as ckpt:  # type: ignore[arg-type]
            for cycle in range(cycles + 1):  # the first cycle warms up (allocation, plan)
                this_cycle, this_cpu, this_host_only = [], [], []
                for _ in range(every):
                    counted, counted_cpu = ckpt.hook_host_s, ckpt.hook_cpu_s
                    launched, copied, on_host = Counts.launches, Counts.tensors_copied, Counts.device_on_host_s
                    optimizer.step()
                    ckpt.step()
                    this_cycle.append(ckpt.hook_host_s - counted)
                    this_cpu.append(ckpt.hook_cpu_s - counted_cpu)
                    this_host_only.append(this_cycle[-1] - (Counts.device_on_host_s - on_host))
                    launches.append(Counts.launches - launched)
                    carried.append(Counts.tensors_copied - copied)
                ckpt.wait()
                # Progress, on stderr: a row's parent keeps only its stdout line (a 30,000-tensor row takes minutes).
                print(f"{state_tensors} tensors, {mode}, {schedule}: cycle {cycle} of {cycles} done at {time.perf_counter() - row_started:.1f} s",
                      file=sys.stderr, flush=True)
                if cycle:
                    per_step += this_cycle
                    per_step_cpu += this_cpu
                    per_step_host_only += this_host_only
                    cycle_means.append(statistics.mean(this_cycle))
                else:
                    launches.clear()
                    carried.clear()
    return {
        "tensors_requested": tensors, "state_tensors": state_tensors, "mode": mode, "schedule": schedule, "cycles": cycles, "every": every,
        "passes": "native" if tensor_passes.passes() is not None else "python",
        "optimizer_step_ms_median": statistics.median(baseline) * 1e3,
        "added_mean_ms": statistics.mean(per_step) * 1e3, "added_worst_ms": max(per_step) * 1e3,
        "cpu_mean_ms": statistics.mean(per_step_cpu) * 1e3, "cpu_worst_ms": max(per_step_cpu) * 1e3,
        "host_only_mean_ms": statistics.mean(per_step_host_only) * 1e3, "host_only_worst_ms": max(per_step_host_only) * 1e3,
        "cycle_mean_ms": {k: (v * 1e3 if isinstance(v, float) else v) for k, v in spread(cycle_means).items()},
        "launches_per_step_mean": statistics.mean(launches), "launches_per_step_max": max(launches),
        "tensors_per_launch_mean": (sum(carried) / sum(launches)) if sum(launches) else 0.0,
    }


def _passes(row: dict[str, Any]) -> str:
    """Which road the hooks' per-tensor passes took (tensor_passes.py); rows measured before the extension, the Python one."""
    return str(row.get("passes", "python"))


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["tensors_requested"], row["mode"], row["schedule"], _passes(row), row["cycles"], row["every"])


def markdown(rows: list[dict[str, Any]]) -> str:
    out = [
        "| state tensors | mode | schedule | passes | added mean / worst ms | less emulated device work, mean / worst ms | "
        "hooks' CPU mean / worst ms | cycle mean ms min / median / p90 / max (n) | within 1.5x | "
        "launches per step mean / max | tensors per launch | optimizer.step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["cycle_mean_ms"]
        out.append(
            f"| {r['state_tensors']:,} | {r['mode']} | {r.get('schedule', 'async')} | {_passes(r)} | {r['added_mean_ms']:.2f} / {r['added_worst_ms']:.1f} | "
            f"{r['host_only_mean_ms']:.2f} / {r['host_only_worst_ms']:.1f} | {r['cpu_mean_ms']:.2f} / {r['cpu_worst_ms']:.1f} | "
            f"{c['min']:.2f} / {c['median']:.2f} / {c['p90']:.2f} / {c['max']:.2f} ({c['n']}) | "
            f"{'yes' if c['within_1_5x'] else 'no'} | {r['launches_per_step_mean']:.2f} / {r['launches_per_step_max']} | "
            f"{r['tensors_per_launch_mean']:.0f} | {r['optimizer_step_ms_median']:.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="300,3000,30000,100000")
    parser.add_argument("--modes", default="w1,replay,stage")
    parser.add_argument("--schedules", default="held,async")
    parser.add_argument("--cycles", type=int, default=7)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--passes", default="native", help="native,python: the hooks' passes through the extension "
                        "(where built: make install) and through their Python twins (OVERLAPCKPT_NATIVE=0)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--resume", action="store_true", help="keep the rows already measured into OUT")
    parser.add_argument("--one", nargs=3, metavar=("TENSORS", "MODE", "SCHEDULE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cycles < 7 and args.one is None:
        print(f"--cycles {args.cycles}: the figures need at least 7 repeats; use --cycles 7 or more", file=sys.stderr)
    if args.one is not None:
        print(json.dumps(measure_one(int(args.one[0]), args.one[1], args.cycles, args.every, args.one[2])))
        return
    rows_path = os.path.join(args.out, "rows.jsonl") if args.out else None
    done_rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    if rows_path and not args.resume:
        for stale in (rows_path, os.path.join(args.out, "commands.txt")):
            if os.path.exists(stale):
                os.unlink(stale)
    if rows_path and os.path.exists(rows_path):
        with open(rows_path) as f:
            for line in f:
                r = json.loads(line)
                done_rows[_key(r)] = r
    rows = []
    schedules = args.schedules.split(",")
    passes_roads = args.passes.split(",")
    for passes in passes_roads:
        if passes not in ("native", "python"):
            raise SystemExit(f"--passes: {passes!r} is not one of ['native', 'python']")
    for schedule in schedules:
        if schedule not in ("held", "async", "cuda"):
            raise SystemExit(f"--schedules: {schedule!r} is not one of ['async', 'cuda', 'held']")
    for tensors in [int(t) for t in args.tensors.split(",")]:
        for mode in args.modes.split(","):
            if mode not in MODES:
                raise SystemExit(f"--modes: {mode!r} is not one of {sorted(MODES)}")
            for schedule, passes in itertools.product(schedules, passes_roads):
                kept = done_rows.get((tensors, mode, schedule, passes, args.cycles, args.every))
                if kept is not None:
                    rows.append(kept)
                    print(f"{kept['state_tensors']:>7,} {mode:>6} {schedule:>5} {passes:>6}: kept from {rows_path}", flush=True)
                    continue
                started = time.perf_counter()
                # The twins road: the extension turned off for that process alone.
                env = {**os.environ, "OVERLAPCKPT_NATIVE": "0"} if passes == "python" else None
                done = subprocess.run(
                    [sys.executable, __file__, "--one", str(tensors), mode, schedule, "--cycles", str(args.cycles),
                     "--every", str(args.every)],
                    check=True, capture_output=True, text=True, env=env,
                )
                row = json.loads(done.stdout.strip().splitlines()[-1])
                if row["passes"] != passes:
                    raise SystemExit(f"--passes {passes}: the hooks took the {row['passes']} road; run `make install` to build the extension")
                rows.append(row)
                if rows_path:
                    os.makedirs(args.out, exist_ok=True)
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(
                    f"{row['state_tensors']:>7,} {mode:>6} {schedule:>5} {passes:>6}: added mean {row['added_mean_ms']:.2f} ms, "
                    f"worst {row['added_worst_ms']:.1f} ms, launches/step {row['launches_per_step_mean']:.2f} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    if rows_path:
        # The table holds every configuration measured into OUT, by this run or an earlier one.
        measured = {_key(r): r for r in rows}
        rows = list({**done_rows, **measured}.values())
        mode_order = list(MODES)
        rows.sort(key=lambda r: (r["tensors_requested"], mode_order.index(r["mode"]), r["schedule"] != "held", _passes(r) != "native"))
    table = markdown(rows)
    print(table)
    goal = [r for r in rows if r["tensors_requested"] == GOAL_AT_TENSORS]
    for r in goal:
        for what, mean_key, worst_key in (
            ("added (wall)", "added_mean_ms", "added_worst_ms"),
            ("less emulated device work", "host_only_mean_ms", "host_only_worst_ms"),
            ("hooks' CPU", "cpu_mean_ms", "cpu_worst_ms"),
        ):
            met = r[mean_key] <= GOAL_MEAN_MS and r[worst_key] <= GOAL_WORST_MS
            print(f"goal at {GOAL_AT_TENSORS:,} tensors, {r['mode']}, {r['schedule']} schedule, {_passes(r)} passes, {what}: mean <= {GOAL_MEAN_MS} ms and worst <= "
                  f"{GOAL_WORST_MS} ms: {'met' if met else 'missed'} ({r[mean_key]:.2f} / {r[worst_key]:.1f} ms)")
    if args.out:
        import torch
        from measure import machine_description  # benchmarks/ on the path when run as a script

        os.makedirs(args.out, exist_ok=True)
        command = "python benchmarks/hook_scaling.py " + " ".join(sys.argv[1:])
        commands_path = os.path.join(args.out, "commands.txt")  # every run whose rows the table holds
        with open(commands_path, "a") as f:
            f.write(command + "\n")
        with open(commands_path) as f:
            command = "`, then `".join(line.strip() for line in f if line.strip())
        with open(os.path.join(args.out, "hook_scaling.json"), "w") as f:
            on_gpu = any(r["schedule"] == "cuda" for r in rows)
            json.dump({"command": command, "machine": machine_description(torch.device("cuda" if on_gpu else "cpu")), "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "hook_scaling.md"), "w") as f:
            f.write(f"Command: `{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
