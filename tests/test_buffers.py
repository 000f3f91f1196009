"""Host buffers are allocated once and reused: same segments, no growth per checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer
from overlapckpt.errors import ConfigError
from overlapckpt.hostbuf import SharedHostBuffer


def _mapped_segments(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] if "(deleted)" not in line else line.split()[-2] for line in f if "overlapckpt-" in line}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_twenty_checkpoints_reuse_the_same_host_buffers(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(16, 512)
    with Checkpointer(model, opt, tmp_path, keep=1) as ckpt:  # max_inflight="auto": two slots for this 6 MiB state
        segments, rss = [], []
        for _i in range(20):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.request()
            ckpt.wait(timeout_s=120)
            segments.append((_mapped_segments(os.getpid()), _mapped_segments(ckpt.writer_pid)))
            rss.append(_rss_bytes())
        assert len(ckpt.stats) == 20
    own, writer = segments[0]
    assert len(own) == 2 and own == writer  # two slots, each mapped by both processes
    assert all(s == (own, writer) for s in segments)
    # Past warm-up, 15 more checkpoints of `state_bytes` each must not grow RSS by even one.
    assert rss[-1] - rss[4] < state_bytes, (rss[4], rss[-1], state_bytes)
    # The segment is unlinked once both processes mapped it: nothing is left in /dev/shm.
    assert not any(name.startswith(f"overlapckpt-{os.getpid()}-") for name in os.listdir("/dev/shm"))


def test_a_buffer_the_filesystem_cannot_hold_is_refused_up_front(tmp_path, monkeypatch):
    # Without reserving the pages, tmpfs accepts any size and the first copy dies of SIGBUS.
    monkeypatch.setenv("OVERLAPCKPT_SHM_DIR", str(tmp_path))
    # Twice the free space: a plain ftruncate accepts it (a sparse file), a reservation cannot.
    too_big = 2 * shutil.disk_usage(tmp_path).free
    fd = os.open(tmp_path / "sparse", os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, too_big)  # precondition: the size alone is not refused
    os.close(fd)
    os.unlink(tmp_path / "sparse")
    with pytest.raises(ConfigError, match=rf"cannot allocate a {too_big}-byte host buffer in {tmp_path}.*OVERLAPCKPT_SHM_DIR"):
        SharedHostBuffer(too_big, pin=None)
    assert os.listdir(tmp_path) == []  # the failed file is not left behind


def test_a_host_buffer_dropped_without_release_is_unregistered():
    import gc

    from overlapckpt.train.copying.emulated_device import EmulatedDevice

    dev = EmulatedDevice()
    buffer = SharedHostBuffer(1 << 20, pin=dev)
    address = buffer.tensor.data_ptr()
    assert dev.registered == {address: 1 << 20}
    del buffer
    gc.collect()
    # Left registered, the range would make the next cudaHostRegister at a reused address fail.
    assert dev.registered == {}


def test_a_range_already_registered_is_named_in_the_error():
    from overlapckpt.train.copying.emulated_device import ERROR_HOST_MEMORY_ALREADY_REGISTERED, EmulatedDevice

    class AlreadyRegistered(EmulatedDevice):
        def register_host(self, ptr: int, nbytes: int) -> int:
            return ERROR_HOST_MEMORY_ALREADY_REGISTERED

    with pytest.raises(ConfigError, match="address range is already registered") as raised:
        SharedHostBuffer(1 << 20, pin=AlreadyRegistered())
    assert "ulimit" not in str(raised.value)  # not the locked-memory limit: that would send the user astray


def test_a_checkpointer_never_closed_unregisters_its_host_buffers_at_exit(tmp_path):
    import subprocess
    import sys

    log = tmp_path / "registrations.log"
    script = os.path.join(os.path.dirname(__file__), "workers", "unclosed_script.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path / "ckpts"), str(log)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = log.read_text().split()
    registered = {e.split(":")[1] for e in events if e.startswith("register:")}
    unregistered = {e.split(":")[1] for e in events if e.startswith("unregister:")}
    assert "committed" in proc.stdout and len(registered) >= 1  # the precondition: it checkpointed into registered memory
    assert unregistered == registered


def test_a_checkpoint_in_flight_at_exit_commits_and_says_so(tmp_path):
    """A Checkpointer never closed, exited right after request(): before, the checkpoint was lost with no word,
    and the root's lease was left behind."""
    import subprocess
    import sys

    from overlapckpt import list_checkpoints

    script = os.path.join(os.path.dirname(__file__), "workers", "unclosed_script.py")
    root = tmp_path / "ckpts"
    proc = subprocess.run(
        [sys.executable, script, str(root), str(tmp_path / "registrations.log"), "in-flight"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "requested" in proc.stdout, proc.stderr[-3000:]
    assert [i.step for i in list_checkpoints(str(root))] == [1]
    assert "was never closed. At interpreter exit the checkpoint(s) of step(s) [1] committed" in proc.stderr, proc.stderr[-3000:]
    assert not (root / ".overlapckpt-lease").exists()  # released
    events = (tmp_path / "registrations.log").read_text().split()
    assert {e.split(":")[1] for e in events if e.startswith("unregister:")} == {e.split(":")[1] for e in events if e.startswith("register:")}
