"""GPU fences: checkpoints taken while the side stream is held back still equal an uninterrupted twin run.

Marked ``gpu``; skipped without CUDA. Run on the GPU machine with
``pytest -m gpu tests/test_gpu.py tests/test_gpu_runtime.py`` (``benchmarks/gpu.sh``).

Each test trains the same seeded run twice, once with a Checkpointer and once without
(the twin), and compares the checkpoint with the twin's state at the checkpoint's
version: bit for bit for window 1 and stage mode, within ``replay_tolerance`` for
replay (the CPU replays what CUDA's kernels computed). The copiers are delayed by
about 100 ms on the side stream (``gpu_support.DelayedCopier``), so a fence that is
missing lets the next step, forward or ``zero_grad`` mutate a tensor before its copy
reads it; ``test_removing_fence_2_tears_the_checkpoint`` shows that it then fails.
Each test first asserts the precondition: the twin's state at the next step differs
from the one compared, so a copy of a later version could not pass.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt import Checkpointer, load

from gpu_support import (
    CUDA,
    REPLAY_ULPS_PER_STEP,
    DelayedCopier,
    ModelSpec,
    UnfencedCopier,
    checkpointed_run,
    error_report,
    make_run,
    mismatches,
    replay_tolerance,
    report_to,
    restored_state,
    twin_states,
)

pytestmark = pytest.mark.gpu

# Four 4096x4096 layers: 805 MB of fp32 state, a group of 201 MB at W=4, whose copy
# (about 4 ms at 50 GB/s) outlasts the next step's kernels (well under 1 ms) even
# without the delay. Without biases each of the 4 groups holds one whole layer.
DELAY_MODEL = ModelSpec(width=4096, depth=4)
# Four 2048x2048 layers, 201 MB: for the tests whose copies the delay alone holds back.
SMALL_MODEL = ModelSpec(width=2048, depth=4)
REQUEST_AT = 3

MODES = [
    pytest.param(1, "replay", id="w1"),
    pytest.param(4, "replay", id="replay4"),
    pytest.param(4, "stage", id="stage4"),
]


def _version(window: int, consistency: str) -> int:
    return REQUEST_AT + window - 1 if consistency == "replay" and window > 1 else REQUEST_AT


def _tolerance(window: int, consistency: str) -> float:
    return replay_tolerance(window) if consistency == "replay" and window > 1 else 0.0


@pytest.mark.parametrize("optimizer_kind", ["foreach", "fused"])
@pytest.mark.parametrize("window,consistency", MODES)
def test_delayed_copies_hold_the_twins_state(tmp_path, window, consistency, optimizer_kind, request):
    version, tol = _version(window, consistency), _tolerance(window, consistency)
    twin = twin_states(DELAY_MODEL, optimizer_kind, versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)  # a copy of the next version would show

    copier = DelayedCopier()
    (stats,) = checkpointed_run(
        tmp_path, DELAY_MODEL, optimizer_kind, steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency=consistency, copier=copier,
    )
    assert copier.delays >= window and copier.delays_off_side_stream == 0  # every group's copy was held back
    assert stats["step"] == version
    # The delay kept a copy in flight when the next step's pre-hook fenced it: the fence was exercised.
    assert stats["device_waits_in_flight"] >= 1
    restored = restored_state(tmp_path, DELAY_MODEL, optimizer_kind, version)
    assert mismatches(restored, twin[version], tol) == {}
    if tol:
        report_to(request, f"replay_w{window}_{optimizer_kind}_delayed", {
            "window": window, "replayed_steps_max": window - 1, "tolerance": tol,
            "errors": error_report(restored, twin[version]),
        })


@pytest.mark.parametrize("window,consistency", MODES)
def test_removing_fence_2_tears_the_checkpoint(tmp_path, window, consistency):
    # The same run as above with fence_compute inserting no wait: the next optimizer step
    # overwrites state that the held-back copy has not read yet. This is what the delay
    # tests would see if the engine lost the fence, so they can fail.
    version, tol = _version(window, consistency), _tolerance(window, consistency)
    twin = twin_states(SMALL_MODEL, "fused", versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)

    copier = UnfencedCopier()
    (stats,) = checkpointed_run(
        tmp_path, SMALL_MODEL, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency=consistency, copier=copier,
    )
    assert copier.fences_skipped >= 1 and copier.delays >= 1
    assert stats["step"] == version
    torn = mismatches(restored_state(tmp_path, SMALL_MODEL, "fused", version), twin[version], tol)
    assert any(k.startswith("model.") for k in torn), torn  # parameters copied at a later version


@pytest.mark.parametrize("window", [1, 4])
def test_batchnorm_running_stats_hold_the_twins_state(tmp_path, window):
    # The next forward updates running_mean/var before any fence of ours can run, so the
    # engine must clone the buffers on the compute stream; the delay makes a missing clone
    # read the next step's statistics.
    spec = ModelSpec(width=2048, depth=3, batchnorm=True)
    version, tol = _version(window, "replay"), _tolerance(window, "replay")
    twin = twin_states(spec, "fused", versions=(version, version + 1))
    moved = mismatches(twin[version + 1], twin[version])
    assert any("running_mean" in k for k in moved) and any("num_batches_tracked" in k for k in moved)

    copier = DelayedCopier()
    (stats,) = checkpointed_run(
        tmp_path, spec, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency="replay", copier=copier,
    )
    assert stats["step"] == version and copier.delays >= window
    restored = restored_state(tmp_path, spec, "fused", version)
    assert mismatches(restored, twin[version], tol) == {}
    buffers = {k: v for k, v in restored.items() if "running" in k or "num_batches" in k}
    assert buffers and mismatches(buffers, {k: twin[version][k] for k in buffers}) == {}  # captured, not replayed


def _step_reusing_freed_gradients(reused: list[bool]):
    """A training step that, after ``zero_grad(set_to_none=True)``, fills same-sized tensors with NaN.

    They are allocated on the compute stream right after the gradients were freed, so the
    caching allocator hands them the gradients' memory unless something still holds it: a
    gradient copy that read that memory afterwards would log NaN. ``reused`` records, per
    step, whether any NaN tensor landed in a gradient's memory.
    """
    garbage: list[torch.Tensor] = []

    def step(model, opt, x):
        garbage.clear()
        model(x).square().mean().backward()
        opt.step()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        shapes = [(g.shape, g.dtype) for g in grads]
        pointers = {g.data_ptr() for g in grads}
        del grads
        opt.zero_grad(set_to_none=True)
        garbage.extend(torch.full(shape, float("nan"), dtype=dtype, device=CUDA) for shape, dtype in shapes)
        reused.append(any(t.data_ptr() in pointers for t in garbage))

    return step


def test_replay_survives_freed_gradients_reused_on_the_compute_stream(tmp_path, request):
    window, version = 4, _version(4, "replay")
    twin_reused: list[bool] = []
    twin = twin_states(SMALL_MODEL, "fused", versions=(version, version + 1), step_fn=_step_reusing_freed_gradients(twin_reused))
    # Precondition: with nothing holding them, the freed gradients' memory is what the NaN tensors get.
    assert any(twin_reused)
    assert mismatches(twin[version + 1], twin[version], replay_tolerance(window))

    copier = DelayedCopier()
    (stats,) = checkpointed_run(
        tmp_path, SMALL_MODEL, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        step_fn=_step_reusing_freed_gradients([]), window=window, consistency="replay", copier=copier,
    )
    assert stats["step"] == version and copier.delays >= window
    restored = restored_state(tmp_path, SMALL_MODEL, "fused", version)
    assert mismatches(restored, twin[version], replay_tolerance(window)) == {}


def test_stage_staging_reuse_with_delayed_drains(tmp_path):
    # A checkpoint every 2 steps with W=4 and two slots: the next snapshot stages its groups
    # while the previous one's drains, held back on the side stream, still read staging. A
    # staging area reused (or freed and reallocated) before its drains landed would hand a
    # checkpoint the next snapshot's bytes.
    copier = DelayedCopier()
    stats = checkpointed_run(
        tmp_path, SMALL_MODEL, "fused", steps=12, window=4, consistency="stage", every=2, max_inflight=2, copier=copier,
    )
    versions = [st["step"] for st in stats]  # stage mode: the step each snapshot started at
    assert len(versions) >= 2, versions
    # At least two snapshots were open at once (the second started inside the first's window).
    assert any(b - a < 4 for a, b in zip(versions, versions[1:])), versions
    assert copier.delays >= 2 * len(versions)  # group 0 and at least one drain of each
    twin = twin_states(SMALL_MODEL, "fused", versions=versions)
    for v in versions:
        assert mismatches(restored_state(tmp_path, SMALL_MODEL, "fused", v), twin[v]) == {}, v


def test_replay_window_8_error_against_the_twin(tmp_path, request):
    # Eight 2048x2048 layers, one per group. Group 0 is replayed 7 steps, group 7 none.
    spec, window = ModelSpec(width=2048, depth=8), 8
    version, tol = _version(window, "replay"), replay_tolerance(window)
    stats = checkpointed_run(
        tmp_path, spec, "fused", steps=version + 2, request_at=[REQUEST_AT], window=window, consistency="replay",
    )
    assert [st["step"] for st in stats] == [version]
    twin = twin_states(spec, "fused", versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)
    restored = restored_state(tmp_path, spec, "fused", version)
    errors = error_report(restored, twin[version])
    report_to(request, "replay_w8_fused", {
        "window": window, "replayed_steps_max": window - 1, "tolerance": tol,
        "ulps_per_step_allowed": REPLAY_ULPS_PER_STEP, "errors": errors,
    })
    assert set(errors) == {"param_or_buffer", "exp_avg", "exp_avg_sq"}
    assert mismatches(restored, twin[version], tol) == {}, errors


# ---- earlier tests, kept ----------------------------------------------------------------


def _model(width: int, depth: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).cuda()


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


AUTO_MODEL = ModelSpec(width=512, depth=4, bias=True)


def test_auto_window_times_forward_backward_with_events_and_stays_exact(tmp_path):
    # The gap timer must read CUDA events on the compute stream (never synchronize) and the
    # second checkpoint must be chosen from a measured bandwidth; stage keeps version s exact,
    # with every copy held back so that a missing fence would show.
    model, opt, batch = make_run(AUTO_MODEL, "fused")
    with Checkpointer(model, opt, tmp_path, window="auto", consistency="stage", max_window=4, copier=DelayedCopier()) as ckpt:
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
    twin = twin_states(AUTO_MODEL, "fused", versions=(10,), step_fn=_step)
    assert mismatches(restored_state(tmp_path, AUTO_MODEL, "fused", 10), twin[10]) == {}


def test_replay_stays_correct_when_gradients_are_zeroed_in_place(tmp_path):
    # zero_grad(set_to_none=False) writes, in the next iteration, the tensors a gradient copy
    # reads: the copy, held back on the side stream, must still read the step's gradients.
    def step(model, opt, x):
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()

    window, version = 4, _version(4, "replay")
    twin = twin_states(AUTO_MODEL, "fused", versions=(version, version + 1), step_fn=step)
    assert mismatches(twin[version + 1], twin[version], replay_tolerance(window))
    (stats,) = checkpointed_run(
        tmp_path, AUTO_MODEL, "fused", steps=12, request_at=[REQUEST_AT], step_fn=step,
        window=window, consistency="replay", copier=DelayedCopier(),
    )
    assert stats["step"] == version
    restored = restored_state(tmp_path, AUTO_MODEL, "fused", version)
    assert mismatches(restored, twin[version], replay_tolerance(window)) == {}
