"""GPU paths: side-stream copies, device-side fences, no host synchronization in hooks.

Marked ``gpu``; skipped without CUDA. Run on the GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer, load

pytestmark = pytest.mark.gpu


def _model(width: int, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).cuda()


def _step(model, opt, x):
    model(x).square().mean().backward()
    # The hooks run inside opt.step(); sync debug mode "error" raises on any host
    # synchronization there (cudaStreamSynchronize, .item(), a blocking copy).
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.zero_grad(set_to_none=True)


def test_copy_runs_on_a_side_stream_without_host_sync(tmp_path):
    model = _model(1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(64, 1024, device="cuda")
    with Checkpointer(model, opt, tmp_path) as ckpt:
        _step(model, opt, x)
        torch.cuda.set_sync_debug_mode("error")
        try:
            ckpt.request()
            ckpt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for _ in range(3):
            _step(model, opt, x)
        side = ckpt._engine.copier.side_stream
        assert side != torch.cuda.current_stream()
        assert side.cuda_stream != torch.cuda.default_stream().cuda_stream
        (info,) = ckpt.wait(timeout_s=300)
        assert ckpt.stats[0]["device_waits_inserted"] >= 1
    assert info.step == 1


def test_copy_longer_than_the_step_is_still_exact(tmp_path):
    # 2 x 8192^2 fp32 params + 2 Adam moments: ~1.5 GiB, far more than a tiny step's copy budget.
    model = _model(8192)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(8, 8192, device="cuda")
    with Checkpointer(model, opt, tmp_path) as ckpt:
        _step(model, opt, x)
        ckpt.request()
        reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        moments = {k: v.cpu().clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
        # The next step's update would overwrite the state mid-copy without the fence.
        for _ in range(3):
            _step(model, opt, x)
        ckpt.wait(timeout_s=600)
        assert ckpt.stats[0]["device_waits_inserted"] >= 1  # the next step's pre-hook fenced the copy
    fresh = _model(8192)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3, foreach=True)
    load(str(tmp_path), fresh, fresh_opt)
    for k, v in reference.items():
        assert torch.equal(fresh.state_dict()[k].cpu(), v), k
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state[next(iter(fresh.parameters()))][k].cpu(), v), k


def _adamw_run(width, opt_kwargs):
    """A 4-layer model, its AdamW and a seeded batch generator: twin and checkpointed runs match."""
    model = _model(width, depth=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kwargs)
    gen = torch.Generator(device="cuda").manual_seed(1)
    return model, opt, lambda: torch.randn(32, width, device="cuda", generator=gen)


def _twin_states(width, steps, opt_kwargs, step=_step):
    model, opt, batch = _adamw_run(width, opt_kwargs)
    states = {}
    for s in range(1, steps + 1):
        step(model, opt, batch())
        states[s] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return states


def _max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute error relative to the reference tensor's largest magnitude."""
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _checkpointed(tmp_path, width, steps, request_at, window, consistency, opt_kwargs):
    model, opt, batch = _adamw_run(width, opt_kwargs)
    with Checkpointer(model, opt, tmp_path, window=window, consistency=consistency) as ckpt:
        for s in range(1, steps + 1):
            _step(model, opt, batch())
            if s == request_at:
                ckpt.request()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=300)
    fresh, fresh_opt, _ = _adamw_run(width, opt_kwargs)
    load(str(tmp_path), fresh, fresh_opt)
    return info, {k: v.detach().cpu() for k, v in fresh.state_dict().items()}


def test_stage_window_4_is_bit_exact(tmp_path):
    twin = _twin_states(512, 10, {"fused": True})
    info, restored = _checkpointed(tmp_path, 512, 10, 3, 4, "stage", {"fused": True})
    assert info.step == 3
    for k, v in twin[3].items():
        assert torch.equal(restored[k], v), k


def test_replay_window_4_fused_adamw_within_1e6(tmp_path, request):
    twin = _twin_states(512, 10, {"fused": True})
    info, restored = _checkpointed(tmp_path, 512, 10, 3, 4, "replay", {"fused": True})
    assert info.step == 6
    report = {}
    for k, v in twin[6].items():
        got = restored[k]
        rel = _max_rel_error(got, v)
        report[k] = {"max_rel_error": rel, "bit_identical_share": (got == v).float().mean().item()}
        assert rel <= 1e-6, (k, rel)
    out = request.config.getoption("--gpu-report", default=None)
    if out:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


def test_auto_window_times_forward_backward_with_events_and_stays_exact(tmp_path):
    # The gap timer must read CUDA events on the compute stream (never synchronize) and the
    # second checkpoint must be chosen from a measured bandwidth; stage keeps version s exact.
    model, opt, batch = _adamw_run(512, {"fused": True})
    twin = _twin_states(512, 14, {"fused": True})
    with Checkpointer(model, opt, tmp_path, window="auto", consistency="stage", max_window=4) as ckpt:
        assert type(ckpt._engine.gap_timer).__name__ == "CudaGapTimer"
        for s in range(1, 15):
            _step(model, opt, batch())
            if s in (3, 10):
                ckpt.request()
            ckpt.step()
            if s == 8:
                ckpt.wait(timeout_s=300)
        ckpt.wait(timeout_s=300)
        first, second = (st["ledger"]["window_choice"] for st in ckpt.stats)
    assert first["window_steps"] == 4 and first["copy_bytes_per_s"] is None
    assert first["fwd_bwd_s"] is not None and first["fwd_bwd_s"] > 0
    assert second["copy_bytes_per_s"] > 0 and 1 <= second["window_steps"] <= 4
    fresh, fresh_opt, _ = _adamw_run(512, {"fused": True})
    load(str(tmp_path), fresh, fresh_opt, step=10)
    for k, v in twin[10].items():
        assert torch.equal(fresh.state_dict()[k].detach().cpu(), v), k


def test_replay_stays_correct_when_gradients_are_zeroed_in_place(tmp_path):
    # zero_grad(set_to_none=False) writes, in the next iteration, the tensors a gradient copy
    # reads: the fence after the optimizer step must hold it until the copy landed.
    def step(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    twin = _twin_states(512, 12, {"fused": True}, step=step)
    model, opt, batch = _adamw_run(512, {"fused": True})
    with Checkpointer(model, opt, tmp_path, window=4, consistency="replay") as ckpt:
        for s in range(1, 13):
            step(model, opt, batch())
            if s == 3:
                ckpt.request()
            ckpt.step()
        (info,) = ckpt.wait(timeout_s=300)
    assert info.step == 6
    fresh, fresh_opt, _ = _adamw_run(512, {"fused": True})
    load(str(tmp_path), fresh, fresh_opt)
    for k, v in twin[6].items():
        assert _max_rel_error(fresh.state_dict()[k].detach().cpu(), v) <= 1e-6, k
