"""The command line: ls, inspect and verify against real checkpoints, committed, corrupt and missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from overlapckpt import Checkpointer
from overlapckpt.cli import main
from overlapckpt.format.extra_state import tensor_bytes

from helpers import make_run, train_step


def _train(tmp_path, steps: int, request_at: tuple[int, ...], window: int = 1, consistency: str = "replay") -> bytes:
    """Train ``steps`` iterations, requesting a checkpoint after each step in ``request_at`` and
    waiting for it; returns model.inp.weight's bytes at the last request."""
    model, opt, sched, sampler = make_run()
    stored = b""
    with Checkpointer(model, opt, tmp_path, window=window, consistency=consistency) as ckpt:
        for s in range(1, steps + 1):
            train_step(model, opt, sched, sampler)
            if s in request_at:
                ckpt.request()
                stored = tensor_bytes(model.inp.weight.detach().contiguous())
            ckpt.step()
        ckpt.wait(timeout_s=120)
    return stored


def _two_checkpoints(tmp_path) -> bytes:
    """Window-1 checkpoints of steps 1 and 5."""
    return _train(tmp_path, steps=5, request_at=(1, 5))


def test_ls_lists_committed_only(tmp_path, capsys):
    _two_checkpoints(tmp_path)
    # An uncommitted leftover: shards and manifest written, .metadata not.
    shutil.copytree(tmp_path / "step-000000005", tmp_path / "step-000000009")
    (tmp_path / "step-000000009" / ".metadata").unlink()
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3  # the header and two checkpoints
    # The mode column is what the manifest records (the engine names window-1 checkpoints).
    mode = json.loads((tmp_path / "step-000000005" / "overlapckpt.json").read_text())["mode"]
    assert lines[1].split()[:4] == ["1", "1", mode, "1"]
    assert lines[2].split()[:4] == ["5", "5", mode, "1"]
    assert "step-000000009" not in "\n".join(lines)


def test_inspect_shows_the_ledger_and_the_manifest(tmp_path, capsys):
    _train(tmp_path, steps=4, request_at=(1,), window=3, consistency="replay")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "version      step 3 (requested at step 1), mode replay, window 3" in out
    assert "gradients logged for steps 2, 3; replayed on the CPU to version 3" in out
    # How each param group was replayed, and how exactly: CPU training's own kernel, exact by construction.
    assert ("  replay of param group 0 (for-loop on cpu): the CPU's own kernel, bit for bit "
            "(trained on the CPU: replay runs the same kernel)") in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    on_disk = json.loads((tmp_path / "step-000000003" / "overlapckpt.json").read_text())
    assert manifest == on_disk
    assert manifest["replay_arithmetic"] == [
        {"group": 0, "device": "cpu", "path": "for-loop", "arithmetic": None, "exact": True,
         "evidence": "trained on the CPU: replay runs the same kernel"}
    ]


def test_verify_passes_then_names_the_flipped_tensor(tmp_path, capsys):
    stored = _two_checkpoints(tmp_path)
    assert main(["verify", "--all", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("checksum matches") == 2 and "CORRUPT" not in out

    shard = tmp_path / "step-000000005" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    pos = raw.find(stored)
    assert pos >= 0  # precondition: the tensor's bytes are stored verbatim
    raw[pos + 5] ^= 0x10
    shard.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "1 problem(s)" in out
    assert "checksum mismatch for 'model.inp.weight' in " in out and "step-000000005/__0_0.distcp" in out
    assert main(["verify", str(tmp_path), "--step", "1"]) == 0  # the older one is intact


def test_errors_exit_2_with_the_reason(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "no committed checkpoint under" in capsys.readouterr().err
    _two_checkpoints(tmp_path)
    assert main(["inspect", str(tmp_path), "--step", "4"]) == 2
    assert "committed steps are [1, 5]" in capsys.readouterr().err
    assert main(["ls", str(tmp_path), "-o", "novalue"]) == 2
    assert "storage option 'novalue' is invalid; write it as key=value" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli(tmp_path):
    _two_checkpoints(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "overlapckpt", "verify", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ") and "step-000000005" in proc.stdout


def test_ls_and_verify_on_s3_with_json_storage_options(tmp_path, s3_options, capsys):
    _two_checkpoints(tmp_path)
    import fsspec

    fs = fsspec.filesystem("s3", **s3_options)
    fs.put(str(tmp_path) + "/", "ckpts/cli-run/", recursive=True)
    options = [
        "-o", f"endpoint_url={s3_options['endpoint_url']}", "-o", "key=testing", "-o", "secret=testing",
        "-o", 'client_kwargs={"region_name": "us-east-1"}',
    ]
    assert main(["ls", "s3://ckpts/cli-run", *options]) == 0
    out = capsys.readouterr().out
    assert "s3://ckpts/cli-run/step-000000001" in out and "s3://ckpts/cli-run/step-000000005" in out
    assert main(["verify", "--all", "s3://ckpts/cli-run", *options]) == 0
    assert capsys.readouterr().out.count("checksum matches") == 2


def test_unreachable_storage_exits_2_without_a_traceback(capsys):
    # Nothing listens on port 9; one attempt, so the test does not wait through retries.
    options = ["-o", "endpoint_url=http://127.0.0.1:9", "-o", "key=a", "-o", "secret=b",
               "-o", 'client_kwargs={"region_name": "us-east-1"}', "-o", 'config_kwargs={"retries": {"max_attempts": 1}}']
    assert main(["ls", "s3://ckpts/run", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("overlapckpt ls: s3://ckpts/run: EndpointConnectionError: Could not connect to the endpoint URL")
    assert "Traceback" not in err


def test_ls_shows_run_and_lineage_and_speaks_json(tmp_path, capsys):
    _two_checkpoints(tmp_path)
    model, opt, sched, sampler = make_run(seed=3)
    with Checkpointer(model, opt, tmp_path) as ckpt:
        ckpt.restore(step=1)
        train_step(model, opt, sched, sampler)
        ckpt.request()
        ckpt.wait(timeout_s=120)  # version 2, continued from step-000000001
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "run       continued from" in lines[0]
    rows = {line.split()[0]: line for line in lines[1:]}
    run_of = {n: json.loads((tmp_path / n / "overlapckpt.json").read_text())["run_id"][:8] for n in ("step-000000001", "step-000000002")}
    assert f"{run_of['step-000000002']}  step-000000001 " in rows["2"]  # its run, and the checkpoint it continued from
    assert f"{run_of['step-000000001']}  - " in rows["1"]
    assert main(["ls", str(tmp_path), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["restored_from"]) for e in listed] == [(1, None), (2, "step-000000001"), (5, None)]


def test_a_missing_root_and_an_ambiguous_step_are_errors_that_say_so(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "typo")]) == 2  # before: exit 0, "no committed checkpoint"
    assert "no such checkpoint root: " in capsys.readouterr().err
    _two_checkpoints(tmp_path)
    shutil.copytree(tmp_path / "step-000000005", tmp_path / "step-000000005-0badc0de")  # a second run's step 5 (a copy)
    assert main(["inspect", str(tmp_path), "--step", "5"]) == 2  # before: one of them, silently
    err = capsys.readouterr().err
    assert "step 5 has 2 checkpoints under" in err and "step-000000005 (run" in err and "step-000000005-0badc0de (" in err
    assert "pass --name with one of them" in err
    assert main(["inspect", str(tmp_path), "--name", "step-000000005"]) == 0
    assert "version      step 5" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path), "--name", "../elsewhere"]) == 2
    assert "is not a checkpoint directory name" in capsys.readouterr().err


def test_the_help_reads_as_text(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "overlapckpt prune ROOT --keep N" in out and "overlapckpt export ROOT OUT" in out


def test_prune_keeps_the_newest_and_latest_and_waits_for_a_running_job(tmp_path, capsys):
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=1) as ckpt:
        for _ in range(4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
    assert main(["prune", str(tmp_path), "--keep", "2", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("would delete") == 2
    assert sorted(p.name for p in tmp_path.glob("step-*")) == [f"step-00000000{s}" for s in (1, 2, 3, 4)]
    model, opt, _, _ = make_run()
    with Checkpointer(model, opt, tmp_path):  # a job holds the lease
        assert main(["prune", str(tmp_path), "--keep", "2"]) == 2
        assert "is leased by run" in capsys.readouterr().err
    (tmp_path / "latest").write_text("step-000000001")  # latest names the oldest: it is kept too
    assert main(["prune", str(tmp_path), "--keep", "2"]) == 0
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000001", "step-000000003", "step-000000004"]


def test_export_writes_one_file_of_the_state_in_both_formats(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    from overlapckpt.restore import read_checkpoint

    _two_checkpoints(tmp_path / "ckpts")
    contents = read_checkpoint(str(tmp_path / "ckpts"))
    assert main(["export", str(tmp_path / "ckpts"), str(tmp_path / "model.pt")]) == 0
    assert "exported step 5" in capsys.readouterr().out
    whole = torch.load(tmp_path / "model.pt", weights_only=True)
    assert whole["step"] == 5 and whole["model"].keys() == contents.model.keys()
    assert all(torch.equal(whole["model"][k], v) for k, v in contents.model.items())
    assert all(torch.equal(whole["optimizer"]["state"][p][k], v) for p, s in contents.optimizer["state"].items() for k, v in s.items())
    assert main(["export", str(tmp_path / "ckpts"), str(tmp_path / "model.safetensors"), "--format", "safetensors", "--step", "1"]) == 0
    tensors = load_file(tmp_path / "model.safetensors")
    step1 = read_checkpoint(str(tmp_path / "ckpts"), step=1)
    assert tensors.keys() == step1.model.keys() and all(torch.equal(tensors[k], v) for k, v in step1.model.items())
    assert not list(tmp_path.glob("*.tmp-*"))  # written beside, then renamed into place


def test_verify_shows_progress_on_a_terminal_and_not_in_a_pipe(tmp_path):
    import pty

    _two_checkpoints(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command = [sys.executable, "-m", "overlapckpt", "verify", str(tmp_path)]
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=secondary, env=env, timeout=120)
        os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal's other end closed: all was read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
    assert proc.returncode == 0 and b"ok " in proc.stdout
    assert b"verifying step-000000005: " in shown and b"(100%)" in shown
    piped = subprocess.run(command, capture_output=True, env=env, timeout=120)
    assert piped.returncode == 0 and piped.stderr == b""


def test_verify_progress_counts_every_byte_it_reads_and_ends_at_its_total(tmp_path):
    """Before, .metadata's bytes were read and counted but not in the total: the line went past 100% (111%)."""
    from overlapckpt.format.storage import CheckpointStore
    from overlapckpt.format.verify import verify_checkpoint

    _two_checkpoints(tmp_path)
    calls: list[tuple[int, int]] = []
    report = verify_checkpoint(CheckpointStore(str(tmp_path)), "step-000000005", on_progress=lambda done, total: calls.append((done, total)))
    assert report.problems == [] and calls
    stored = sum(p.stat().st_size for p in (tmp_path / "step-000000005").iterdir() if p.name.endswith(".distcp") or p.name == ".metadata")
    assert {total for _, total in calls} == {stored} == {report.nbytes}
    assert all(done <= total for done, total in calls) and calls[-1] == (stored, stored)


def test_ls_of_a_file_is_an_error_and_inspect_and_verify_take_the_path_ls_prints(tmp_path, capsys):
    """Before: `ls <a file>` exited 0; inspect and verify refused a checkpoint's own path (only --name worked)."""
    _two_checkpoints(tmp_path)
    (tmp_path / "notes.txt").write_text("not a root")
    assert main(["ls", str(tmp_path / "notes.txt")]) == 2
    assert "is a file, not a checkpoint root" in capsys.readouterr().err
    assert main(["ls", str(tmp_path)]) == 0
    listed = [line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]]
    assert listed == [str(tmp_path / "step-000000001"), str(tmp_path / "step-000000005")]
    assert main(["inspect", listed[0]]) == 0
    assert "version      step 1 " in capsys.readouterr().out
    assert main(["verify", listed[0]]) == 0
    assert capsys.readouterr().out.startswith(f"ok      {listed[0]}")
    assert main(["inspect", listed[0], "--step", "5"]) == 2  # two checkpoints named: refused, naming the fix
    assert "pass the root with --step or --name" in capsys.readouterr().err


def test_prune_refuses_a_negative_keep_and_deletes_nothing(tmp_path, capsys):
    _two_checkpoints(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["prune", str(tmp_path), "--keep", "-1"])
    assert exited.value.code == 2
    assert "-1 is negative; pass how many checkpoints to keep, 0 or more" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == ["step-000000001", "step-000000005"]


def test_inspect_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """Before: `overlapckpt inspect ROOT --json | head -1` printed a BrokenPipeError traceback."""
    import torch

    # 1,000 tensors: a manifest of some 300 KB, more than a pipe holds, so the CLI is still writing when it closes.
    model = torch.nn.Sequential(*(torch.nn.Linear(1, 1) for _ in range(500)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(model, opt, tmp_path) as ckpt:
        model(torch.ones(1, 1)).sum().backward()
        opt.step()
        ckpt.request()
        ckpt.wait(timeout_s=120)
    cli = subprocess.Popen([sys.executable, "-m", "overlapckpt", "inspect", str(tmp_path), "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert cli.stdout is not None and cli.stdout.readline().strip() == b"{"
    cli.stdout.close()  # as head does after its line: every later write meets a closed pipe
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 0, err
    assert b"BrokenPipeError" not in err and b"Traceback" not in err, err
