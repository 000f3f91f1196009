"""GPU runtime: the side stream, pinned host buffers, asynchronous copies, no host sync, a killed writer.

Marked ``gpu``; skipped without CUDA. Run on the GPU machine with
``pytest -m gpu tests/test_gpu.py tests/test_gpu_runtime.py`` (``benchmarks/gpu.sh``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from overlapckpt import Checkpointer
from overlapckpt.hostbuf import SharedHostBuffer
from overlapckpt.train.transfer import CudaStreamCopier

from gpu_support import (
    CUDA,
    OPTIMIZERS,
    ModelSpec,
    SyncErrorsInHooks,
    make_run,
    report_to,
    sync_errors,
    train_step,
)

pytestmark = pytest.mark.gpu

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def test_copy_runs_on_a_side_stream_without_host_sync(tmp_path):
    model, opt, batch = make_run(ModelSpec(width=1024, depth=2, bias=True), "fused")
    with Checkpointer(model, opt, tmp_path) as ckpt:
        train_step(model, opt, batch())
        with sync_errors():
            ckpt.request()
            ckpt.step()
        for _ in range(3):
            with sync_errors():
                train_step(model, opt, batch())
        side = ckpt._engine.copier.side_stream
        assert side != torch.cuda.current_stream()
        assert side.cuda_stream != torch.cuda.default_stream().cuda_stream
        (info,) = ckpt.wait(timeout_s=300)
        assert ckpt.stats[0]["device_waits_inserted"] >= 1
    assert info.step == 1


def test_every_host_buffer_is_pinned(tmp_path):
    # Precondition: is_pinned() tells page-locked memory from pageable memory here.
    assert torch.empty(1024, pin_memory=True).is_pinned() and not torch.empty(1024).is_pinned()
    spec = ModelSpec(width=1024, depth=4)
    model, opt, batch = make_run(spec, "fused")
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay") as ckpt:
        for s in range(1, 8):
            train_step(model, opt, batch())
            if s == 2:
                ckpt.request()
            ckpt.step()
        ckpt.wait(timeout_s=120)
        buffers = ckpt._engine.slots.host_tensors()
        assert len(buffers) >= 2  # the state's slot and replay's gradient buffer
        assert sum(t.numel() * t.element_size() for t in buffers) >= spec.state_nbytes()
        # Pageable memory would make every "asynchronous" copy a staged, host-blocking one.
        assert [i for i, t in enumerate(buffers) if not t.is_pinned()] == []


def test_copy_async_of_1_gb_returns_long_before_the_copy_lands(request):
    # A functional check of asynchrony, not a benchmark: into pageable memory, or with a
    # host synchronization inside, the call would last as long as the copy itself.
    nbytes, parts = 1 << 30, 4
    copier = CudaStreamCopier(CUDA)
    buffer = SharedHostBuffer(nbytes, pin=True)
    part = nbytes // parts
    sources = [torch.full((part,), k + 1, dtype=torch.uint8, device=CUDA) for k in range(parts)]
    destinations = [buffer.view(k * part, torch.uint8, (part,)) for k in range(parts)]
    try:
        assert all(d.is_pinned() for d in destinations)
        # Warm-up: the side stream's first copy sets up the DMA path.
        copier.wait(copier.copy_async([sources[0][: 1 << 20]], [destinations[0][: 1 << 20]]))
        torch.cuda.synchronize()  # an idle compute stream: fence 1 holds nothing back
        with sync_errors():
            started = time.perf_counter()
            ticket = copier.copy_async(sources, destinations)
            host_s = time.perf_counter() - started
            in_flight = not ticket.done_event.query()
        copier.wait(ticket)
        copy_s = ticket.start_event.elapsed_time(ticket.done_event) / 1000.0
        report_to(request, "copy_async_1gb", {"host_s": host_s, "copy_s": copy_s, "bytes_per_s": nbytes / copy_s})
        assert in_flight
        assert host_s < 0.1 * copy_s, (host_s, copy_s)
        for k, d in enumerate(destinations):  # it did land, every part where it belongs
            sample = d[:: 1 << 16]
            assert int(sample.min()) == int(sample.max()) == k + 1, k
    finally:
        destinations.clear()
        buffer.release()


# The training process of the writer-kill test. A ~4 GB state (five 8192x8192 layers
# with AdamW's moments) is copied behind a ~2 s sleep on the side stream; the writer is
# SIGKILLed and confirmed dead while that copy is queued, then the death surfaces in a
# hook or in close(). Releasing the host buffers (unpinning, unmapping) before the copy
# is done would let the DMA write into freed memory: a device fault that the next
# synchronization reports ("an illegal memory access"), or a crash.
_KILL_WRITER_SCRIPT = r"""
import os, signal, sys, time
import torch
from torch import nn
from gpu_support import CUDA, H200_SM_CLOCK_HZ, DelayedCopier
from overlapckpt import Checkpointer
from overlapckpt.errors import WriterDiedError

with torch.device(CUDA):
    model = nn.Sequential(*[nn.Linear(8192, 8192, bias=False) for _ in range(5)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
x = torch.randn(8, 8192, device=CUDA)

def step():
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

step()
copier = DelayedCopier(CUDA, delay_cycles=int(2.0 * H200_SM_CLOCK_HZ))
ckpt = Checkpointer(model, opt, sys.argv[1], copier=copier)
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
os.waitid(os.P_PID, ckpt.writer_pid, os.WEXITED | os.WNOWAIT)
died_in_loop = False
for _ in range(20):
    try:
        step()
        ckpt.step()
    except WriterDiedError:
        died_in_loop = True
        break
print("died_in_loop", died_in_loop, flush=True)
print("in_flight_at_close", not copier.side_stream.query(), flush=True)
try:
    ckpt.close(timeout_s=60)
    print("close returned", flush=True)
except WriterDiedError:
    print("close raised WriterDiedError", flush=True)
for _ in range(3):
    step()
torch.cuda.synchronize()
print("survived", flush=True)
"""


def test_writer_killed_with_4_gb_in_flight_does_not_crash_close(tmp_path):
    script = tmp_path / "kill_writer.py"
    script.write_text(_KILL_WRITER_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpts")], capture_output=True, text=True, timeout=300, env=env, cwd=REPO
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, (proc.returncode, out, err[-4000:])
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert int(lines["state_bytes"]) >= 4 * 10**9
    assert lines["in_flight_at_close"] == "True", out  # the test killed it mid-copy, as meant
    assert "close" in lines and "survived" in out.split(), out
    for sign in ("illegal memory access", "Segmentation fault", "CUDA error", "Traceback"):
        assert sign not in err, err[-4000:]


# ---- no host synchronization anywhere in the loop ----------------------------------------

SYNC_MODEL = ModelSpec(width=256, depth=3, batch=16)
EVERY = 4
BOUNDARY_FROM = 9  # ckpt.step() from this step on; before it the boundary is captured in the post-hook
SYNC_REQUEST_AT = 10
MIN_STEPS, MIN_COMMITS, MAX_LOOP_S = 16, 2, 60.0


def _loop_under_sync_errors(path, window, consistency, optimizer_kind, *, grad_scaler, scheduler=True, lr=1e-3):
    """Train with a Checkpointer under sync debug mode "error" until two checkpoints committed in hooks.

    The loop calls opt.step (or GradScaler.step), scheduler.step, zero_grad, ckpt.step
    (from BOUNDARY_FROM) and ckpt.request (at SYNC_REQUEST_AT), with every=EVERY; the
    commits are noticed by the hooks' polling, so every hook path runs under the mode.
    """
    model = SYNC_MODEL.build()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **OPTIMIZERS[optimizer_kind])
    gen = torch.Generator(device=CUDA).manual_seed(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9) if scheduler else None
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if grad_scaler else None
    stateful = {k: v for k, v in (("scheduler", sched), ("scaler", scaler)) if v is not None}
    # GradScaler.step reads found_inf with .item() before a non-fused optimizer's step:
    # a sync in torch, outside our hooks. The guard keeps the hooks under the mode there.
    torch_syncs_in_step = scaler is not None and not getattr(opt, "_step_supports_amp_scaling", False)
    guard = SyncErrorsInHooks(opt)
    steps = 0
    try:
        with Checkpointer(model, opt, path, window=window, consistency=consistency, every=EVERY, keep=2,
                          stateful=stateful) as ckpt:
            guard.close_around()
            deadline = time.monotonic() + MAX_LOOP_S
            while steps < MIN_STEPS or len(ckpt.stats) < MIN_COMMITS:
                assert time.monotonic() < deadline, f"{len(ckpt.stats)} checkpoints committed in {steps} steps"
                steps += 1
                with sync_errors():
                    loss = model(torch.randn(SYNC_MODEL.batch, SYNC_MODEL.width, device=CUDA, generator=gen)).square().mean()
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                with sync_errors(enabled=not torch_syncs_in_step):
                    if scaler is not None:
                        scaler.step(opt)
                    else:
                        opt.step()
                with sync_errors():
                    if scaler is not None:
                        scaler.update()
                    if sched is not None:
                        sched.step()
                    opt.zero_grad(set_to_none=True)
                    if steps >= BOUNDARY_FROM:
                        ckpt.step()
                    if steps == SYNC_REQUEST_AT:
                        ckpt.request()
            ckpt.wait(timeout_s=120)
    finally:
        guard.remove()
    assert guard.steps == steps  # every step's hooks ran inside the guard
    return ckpt.stats


@pytest.mark.parametrize("extra", ["scheduler", "grad_scaler"])
@pytest.mark.parametrize("optimizer_kind", ["fused", "foreach"])
@pytest.mark.parametrize(
    "window,consistency",
    [pytest.param(1, "replay", id="w1"), pytest.param(4, "replay", id="replay4"), pytest.param(4, "stage", id="stage4")],
)
def test_training_loop_never_synchronizes(tmp_path, window, consistency, optimizer_kind, extra):
    stats = _loop_under_sync_errors(tmp_path, window, consistency, optimizer_kind, grad_scaler=extra == "grad_scaler")
    assert len(stats) >= MIN_COMMITS
    if extra == "grad_scaler" and optimizer_kind == "fused" and consistency == "replay":
        # GradScaler drives the fused kernel (found_inf, grad_scale), which replay cannot follow.
        assert {st["window"] for st in stats} == {1}
    else:
        assert window in {st["window"] for st in stats}


def test_replay_hooks_never_synchronize_with_a_tensor_learning_rate(tmp_path):
    # A device tensor lr (fused AdamW takes one) is a hyperparameter replay must log every
    # step: reading it with .item() or .cpu() would sync. No scheduler: torch's own
    # schedulers call .item() on a tensor lr.
    lr = torch.tensor(1e-3, device=CUDA)
    stats = _loop_under_sync_errors(tmp_path, 4, "replay", "fused", grad_scaler=False, scheduler=False, lr=lr)
    assert len(stats) >= MIN_COMMITS and 4 in {st["window"] for st in stats}
