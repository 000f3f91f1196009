"""The training process of the writer-kill test (tests/test_gpu_runtime.py): argv ROOT RIG (cuda or emulated).

A state (five 8192x8192 layers with AdamW's moments, about 4 GB, on CUDA; 1.3 MB on the
emulated device) is checkpointed; its copy is held back on the side stream (a ~2 s sleep
on CUDA, the held schedule on the emulated device). The writer is SIGKILLed and
confirmed dead while that copy is queued; with max_writer_restarts=0 the death is raised
at the next hook, and close() must then wait for the copy before it unpins and unmaps
the host buffers. Prints one "key value" line per fact the test reads.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, gpu_support

from overlapckpt.errors import WriterDiedError
from overlapckpt.seams import Checkpointer

from gpu_support import H200_SM_CLOCK_HZ, DelayedCopier, Rig
from helpers import exited_within


def main() -> None:
    rig = Rig(sys.argv[2])
    width = 8192 if rig.is_cuda else 256
    with torch.device(rig.device):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(5)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(8, width, device=rig.device)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    copier = DelayedCopier(rig, opt, delay_cycles=int(2.0 * H200_SM_CLOCK_HZ))
    ckpt = Checkpointer(model, opt, sys.argv[1], copier=copier, max_writer_restarts=0)
    ckpt.request()
    deadline = time.monotonic() + 120
    while copier.delays == 0:  # a request may wait for its host slot (allocated, pinned off the hooks)
        if time.monotonic() > deadline:
            raise RuntimeError("the checkpoint's copy was not enqueued within 120 s")
        step()
        ckpt.step()
    print("state_bytes", sum(p.numel() * 12 for p in model.parameters()), flush=True)
    os.kill(ckpt.writer_pid, signal.SIGKILL)
    # Wait until it is dead, without reaping it (the engine's liveness check does that).
    if not exited_within(ckpt.writer_pid, timeout_s=60):
        raise RuntimeError("the SIGKILLed writer did not exit within 60 s")
    print("in_flight_after_kill", not rig.side_stream_idle(copier), flush=True)
    died_in_loop = False
    for _ in range(20):
        try:
            step()
            ckpt.step()
        except WriterDiedError:
            died_in_loop = True
            break
    print("died_in_loop", died_in_loop, flush=True)
    try:
        ckpt.close(timeout_s=60)
        print("close returned", flush=True)
    except WriterDiedError:
        print("close raised WriterDiedError", flush=True)
    for _ in range(3):
        step()
    rig.synchronize()
    print("faults", getattr(copier.device, "faults", []), flush=True)
    print("survived", flush=True)


if __name__ == "__main__":
    main()
