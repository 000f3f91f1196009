"""The writer process: no cwd on its sys.path, tied to the training process (not a thread), its own session."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from overlapckpt import Checkpointer

from helpers import exited_within, make_run, train_step

SCRIPT = os.path.join(os.path.dirname(__file__), "writer_cwd_script.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        ckpt._engine.link.writer.wait_ready()  # the writer is up and settled before this thread exits
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


def test_the_writer_runs_in_its_own_session_and_exits_with_a_killed_trainer(tmp_path):
    code = (
        "import signal, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]];"
        "from helpers import make_run; from overlapckpt import Checkpointer;"
        "m, o, _, _ = make_run(); c = Checkpointer(m, o, sys.argv[3]);"
        "print(c.writer_pid, flush=True); signal.pause()"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", code, REPO, os.path.dirname(__file__), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        writer_pid = int(trainer.stdout.readline())
        assert os.getsid(writer_pid) == writer_pid != os.getsid(trainer.pid)  # a session of its own
        trainer.kill()
        trainer.wait(timeout=30)
        assert exited_within(writer_pid, 30), f"the writer (pid {writer_pid}) outlived its killed trainer by 30 s"
    finally:
        if trainer.poll() is None:
            trainer.kill()


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
