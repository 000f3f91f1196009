"""The benchmark harness at its tiniest size: the JSON it writes has every figure, and they are plausible.

No timing is asserted: only that times are positive and bytes equal the state's size.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from workload import Workload  # noqa: E402

METHOD_KEYS = {"label", "step_times_s", "checkpoint_steps", "quiet_steps", "throughput", "records", "notes", "memory", "metrics"}
METRIC_KEYS = {
    "steps",
    "median_step_s",
    "stall_per_checkpoint_s",
    "mean_stall_per_checkpoint_s",
    "max_step_inflation_s",
    "quiet_median_step_s",
    "stall_vs_own_quiet_steps_s",
    "mean_stall_vs_own_quiet_steps_s",
    "max_step_inflation_vs_own_quiet_steps_s",
    "blocking_s",
    "mean_blocking_s",
    "request_to_commit_s",
    "mean_request_to_commit_s",
    "d2h_bytes_per_s",
    "d2h_fraction_of_peak",
    "steps_per_s",
    "throughput_vs_baseline",
    "throughput_checkpoints_deferred",
    "device_peak_extra_bytes",
    "checkpoints_committed",
    "first_checkpoint_hook_s",
    "later_checkpoints_median_hook_s",
}
MEMORY_KEYS = {"rss_peak_extra_bytes", "rss_peak_reset", "children_rss_peak_bytes", "host_pinned_bytes", "device_peak_bytes"}
EVERY, STALL_CHECKPOINTS, THROUGHPUT_CHECKPOINTS, QUIET = 2, 2, 1, 2
STEPS = STALL_CHECKPOINTS * (QUIET + EVERY)  # each checkpoint: QUIET steps without, then EVERY from its request


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmarks", "harness.py"),
            "--size", "micro",
            "--device", "cpu",
            "--methods", "dcp_async_thread,torch_checkpointing_async,overlapckpt_w2_replay",
            "--checkpoints", str(STALL_CHECKPOINTS),
            "--throughput-checkpoints", str(THROUGHPUT_CHECKPOINTS),
            "--every", str(EVERY),
            "--quiet-steps", str(QUIET),
            "--warmup", "2",
            "--out", str(out),
            "--checkpoint-dir", str(out / "checkpoints"),
            "--timeout-s", "120",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        data = json.load(f)
    data["_out"] = str(out)
    return data


def _micro_state_nbytes() -> int:
    workload = Workload("micro", torch.device("cpu"))
    for _ in range(2):
        workload.forward_backward()
        workload.optimizer_step()
    return workload.state_nbytes()


def test_json_has_machine_workload_and_every_method(result):
    assert result["machine"]["torch"] == torch.__version__
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["date_utc"].endswith("UTC")
    assert result["workload"]["size"] == "micro" and result["workload"]["parameters"] > 0
    assert list(result["methods"]) == ["baseline", "dcp_async_thread", "torch_checkpointing_async", "overlapckpt_w2_replay"]
    assert result["copy_peak"]["bytes_per_s"] > 0
    assert result["state_nbytes"] == _micro_state_nbytes()
    for name, run in result["methods"].items():
        assert set(run) == METHOD_KEYS, name
        assert set(run["metrics"]) == METRIC_KEYS, name
        assert set(run["memory"]) == MEMORY_KEYS, name
        assert len(run["step_times_s"]) == STEPS and all(t > 0 for t in run["step_times_s"]), name
        assert run["checkpoint_steps"] == [QUIET, 2 * QUIET + EVERY]
        assert run["quiet_steps"] == [0, 1, QUIET + EVERY, QUIET + EVERY + 1]
        assert run["metrics"]["median_step_s"] > 0
        assert run["throughput"]["steps"] == 2 + THROUGHPUT_CHECKPOINTS * EVERY and run["throughput"]["wall_s"] > 0
        assert run["metrics"]["throughput_vs_baseline"] > 0
        assert run["metrics"]["device_peak_extra_bytes"] is None  # CPU: no device memory
    assert result["methods"]["baseline"]["metrics"]["throughput_vs_baseline"] == 1.0
    assert result["failed"] == {} and result["skipped"] == []
    assert result["methods"]["baseline"]["records"] == []


@pytest.mark.parametrize("name", ["dcp_async_thread", "torch_checkpointing_async", "overlapckpt_w2_replay"])
def test_each_checkpoint_committed_with_positive_times(result, name):
    run = result["methods"][name]
    phases = [r["phase"] for r in run["records"]]
    assert phases == ["warmup"] + ["stall"] * STALL_CHECKPOINTS + ["throughput"] * THROUGHPUT_CHECKPOINTS
    for r in run["records"]:
        assert r["blocking_s"] > 0
        assert r["request_to_commit_s"] is not None and r["request_to_commit_s"] > 0
    assert run["metrics"]["checkpoints_committed"] == STALL_CHECKPOINTS
    assert len(run["metrics"]["stall_per_checkpoint_s"]) == STALL_CHECKPOINTS
    assert len(run["metrics"]["blocking_s"]) == STALL_CHECKPOINTS


def test_overlapckpt_copies_exactly_the_state(result):
    run = result["methods"]["overlapckpt_w2_replay"]
    state = result["state_nbytes"]
    for r in run["records"]:
        assert r["nbytes"] == state
        assert r["window"] == 2
        assert r["copied_nbytes"] >= state
        assert r["copy_s"] > 0 and r["d2h_bytes_per_s"] > 0
    # Replay copies the state once, plus group 0's gradients for step s+1 when the window
    # ran to its end (a window closed early by wait() or close() logs none).
    assert any(r["copied_nbytes"] > state for r in run["records"])
    assert run["metrics"]["d2h_bytes_per_s"] > 0
    assert run["memory"]["host_pinned_bytes"] == 0  # no pinning without CUDA
    assert run["notes"]["host_buffer_bytes"] >= state


def test_first_checkpoints_hook_time_is_reported_apart_from_the_later_ones(result):
    from report import HOOK_TIME_LIMIT_RATIO, HOOK_TIME_TARGET

    run = result["methods"]["overlapckpt_w2_replay"]
    hooks = run["notes"]["hook_host_s_by_checkpoint"]
    # The warm-up's checkpoint, then at least the stall phase's (the throughput phase's may merge).
    assert len(hooks) >= 1 + STALL_CHECKPOINTS and all(h > 0 for h in hooks)
    assert run["notes"]["construct_s"] > 0
    m = run["metrics"]
    assert m["first_checkpoint_hook_s"] == hooks[0]
    assert m["later_checkpoints_median_hook_s"] == statistics.median(hooks[1:])
    # Each checkpoint's record carries its own hooks' time: the warm-up's is the first.
    assert run["records"][0]["phase"] == "warmup" and run["records"][0]["hook_host_s"] == hooks[0]
    for name in ("baseline", "dcp_async_thread"):
        x = result["methods"][name]["metrics"]
        assert x["first_checkpoint_hook_s"] is None and x["later_checkpoints_median_hook_s"] is None
    # No dcp_async_process here, so the hook-time row is the only target, judged on overlapckpt.
    (target,) = result["targets"]
    ratio = m["first_checkpoint_hook_s"] / m["later_checkpoints_median_hook_s"]
    assert target["target"] == HOOK_TIME_TARGET and target["method"] == "overlapckpt_w2_replay"
    assert target["value_ratio"] == pytest.approx(ratio) and target["limit_ratio"] == HOOK_TIME_LIMIT_RATIO
    assert target["met"] == (ratio <= HOOK_TIME_LIMIT_RATIO)


def test_table_and_checkpoints_left_behind(result):
    with open(os.path.join(result["_out"], "results.md")) as f:
        table = f.read()
    for run in result["methods"].values():
        assert f"| {run['label']} |" in table
    m = result["methods"]["overlapckpt_w2_replay"]["metrics"]
    hooks = f"| {m['first_checkpoint_hook_s'] * 1000:.2f} / {m['later_checkpoints_median_hook_s'] * 1000:.2f} |"
    assert hooks in table and "| first checkpoint's hook time within 1.5x of the later ones' | overlapckpt_w2_replay |" in table
    # Each method removes its checkpoints once measured: the disk does not fill over a long run.
    assert os.listdir(os.path.join(result["_out"], "checkpoints")) == []


def test_a_failing_method_is_reported_and_the_rest_still_run(tmp_path, monkeypatch):
    import harness
    from methods import NoCheckpoint, Overlapckpt, TorchSave

    class DiskFullOnSecondSave(TorchSave):
        name = "torch_save_disk_full"

        def save(self, step: int) -> None:
            if self.records:
                raise OSError(28, "No space left on device (injected)")
            super().save(step)

    monkeypatch.setattr(harness, "all_methods", lambda cuda, windows: [NoCheckpoint(), DiskFullOnSecondSave(), Overlapckpt(1)])
    result = harness.main(
        ["--size", "micro", "--device", "cpu", "--checkpoints", "1", "--throughput-checkpoints", "1", "--every", "2",
         "--warmup", "1", "--out", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck")]
    )
    assert list(result["failed"]) == ["torch_save_disk_full"]
    assert result["failed"]["torch_save_disk_full"].startswith("OSError: [Errno 28] No space left on device (injected)")
    assert list(result["methods"]) == ["baseline", "overlapckpt_w1"]
    with open(tmp_path / "out" / "results.json") as f:
        on_disk = json.load(f)
    assert list(on_disk["failed"]) == ["torch_save_disk_full"]
    assert on_disk["methods"]["overlapckpt_w1"]["metrics"]["checkpoints_committed"] == 1
    assert os.listdir(tmp_path / "ck") == []  # the failed method's files were removed too


DIST_EVERY = 2


@pytest.fixture(scope="module")
def dist_result(tmp_path_factory):
    """``harness.py --nproc 2``, DDP only, at the micro size: dcp.async_save against overlapckpt window=1."""
    out = tmp_path_factory.mktemp("bench-dist")
    proc = subprocess.run(
        [
            sys.executable, os.path.join(REPO, "benchmarks", "harness.py"),
            "--nproc", "2", "--parallelism", "ddp", "--size", "micro",
            "--methods", "dcp_async_process,overlapckpt_w1",
            "--checkpoints", "1", "--throughput-checkpoints", "1", "--every", str(DIST_EVERY),
            "--quiet-steps", "1", "--warmup", "1", "--timeout-s", "120",
            "--out", str(out), "--checkpoint-dir", str(out / "checkpoints"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "results.json") as f:
        return json.load(f)


def test_two_ddp_ranks_each_copy_half_of_what_dcp_stages_on_every_rank(dist_result):
    part = dist_result["parallelisms"]["ddp"]
    state = part["state_nbytes"]
    assert state == _micro_state_nbytes() and part["failed"] == {}
    ranks = part["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    ours = []
    for r in ranks:
        assert list(r["methods"]) == ["baseline", "dcp_async_process", "overlapckpt_w1"]
        assert r["local_state_nbytes"] == state  # DDP: every rank holds the whole replicated state
        dcp_records, our_records = r["methods"]["dcp_async_process"]["records"], r["methods"]["overlapckpt_w1"]["records"]
        # DCP stages the whole state on every rank; overlapckpt copies this rank's share only.
        assert [x["copied_nbytes"] for x in dcp_records] == [state] * len(dcp_records)
        copied = {x["copied_nbytes"] for x in our_records}
        assert len(copied) == 1, copied  # the same share at every checkpoint
        ours.append(copied.pop())
        assert 0.3 * state <= ours[-1] <= 0.7 * state, (ours[-1], state)
        for name in ("dcp_async_process", "overlapckpt_w1"):
            m = r["methods"][name]["metrics"]
            assert m["host_copy_nbytes_per_checkpoint"] == r["methods"][name]["records"][1]["copied_nbytes"]
            assert m["checkpoints_committed"] == 1 and m["mean_request_to_commit_s"] > 0 and m["mean_blocking_s"] > 0
            assert len(m["stall_per_checkpoint_s"]) == 1 and m["median_step_s"] > 0
    assert sum(ours) == state  # the shares cover the state exactly once


def test_dist_table_has_a_row_per_method_and_rank(dist_result):
    with open(os.path.join(os.path.dirname(dist_result["checkpoint_dir"]), "results.md")) as f:
        table = f.read()
    for label in ("no checkpoint (baseline)", "dcp.async_save PROCESS", "overlapckpt window=1"):
        for rank in (0, 1):
            assert f"| {label} | {rank} |" in table
    assert "### DDP on 2 CPU ranks (gloo): micro workload" in table


def test_the_gpu_run_rehearses_on_the_emulated_device(tmp_path):
    # benchmarks/gpu.sh as the GPU machine runs it (a source checkout, PYTHONPATH=.), on the
    # emulated device: the pre-flight, the correctness check, the GPU tests and the benchmark,
    # each writing its results, so a plumbing error shows here and not in the device's 15 minutes.
    out = tmp_path / "gpu"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", os.path.join(REPO, "benchmarks", "gpu.sh"), str(out), "--emulate"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "all checks passed" in (out / "preflight.log").read_text()
    checks = [json.loads(line) for line in (out / "check.jsonl").read_text().splitlines()]
    assert [c["check"] for c in checks] == [
        "step_counters", "replay_clone_memory", "stage_region", "unowned_parameter", "training_stream", "unreleased_buffer",
    ]
    assert [c["check"] for c in checks if not c["ok"]] == []
    tests = [json.loads(line) for line in (out / "tests" / "results.jsonl").read_text().splitlines()]
    assert len(tests) == 2 and {t["outcome"] for t in tests} == {"passed"}, tests
    # The native helpers built as make install builds them, their tests on this torch, one hook-scaling row.
    assert "tensor passes:" in (out / "build.log").read_text()
    assert " passed in " in (out / "tests" / "passes.log").read_text().splitlines()[-1]
    (row,) = [json.loads(line) for line in (out / "hook-scaling" / "rows.jsonl").read_text().splitlines()]
    assert (row["state_tensors"], row["mode"], row["schedule"]) == (304, "w1", "held")
    with open(out / "results.json") as f:
        bench = json.load(f)
    assert set(bench["methods"]) == {"baseline", "dcp_async_thread", "torch_checkpointing_async", "overlapckpt_w1"}, bench["methods"]
    assert not bench["failed"]
    # The headline first: the benchmark right after the pre-flight, before the checks and tests.
    parts = [line.split()[0] for line in (out / "timeline.log").read_text().splitlines()]
    assert parts == ["preflight", "bench", "check", "tests", "hook_scaling"], parts


def test_a_gpu_test_that_hangs_loses_itself_and_the_outcomes_are_written_as_they_come(tmp_path):
    # gpu.sh's per-test timeout and --results-jsonl (tests/conftest.py): a hang fails its
    # own test, the next one still runs, and each outcome is on disk when it ends.
    (tmp_path / "conftest.py").write_text(open(os.path.join(REPO, "tests", "conftest.py")).read())
    (tmp_path / "test_hang.py").write_text(
        "import threading\n\n"
        "def test_hangs():\n    threading.Event().wait()  # never set: a hang\n\n"
        "def test_after():\n    assert True\n"
    )
    results = tmp_path / "results.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--per-test-timeout-s", "2",
         "--results-jsonl", str(results), str(tmp_path / "test_hang.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-2000:]
    outcomes = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(o["test"].split("::")[1], o["outcome"]) for o in outcomes] == [("test_hangs", "failed"), ("test_after", "passed")]
    assert "ran past --per-test-timeout-s=2.0" in proc.stdout


def test_spread_reports_the_quantiles_and_whether_the_max_holds():
    from stats import spread, spread_text

    values = [1.0, 1.1, 0.9, 1.2, 1.0, 1.05, 2.0]
    s = spread(values)
    assert (s["min"], s["median"], s["p90"], s["max"], s["n"]) == (0.9, 1.05, 1.2, 2.0, 7)
    assert s["within_1_5x"] is False  # 2.0 > 1.5 × 1.05
    assert spread(values[:-1])["within_1_5x"] is True
    assert spread_text(values, "ms", 1000.0, 0) == "1050 ms (900 / 1200 / 2000, n=7, max 1.9× median)"
    with pytest.raises(ValueError, match="measured nothing"):
        spread([])


def run_benchmark(script: str, out, *args: str) -> dict:
    """``benchmarks/<script>.py`` at 7 repeats with ``args``, its results written under ``out``: its JSON."""
    subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", f"{script}.py"), *args, "--repeats", "7", "--out", str(out)],
        check=True, cwd=REPO, capture_output=True, timeout=300,
    )
    with open(out / f"{script}.json") as f:
        return json.load(f)


def test_the_load_benchmark_runs_each_method_on_fresh_objects(tmp_path):
    out = tmp_path / "load"
    result = run_benchmark("load", out, "--mib", "4", "--dir", str(tmp_path))
    assert set(result["loads"]) == {"load(verify=True)", "load(verify=False)", "stock dcp.load"}
    for figures in result["loads"].values():
        assert len(figures["s"]) == 7 and all(t > 0 for t in figures["s"])
    report = (out / "load.md").read_text()
    assert "| load(verify=True) |" in report and "n=7" in report
    too_few = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "load.py"), "--repeats", "3"], cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert too_few.returncode == 2 and "--repeats 3 is below 7" in too_few.stderr


def test_the_many_tensors_benchmark_times_each_method_and_splits_the_writers_time(tmp_path):
    out = tmp_path / "many"
    result = run_benchmark("many_tensors", out, "--tensors", "60", "--dir", str(tmp_path))
    assert list(result["methods"]) == ["overlapckpt", "overlapckpt, templates off", "dcp.save"]
    for figures in result["methods"].values():
        assert len(figures["durable_s"]) == 7 and all(t > 0 for t in figures["durable_s"]) and figures["cold_s"] > 0
    assert {"write", "manifest", "commit"} <= set(result["methods"]["overlapckpt"]["persist_phases_median_s"])
    assert list(result["loads"]) == ["overlapckpt load()", "overlapckpt load(verify=False)", "stock dcp.load"]
    assert all(len(figures["s"]) == 7 and all(t > 0 for t in figures["s"]) for figures in result["loads"].values())
    assert "| overlapckpt, templates off |" in (out / "many_tensors.md").read_text()


def test_gpu_sh_names_a_size_and_methods_the_harness_knows():
    # The device run starts the benchmark minutes in: a misspelt size or method there would
    # cost the run its benchmark. The harness lists what it knows without building a model.
    import re

    script = open(os.path.join(REPO, "benchmarks", "gpu.sh")).read()
    (default_size,) = re.findall(r"BENCH_SIZE=\$\{GPU_SH_BENCH_SIZE:-([\w-]+)\}", script)
    methods = []
    for line in re.findall(r"^\s*methods=(\S+)$", script, flags=re.M):
        methods += [m for m in line.replace("$methods,", "").split(",") if m]
    (windows,) = re.findall(r'--size "\$BENCH_SIZE" .*--windows ([\d,]+)', script)
    for size in (default_size, "h200"):
        listed = subprocess.run(
            [sys.executable, os.path.join(REPO, "benchmarks", "harness.py"), "--size", size, "--device", "cuda", "--windows", windows, "--list"],
            check=True, cwd=REPO, capture_output=True, text=True, timeout=120,
        ).stdout.split()
        assert default_size == "h200-lean" and set(methods) <= set(listed), (size, sorted(set(methods) - set(listed)))
    assert "overlapckpt_w8_stage" in methods and "dcp_async_process" in methods
