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
    with Checkpointer(model, opt, tmp_path, keep=1) as ckpt:
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
    assert len(own) == 1 and own == writer  # one slot, mapped by both processes
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
        SharedHostBuffer(too_big, pin=False)
    assert os.listdir(tmp_path) == []  # the failed file is not left behind
