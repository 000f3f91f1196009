"""Host slots on the emulated device: registered in the rank's own device context, unmapped only after their DMA."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import StreamCopier

from helpers import exited_within


def _loop(model, opt):
    x = torch.randn(8, 64)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def test_host_buffers_are_registered_in_the_ranks_own_device_context(tmp_path):
    # Each rank's training thread sets its device (torch.cuda.set_device(local_rank)); the
    # thread that allocates and page-locks the slots is new, and a new thread's current
    # device is 0: a cudaHostRegister from it created a context on GPU 0 (~500 MB) per rank.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dev = EmulatedDevice(index=1)
    dev.bind_thread()
    step = _loop(model, opt)
    with Checkpointer(model, opt, tmp_path, window=2, consistency="replay", copier=StreamCopier(dev)) as ckpt:
        step()
        ckpt.request()
        for _ in range(2):
            step()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=120)
        assert len(dev.registered) == 4  # two slots ("auto", a small state), each with replay's gradient buffer, page-locked
    assert info.step == 2
    assert dev.contexts == {1}
    assert dev.registered == {}  # close() unregistered them


def test_a_dropped_snapshots_slot_is_unmapped_only_after_its_queued_copies_landed(tmp_path):
    # The writer dies with a snapshot's copy still queued (held): the snapshot is dropped
    # and its slot freed. The state then grows, so the next request regrows the slot, which
    # unregisters and unmaps the old one: under the queued DMA, before the fix.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)  # model[1] joins later
    dev = EmulatedDevice("held")
    step = _loop(model, opt)
    with Checkpointer(model, opt, tmp_path, copier=StreamCopier(dev)) as ckpt:
        step()
        ckpt.request()
        ckpt.wait(timeout_s=120)  # the slots exist and the writer maps them
        step()
        pid = ckpt.writer_pid
        os.kill(pid, signal.SIGKILL)
        assert exited_within(pid, 30)
        ckpt.request()  # its copy is queued; the death is seen in this call: the writer replaced, the snapshot dropped
        assert ckpt.writer_restarts == 1 and engine_of(ckpt).state.snapshots_dropped == 1
        opt.add_param_group({"params": list(model[1].parameters())})
        step()  # model[1]'s optimizer state is created: the slot must grow
        ckpt.request()
        infos = ckpt.wait(timeout_s=120)
    assert [i.step for i in infos] == [3]
    assert dev.faults == []
