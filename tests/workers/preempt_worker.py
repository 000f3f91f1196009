"""One rank of a torchrun job that gets preempted, for tests/test_preemption_dist.py.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/workers/preempt_worker.py OUT_DIR WINDOW

Trains TinyNet under DDP (gloo) with ``save_on_signal=(SIGTERM,)`` until a signal
ends it; rank 1 does extra work each step, so the ranks run at different speeds. It
prints ``READY <rank> <pid>`` once both ranks are past step 3, keeps the whole state
of its recent steps, and, from its own SIGTERM handler (which overlapckpt's guard
chains to after the commit), writes OUT_DIR/rank<R>.json (what was committed, and the
state at that version for the test to compare) before exiting with the signal.

Before READY, rank 0 acts as another client of the job's store would: it writes forged
values under the writers' keys (a preemption signal of ``"not-a-number"``, ``"9"`` and
an unsealed ``"15"``; a claim marker; the counter earlier releases polled with ``add``)
and waits until its writer's watch has refused each signal. None may stop the job.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers, fakes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from overlapckpt import Checkpointer, list_checkpoints  # noqa: E402
from overlapckpt.control_page import FORGED  # noqa: E402
from overlapckpt.writer.group import run_keys_prefix  # noqa: E402

from helpers import StatefulSampler, TinyNet  # noqa: E402

KEEP_STATES = 64  # recent steps whose state is kept, for the one that was committed
MAX_STEPS = 100_000  # the loop ends by the signal, long before


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in model.module.state_dict().items()}
    for name, p in model.module.named_parameters():
        for k, v in opt.state[p].items():
            out[f"optimizer.state.{name}.{k}"] = v.detach().clone()
    return out


def say(line: str) -> None:
    """One line to the job's shared output in one write: print() writes the text and its newline apart, and
    the other rank's line could land between them ("READY 1 28702FORGED_REFUSED 3")."""
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def forge_store_values(ckpt: Checkpointer) -> None:
    """Write what another client of the job's store could, and wait until the watch refused each signal."""
    spec = ckpt._distributed.writer_spec
    page = ckpt._control_page
    client = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timedelta(seconds=30))
    agree = dist.PrefixStore(run_keys_prefix(spec) + "agree/", client)
    agree.set("posted/0", "xyz")
    agree.set("count/0", "xyz")
    preempt = dist.PrefixStore(run_keys_prefix(spec) + "preempt/", client)
    for count, value in enumerate(["not-a-number", "9", "15"], start=1):
        preempt.set("signal", value)
        deadline = time.monotonic() + 60
        while page.read(FORGED) < count:  # the watch polls every 10 ms
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0's preemption watch did not refuse the forged signal {value!r} within 60 s")
            time.sleep(0.01)
    preempt.delete_key("signal")
    say(f"FORGED_REFUSED {page.read(FORGED)}")


def main() -> None:
    out, window = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyNet(width=32, features=8, outputs=4, dropout=0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = StatefulSampler(seed=100 + rank)
    states: dict[int, dict[str, torch.Tensor]] = {}
    root = os.path.join(out, "ckpts")
    step = 0

    def on_sigterm(signum: int, frame: object) -> None:
        # overlapckpt's guard runs this after its commit (it chains to the handler it replaced).
        committed = [i.step for i in list_checkpoints(root)]
        result: dict[str, object] = {"rank": rank, "committed": committed, "last_step": step}
        if committed and committed[-1] in states:
            path = os.path.join(out, f"state-rank{rank}.pt")
            torch.save(states[committed[-1]], path)
            result["state_file"] = path
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # exit with the signal's status

    signal.signal(signal.SIGTERM, on_sigterm)  # before the Checkpointer: the guard chains to it
    extra = torch.randn(256, 256)
    ckpt = Checkpointer(model, opt, root, window=window, save_on_signal=(signal.SIGTERM,))
    for step in range(1, MAX_STEPS + 1):
        x, y = sampler.next_batch(8)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if rank == 1:
            for _ in range(20):  # the slower rank: more work per step
                extra = torch.tanh(extra @ extra * 1e-3)
        states[step] = full_state(model, opt)
        states.pop(step - KEEP_STATES, None)
        ckpt.step()
        if step == 3:
            if rank == 0:
                forge_store_values(ckpt)
            say(f"READY {rank} {os.getpid()}")
    ckpt.close()


if __name__ == "__main__":
    main()
