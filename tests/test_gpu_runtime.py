"""GPU runtime: the side stream, pinned host buffers, asynchronous copies, no host sync, a killed writer.

Marked ``device``: on CUDA where there is a device (``benchmarks/gpu.sh``), else on the
emulated device, in ``make test``. Marked ``gpu``: needs real hardware.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from overlapckpt.hostbuf import SharedHostBuffer
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.copying.stream_copier import StreamCopier

from gpu_support import (
    OPTIMIZERS,
    ModelSpec,
    SyncErrorsInHooks,
    make_run,
    report_to,
    sync_errors,
    train_step,
)

pytestmark = pytest.mark.device

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def _copier(rig, opt):
    """The rig's plain copier: the Checkpointer's own default on CUDA, the emulated device's twin of it on the CPU."""
    return StreamCopier(rig.seam(opt, schedule="async"))


def test_copy_runs_on_a_side_stream_without_host_sync(tmp_path, rig):
    model, opt, batch = make_run(rig, ModelSpec(width=rig.scaled(1024), depth=2, bias=True), "fused")
    # Held on the emulated device: the copy is still queued when the next step fences it, on
    # every run (an async worker may have finished it first, and no wait would be inserted).
    copier = StreamCopier(rig.seam(opt))
    with Checkpointer(model, opt, tmp_path, copier=copier) as ckpt:
        train_step(model, opt, batch())
        with sync_errors(rig, copier):
            ckpt.request()
            ckpt.step()
        for _ in range(3):
            with sync_errors(rig, copier):
                train_step(model, opt, batch())
        side = engine_of(ckpt).parts.copier.side_stream
        assert side is not copier.device.current_stream()
        if rig.is_cuda:
            assert side.cuda_stream != torch.cuda.default_stream().cuda_stream
        (info,) = ckpt.wait(timeout_s=300)
        assert ckpt.stats[0]["device_waits_inserted"] >= 1
    assert info.step == 1


def test_every_host_buffer_is_pinned(tmp_path, rig):
    if rig.is_cuda:  # precondition: is_pinned() tells page-locked memory from pageable memory here
        assert torch.empty(1024, pin_memory=True).is_pinned() and not torch.empty(1024).is_pinned()
    spec = ModelSpec(width=rig.scaled(1024), depth=4)
    model, opt, batch = make_run(rig, spec, "fused")
    copier = _copier(rig, opt)
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay", copier=copier) as ckpt:
        for s in range(1, 8):
            train_step(model, opt, batch())
            if s == 2:
                ckpt.request()
            ckpt.step()
        ckpt.wait(timeout_s=120)
        buffers = engine_of(ckpt).parts.slots.host_tensors()
        assert len(buffers) >= 2  # the state's slot and replay's gradient buffer
        assert sum(t.numel() * t.element_size() for t in buffers) >= spec.state_nbytes()
        # Pageable memory would make every "asynchronous" copy a staged, host-blocking one.
        if rig.is_cuda:
            assert [i for i, t in enumerate(buffers) if not t.is_pinned()] == []
        else:
            registered = copier.device.registered
            assert [i for i, t in enumerate(buffers) if registered.get(t.data_ptr()) != t.numel()] == []


@pytest.mark.gpu  # a timing: the host's return against the DMA's duration
def test_copy_async_of_1_gb_returns_long_before_the_copy_lands(request, rig):
    # A functional check of asynchrony, not a benchmark: into pageable memory, or with a
    # host synchronization inside, the call would last as long as the copy itself.
    nbytes, parts = 1 << 30, 4
    copier = StreamCopier(rig.seam())
    buffer = SharedHostBuffer(nbytes, pin=copier.device)
    part = nbytes // parts
    sources = [torch.full((part,), k + 1, dtype=torch.uint8, device=rig.device) for k in range(parts)]
    destinations = [buffer.view(k * part, torch.uint8, (part,)) for k in range(parts)]
    try:
        assert all(d.is_pinned() for d in destinations)
        # Warm-up: the side stream's first copy sets up the DMA path.
        copier.wait(copier.copy_async([sources[0][: 1 << 20]], [destinations[0][: 1 << 20]]))
        torch.cuda.synchronize()  # an idle compute stream: fence 1 holds nothing back
        with sync_errors(rig, copier):
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


def test_writer_killed_with_a_copy_in_flight_does_not_crash_close(tmp_path, rig):
    # tests/workers/kill_writer_script.py: the copy of a state (about 4 GB on CUDA, behind a ~2 s
    # sleep on the side stream; held on the emulated device) is queued, the writer is
    # SIGKILLed and confirmed dead, and the death is raised at the next hook
    # (max_writer_restarts=0, so no replacement lets the loop run on). Releasing the host
    # buffers (unpinning, unmapping) before the copy is done would let the DMA write into
    # freed memory: a device fault ("an illegal memory access"), or a crash.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, os.path.join(TESTS_DIR, "workers", "kill_writer_script.py"), str(tmp_path / "ckpts"), rig.name],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, (proc.returncode, out, err[-4000:])
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert int(lines["state_bytes"]) >= (4 * 10**9 if rig.is_cuda else 10**6)
    assert lines["in_flight_after_kill"] == "True", out  # killed mid-copy, as meant
    assert lines["died_in_loop"] == "True", out  # raised at the first hook after the death
    assert lines["faults"] == "[]", out  # the emulated device saw no DMA into unregistered memory
    assert "close" in lines and "survived" in out.split(), out
    for sign in ("illegal memory access", "Segmentation fault", "CUDA error", "Traceback"):
        assert sign not in err, err[-4000:]


# ---- no host synchronization anywhere in the loop ----------------------------------------

SYNC_MODEL = ModelSpec(width=256, depth=3, batch=16)
EVERY = 4
BOUNDARY_FROM = 9  # ckpt.step() from this step on; before it the boundary is captured in the post-hook
SYNC_REQUEST_AT = 10
MIN_STEPS, MIN_COMMITS, MAX_LOOP_S = 16, 2, 60.0


def _loop_under_sync_errors(path, rig, window, consistency, optimizer_kind, *, grad_scaler, scheduler=True, lr=1e-3, copier_cls=StreamCopier):
    """Train with a Checkpointer under sync debug mode "error" until two checkpoints committed in hooks.

    The loop calls opt.step (or GradScaler.step), scheduler.step, zero_grad, ckpt.step
    (from BOUNDARY_FROM) and ckpt.request (at SYNC_REQUEST_AT), with every=EVERY; the
    commits are noticed by the hooks' polling, so every hook path runs under the mode.
    """
    model = SYNC_MODEL.build(rig)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **OPTIMIZERS[optimizer_kind])
    gen = torch.Generator(device=rig.device).manual_seed(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.9) if scheduler else None
    scaler = torch.amp.GradScaler(rig.device.type, init_scale=2.0**10) if grad_scaler else None
    copier = copier_cls(rig.seam(opt, schedule="async"))
    stateful = {k: v for k, v in (("scheduler", sched), ("scaler", scaler)) if v is not None}
    # GradScaler.step reads found_inf with .item() before a non-fused optimizer's step:
    # a sync in torch, outside our hooks. The guard keeps the hooks under the mode there.
    torch_syncs_in_step = scaler is not None and not getattr(opt, "_step_supports_amp_scaling", False)
    guard = SyncErrorsInHooks(rig, opt)
    steps = 0
    try:
        with Checkpointer(model, opt, path, window=window, consistency=consistency, every=EVERY, keep=2,
                          stateful=stateful, copier=copier) as ckpt:
            guard.close_around(copier)
            # The loop's deadline counts from a started writer: on a loaded CPU, the writer's
            # own start-up (importing torch beside a training loop that takes every core) is slow.
            engine_of(ckpt).parts.link.writer.wait_ready()
            deadline = time.monotonic() + MAX_LOOP_S
            while steps < MIN_STEPS or len(ckpt.stats) < MIN_COMMITS:
                assert time.monotonic() < deadline, f"{len(ckpt.stats)} checkpoints committed in {steps} steps"
                steps += 1
                with sync_errors(rig, copier):
                    loss = model(torch.randn(SYNC_MODEL.batch, SYNC_MODEL.width, device=rig.device, generator=gen)).square().mean()
                    (scaler.scale(loss) if scaler is not None else loss).backward()
                with sync_errors(rig, copier, enabled=not torch_syncs_in_step):
                    if scaler is not None:
                        scaler.step(opt)
                    else:
                        opt.step()
                with sync_errors(rig, copier):
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
def test_training_loop_never_synchronizes(tmp_path, rig, window, consistency, optimizer_kind, extra):
    stats = _loop_under_sync_errors(tmp_path, rig, window, consistency, optimizer_kind, grad_scaler=extra == "grad_scaler")
    assert len(stats) >= MIN_COMMITS
    if extra == "grad_scaler" and optimizer_kind == "fused" and consistency == "replay":
        # GradScaler drives the fused kernel (found_inf, grad_scale), which replay cannot follow.
        assert {st["window"] for st in stats} == {1}
    else:
        assert window in {st["window"] for st in stats}


def test_replay_hooks_never_synchronize_with_a_tensor_learning_rate(tmp_path, rig):
    # A device tensor lr (fused AdamW takes one) is a hyperparameter replay must log every
    # step: reading it with .item() or .cpu() would sync. No scheduler: torch's own
    # schedulers call .item() on a tensor lr.
    lr = torch.tensor(1e-3, device=rig.device)
    stats = _loop_under_sync_errors(tmp_path, rig, 4, "replay", "fused", grad_scaler=False, scheduler=False, lr=lr)
    assert len(stats) >= MIN_COMMITS and 4 in {st["window"] for st in stats}


class SynchronizingCopier(StreamCopier):
    """A copier that blocks the host on its own copy inside the hook: what the guard must catch."""

    def copy_async(self, sources, destinations, keepalive=(), route=None):  # type: ignore[no-untyped-def]
        ticket = super().copy_async(sources, destinations, keepalive, route)
        self.synchronize()
        return ticket


def test_the_guard_catches_a_host_sync_inside_our_hooks(tmp_path, rig):
    # The harness must be able to fail: a synchronization in the Checkpointer's own hooks
    # (global pre-hook first, post-hook last) raises under it.
    with pytest.raises(RuntimeError, match="synchroniz"):
        _loop_under_sync_errors(tmp_path, rig, 1, "replay", "foreach", grad_scaler=False, copier_cls=SynchronizingCopier)
