"""A training script that never closes its Checkpointer: each host registration is logged, and each release.

argv: checkpoint root, log file, and optionally "in-flight": exit right after request(), the
checkpoint still being copied and persisted. Run by tests/test_buffers.py.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import StreamCopier


class LoggingDevice(EmulatedDevice):
    def __init__(self, log_path: str) -> None:
        super().__init__()
        self.log_path = log_path

    def _log(self, line: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def register_host(self, ptr: int, nbytes: int) -> int:
        self._log(f"register:{ptr}")
        return super().register_host(ptr, nbytes)

    def unregister_host(self, ptr: int) -> int:
        self._log(f"unregister:{ptr}")
        return super().unregister_host(ptr)


def main() -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(model, opt, sys.argv[1], copier=StreamCopier(LoggingDevice(sys.argv[2])))
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    ckpt.request()
    if sys.argv[3:] == ["in-flight"]:
        print("requested", flush=True)
        return  # no wait(), no close(): the interpreter exits with the checkpoint in flight
    ckpt.wait(timeout_s=120)
    print("committed", flush=True)
    # No close(): the interpreter exits with the Checkpointer open.


if __name__ == "__main__":
    main()
