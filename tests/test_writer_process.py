"""The writer process: no cwd on its sys.path, tied to the training process (not a thread), its own session;
forked by the training process's fork server, which follows the same rules, or started on its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from overlapckpt import Checkpointer
from overlapckpt.format.storage import CheckpointStore
from overlapckpt.seams import engine_of

from helpers import exited_within, make_run, train_step

SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "writer_cwd_script.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MarkingStore(CheckpointStore):
    """Writes a marker file per committed checkpoint into the directory an environment variable names (read in the writer)."""

    def write_latest(self, name: str) -> None:
        super().write_latest(name)
        marker_dir = os.environ["OVERLAPCKPT_TEST_MARKER_DIR"]
        os.makedirs(marker_dir, exist_ok=True)
        open(os.path.join(marker_dir, name), "w").close()


def test_a_module_planted_in_the_cwd_does_not_run_in_the_writer(tmp_path):
    planted = tmp_path / "cwd"
    marker = tmp_path / "planted-module-ran"
    for package in ("overlapckpt", "overlapckpt/writer"):
        (planted / package).mkdir(parents=True)
        (planted / package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('{package}')\n")
    (planted / "overlapckpt" / "writer" / "process.py").write_text(f"open({str(marker)!r}, 'w').write('process')\n")
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "root")], cwd=planted, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "committed 2" in done.stdout and "restarts 0" in done.stdout
    assert not marker.exists(), f"the planted {marker.read_text()} ran"


def test_a_checkpointer_built_in_a_thread_that_exits_keeps_its_writer(tmp_path):
    model, opt, sched, sampler = make_run()
    built: list[Checkpointer] = []

    def build() -> None:
        ckpt = Checkpointer(model, opt, tmp_path)
        engine_of(ckpt).parts.link.writer.wait_ready()  # the writer is up and settled before this thread exits
        built.append(ckpt)

    thread = threading.Thread(target=build)
    thread.start()
    thread.join(timeout=120)
    (ckpt,) = built
    with ckpt:
        pid = ckpt.writer_pid
        for _ in range(2):
            train_step(model, opt, sched, sampler)
            ckpt.step()
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
        assert info.step == 2
        assert ckpt.writer_restarts == 0 and ckpt.writer_pid == pid  # the same writer: the thread's exit did not kill it


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode().split("\0")


@pytest.mark.parametrize("fork_server", ["1", "0"], ids=["forked", "own-interpreter"])
def test_the_writer_runs_in_its_own_session_and_exits_with_a_killed_trainer(tmp_path, fork_server):
    code = (
        "import signal, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]];"
        "from helpers import make_run; from overlapckpt import Checkpointer;"
        "m, o, _, _ = make_run(); c = Checkpointer(m, o, sys.argv[3]);"
        "d = Checkpointer(m, o, sys.argv[3] + '-2', lease=False);"
        "print(c.writer_pid, d.writer_pid, flush=True); signal.pause()"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", code, REPO, os.path.dirname(__file__), str(tmp_path)], stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, OVERLAPCKPT_WRITER_FORK_SERVER=fork_server),
    )
    try:
        writer_pids = [int(pid) for pid in trainer.stdout.readline().split()]
        parents = {_parent_of(pid) for pid in writer_pids}
        for pid in writer_pids:
            assert os.getsid(pid) == pid != os.getsid(trainer.pid)  # a session of its own
        if fork_server == "1":
            (server,) = parents  # both writers forked by one server, not by the trainer
            assert server != trainer.pid and _parent_of(server) == trainer.pid
            assert os.getsid(server) == server  # a session of its own too
            assert _cmdline(server)[1:3] == ["-I", "-c"]  # isolated: no cwd, no PYTHONPATH on its sys.path
        else:
            assert parents == {trainer.pid}
        trainer.kill()
        trainer.wait(timeout=30)
        for pid in [*writer_pids, *parents - {trainer.pid}]:
            assert exited_within(pid, 30), f"process {pid} ({_cmdline(pid)}) outlived its killed trainer by 30 s"
    finally:
        if trainer.poll() is None:
            trainer.kill()


def test_a_forked_writer_takes_the_environment_of_its_start_and_reports_its_death(tmp_path, monkeypatch):
    """The fork server started before this writer: the environment of now must reach the writer
    (a store class reads it), and its exit status must still name the signal that killed it."""
    import signal

    from overlapckpt import WriterDiedError

    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path / "first"):
        pass  # the fork server exists from here on
    monkeypatch.setenv("OVERLAPCKPT_TEST_MARKER_DIR", str(tmp_path / "marker"))
    with Checkpointer(model, opt, tmp_path / "second", store_class=MarkingStore, max_writer_restarts=0) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
        assert (tmp_path / "marker" / info.path.rsplit("/", 1)[1]).exists()  # the writer saw the variable set after the server started
        os.kill(ckpt.writer_pid, signal.SIGKILL)
        assert exited_within(ckpt.writer_pid, 30)
        with pytest.raises(WriterDiedError, match=r"was killed by SIGKILL while no checkpoint was in flight"):
            ckpt.request()


def test_the_writer_starts_from_a_source_checkout_that_is_not_installed(tmp_path):
    # As on the GPU machine: torch installed, overlapckpt only as a source tree on PYTHONPATH.
    # This suite runs on an editable install, which would hide a writer that cannot find the
    # package: so a fresh venv that sees this venv's packages (torch) but not that install.
    import shutil
    import site
    import sysconfig

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(repo, "overlapckpt"), checkout / "overlapckpt", ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    venv_python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    # A path line in a .pth adds the directory without running the .pth files in it (the editable finder).
    ours = {sysconfig.get_paths()["purelib"], *site.getsitepackages()}
    with open(os.path.join(purelib, "packages-of-the-test-venv.pth"), "w") as f:
        f.write("\n".join(sorted(ours)) + "\n")
    script = (
        "import torch, overlapckpt\n"
        "from overlapckpt import Checkpointer\n"
        "print('package', overlapckpt.__file__, flush=True)\n"
        "model = torch.nn.Linear(4, 4); opt = torch.optim.AdamW(model.parameters())\n"
        "model(torch.randn(2, 4)).sum().backward(); opt.step()\n"
        "with Checkpointer(model, opt, 'ckpts') as ckpt:\n"
        "    ckpt.request(); (info,) = ckpt.wait(timeout_s=120)\n"
        "print('committed', info.step, flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(checkout)
    proc = subprocess.run([str(venv_python), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"package {checkout / 'overlapckpt' / '__init__.py'}" in proc.stdout  # the copy, not the install
    assert "committed 0" in proc.stdout  # the step before the Checkpointer: its count starts there


def test_the_writer_is_ready_when_the_constructor_returns(tmp_path):
    # Before: the writer started lazily, so the first request waited for its start-up (0.9-2 s)
    # holding the only slot, and the requests made meanwhile were merged into one.
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path, every=1) as ckpt:
        assert engine_of(ckpt).parts.link.writer._ready  # answered before the first step
        for _ in range(3):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            ckpt.wait(timeout_s=120)
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("step-")) == [
        "step-000000001", "step-000000002", "step-000000003",
    ]


class SerializationRecordingStore(CheckpointStore):
    """Records, inside the writer's persist, whether the garbage collector runs and how DCP's torch.save is routed."""

    def write_latest(self, name: str) -> None:
        import gc
        import json

        import torch
        from torch.distributed.checkpoint import filesystem

        from overlapckpt.format import tensor_blob

        super().write_latest(name)
        record = {
            "collector_enabled": gc.isenabled(),
            "full_collection_threshold": gc.get_threshold()[2],
            "templates": filesystem.torch.save is tensor_blob.save,
            "zip_crc": torch.serialization.get_crc32_options(),
        }
        with open(os.path.join(os.environ["OVERLAPCKPT_TEST_MARKER_DIR"], name + ".json"), "w") as f:
            json.dump(record, f)


@pytest.mark.parametrize("templates", ["1", "0"])
def test_the_writer_persists_without_full_collections_and_tensors_from_templates(tmp_path, monkeypatch, templates):
    import json

    from overlapckpt.writer.process import NO_FULL_COLLECTION_THRESHOLD

    marker = tmp_path / "marker"
    marker.mkdir()
    monkeypatch.setenv("OVERLAPCKPT_TEST_MARKER_DIR", str(marker))
    monkeypatch.setenv("OVERLAPCKPT_TENSOR_TEMPLATES", templates)
    model, opt, sched, sampler = make_run()
    with Checkpointer(model, opt, tmp_path / "ckpts", store_class=SerializationRecordingStore) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.request()
        (info,) = ckpt.wait(timeout_s=120)
    with open(marker / (info.path.rsplit("/", 1)[1] + ".json")) as f:
        record = json.load(f)
    assert record == {
        "collector_enabled": True,  # the young generations still collected
        "full_collection_threshold": NO_FULL_COLLECTION_THRESHOLD,
        "templates": templates == "1",
        "zip_crc": False,
    }


def test_full_collections_come_back_after_a_persist_that_failed():
    import gc

    from overlapckpt.writer.process import NO_FULL_COLLECTION_THRESHOLD, _full_collections_paused

    before = gc.get_threshold()
    assert before[2] != NO_FULL_COLLECTION_THRESHOLD  # precondition
    with pytest.raises(OSError):
        with _full_collections_paused():
            assert gc.get_threshold() == (before[0], before[1], NO_FULL_COLLECTION_THRESHOLD)
            raise OSError(28, "No space left on device")
    assert gc.get_threshold() == before


def test_the_writer_pays_replays_one_time_imports_at_its_start_not_in_a_persist():
    """Before: torch.optim's first optimizer in a writer imported torch._dynamo inside the first replay checkpoint's
    persist (its agree-and-replay phase took 354 ms, the later ones 1 ms). A writer of a run that may replay now runs
    warm_up() before Ready: after it, constructing and stepping an optimizer imports nothing more."""
    import inspect

    script = (
        "import sys\n"
        "from overlapckpt.writer.replay import warm_up\n"
        "assert 'torch._dynamo' not in sys.modules, 'imported before the warm-up: nothing to show'\n"
        "warm_up()\n"
        "before = set(sys.modules)\n"
        "import torch\n"
        "p = torch.nn.Parameter(torch.zeros(3)); o = torch.optim.Adam([p]); p.grad = torch.ones(3); o.step()\n"
        "new = sorted(set(sys.modules) - before)\n"
        "assert not new, new\n"
        "assert 'torch._dynamo' in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    from overlapckpt.writer import process

    # The writer calls it when the run may replay, before it answers Ready (the constructor waits for that).
    source = inspect.getsource(process.serve)
    assert "if init.replay_expected:" in source and source.index("warm_up()") < source.index("p.ReadyResponse(")
