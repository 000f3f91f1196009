"""GPU fences: checkpoints taken while the side stream is held back still equal an uninterrupted twin run.

Marked ``device``: on CUDA where there is a device (``benchmarks/gpu.sh``), else on the
CUDA device emulated on the CPU, in ``make test`` (``gpu_support.Rig``). Marked ``gpu``:
needs real hardware, skipped without it.

Each test trains the same seeded run twice, once with a Checkpointer and once without
(the twin), and compares the checkpoint with the twin's state at the checkpoint's
version: bit for bit for window 1 and stage mode, and for replay of fused and foreach
AdamW (the CPU replays each param group by the arithmetic measured on its device,
train/consistency/replay_arithmetic.py); within ``replay_tolerance`` where the probe
does not measure the group (a tensor lr), and for the other optimizers. The copiers hold the side stream back
(``gpu_support.DelayedCopier``), so a fence that is missing lets the next step, forward
or ``zero_grad`` mutate a tensor before its copy reads it;
``test_removing_fence_2_tears_the_checkpoint`` shows that it then fails. Each test
first asserts the precondition: the twin's state at the next step differs from the one
compared, so a copy of a later version could not pass.
"""

from __future__ import annotations

import pytest
import torch

from overlapckpt import load
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.copying.stream_copier import StreamCopier

from gpu_support import (
    REPLAY_ULPS_PER_STEP,
    DelayedCopier,
    ModelSpec,
    UnfencedCopier,
    checkpointed_run,
    error_report,
    flat_state,
    make_run,
    mismatches,
    report_to,
    restored_state,
    sync_errors,
    train_step,
    twin_states,
)

pytestmark = pytest.mark.device

# Four 4096x4096 layers on CUDA: 805 MB of fp32 state, a group of 201 MB at W=4, whose copy
# (about 4 ms at 50 GB/s) outlasts the next step's kernels (well under 1 ms) even without
# the delay. Without biases each of the 4 groups holds one whole layer. (256 wide on the CPU.)
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


# Each param group is replayed by the arithmetic measured on its device (replay_arithmetic.py):
# CUDA's fused one (bit for bit on an H200 with torch 2.11) and CUDA's foreach one
# (foreach_adam_math.py; before it, the CPU's foreach kernels left 7.7% of parameters an ulp
# or more off on the H200). Window 1, stage and replay of both must be bit for bit; the error
# report records what was.
BIT_FOR_BIT = 0.0


def _made(copiers: list, cls, rig):
    """A copier factory that keeps what it built, so the test can read its counters."""

    def make(opt):
        copiers.append(cls(rig, opt))
        return copiers[-1]

    return make


@pytest.mark.parametrize("optimizer_kind", ["foreach", "fused"])
@pytest.mark.parametrize("window,consistency", MODES)
def test_delayed_copies_hold_the_twins_state(tmp_path, rig, window, consistency, optimizer_kind, request):
    spec = DELAY_MODEL.on(rig)
    version, tol = _version(window, consistency), BIT_FOR_BIT
    twin = twin_states(rig, spec, optimizer_kind, versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)  # a copy of the next version would show

    copiers: list[DelayedCopier] = []
    (stats,) = checkpointed_run(
        tmp_path, rig, spec, optimizer_kind, steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency=consistency, copier=_made(copiers, DelayedCopier, rig),
    )
    (copier,) = copiers
    assert copier.delays >= window and copier.delays_off_side_stream == 0  # every group's copy was held back
    assert stats["step"] == version
    # The delay kept a copy in flight when the next step's pre-hook fenced it: the fence was exercised.
    assert stats["device_waits_in_flight"] >= 1
    restored = restored_state(tmp_path, rig, spec, optimizer_kind, version)
    if consistency == "replay" and window > 1:  # recorded before the assertion, so a failure is in the report too
        report_to(request, f"replay_w{window}_{optimizer_kind}_delayed", {
            "window": window, "replayed_steps_max": window - 1, "tolerance": tol,
            "errors": error_report(restored, twin[version]),
        })
    assert mismatches(restored, twin[version], tol) == {}


@pytest.mark.parametrize("window,consistency", MODES)
def test_removing_fence_2_tears_the_checkpoint(tmp_path, rig, window, consistency):
    # The same run as above with fence_compute inserting no wait: the next optimizer step
    # overwrites state that the held-back copy has not read yet. This is what the delay
    # tests would see if the engine lost the fence, so they can fail.
    spec = SMALL_MODEL.on(rig)
    version, tol = _version(window, consistency), BIT_FOR_BIT
    twin = twin_states(rig, spec, "fused", versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)

    copiers: list[UnfencedCopier] = []
    (stats,) = checkpointed_run(
        tmp_path, rig, spec, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency=consistency, copier=_made(copiers, UnfencedCopier, rig),
    )
    (copier,) = copiers
    assert copier.fences_skipped >= 1 and copier.delays >= 1
    assert stats["step"] == version
    torn = mismatches(restored_state(tmp_path, rig, spec, "fused", version), twin[version], tol)
    assert any(k.startswith("model.") for k in torn), torn  # parameters copied at a later version


@pytest.mark.parametrize("window", [1, 4])
def test_batchnorm_running_stats_hold_the_twins_state(tmp_path, rig, window):
    # The next forward updates running_mean/var before any fence of ours can run, so the
    # engine must clone the buffers on the training stream; the delay makes a missing clone
    # read the next step's statistics.
    spec = ModelSpec(width=rig.scaled(2048), depth=3, batchnorm=True)
    # Within the roundings' tolerance: run on an H200 with the fused arithmetic before it was held to bit for bit.
    version, tol = _version(window, "replay"), rig.replay_tolerance(window)
    twin = twin_states(rig, spec, "fused", versions=(version, version + 1))
    moved = mismatches(twin[version + 1], twin[version])
    assert any("running_mean" in k for k in moved) and any("num_batches_tracked" in k for k in moved)

    copiers: list[DelayedCopier] = []
    (stats,) = checkpointed_run(
        tmp_path, rig, spec, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        window=window, consistency="replay", copier=_made(copiers, DelayedCopier, rig),
    )
    assert stats["step"] == version and copiers[0].delays >= window
    restored = restored_state(tmp_path, rig, spec, "fused", version)
    assert mismatches(restored, twin[version], tol) == {}
    buffers = {k: v for k, v in restored.items() if "running" in k or "num_batches" in k}
    assert buffers and mismatches(buffers, {k: twin[version][k] for k in buffers}) == {}  # captured, not replayed


def _step_reusing_freed_gradients(device, reused: list[bool]):
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
        garbage.extend(torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes)
        reused.append(any(t.data_ptr() in pointers for t in garbage))

    return step


@pytest.mark.gpu  # the gradients are the loop's own tensors: only CUDA's caching allocator reuses their memory
def test_replay_survives_freed_gradients_reused_on_the_compute_stream(tmp_path, rig, request):
    window, version = 4, _version(4, "replay")
    twin_reused: list[bool] = []
    twin = twin_states(
        rig, SMALL_MODEL, "fused", versions=(version, version + 1), step_fn=_step_reusing_freed_gradients(rig.device, twin_reused)
    )
    # Precondition: with nothing holding them, the freed gradients' memory is what the NaN tensors get.
    assert any(twin_reused)
    assert mismatches(twin[version + 1], twin[version], rig.replay_tolerance(window))

    copiers: list[DelayedCopier] = []
    (stats,) = checkpointed_run(
        tmp_path, rig, SMALL_MODEL, "fused", steps=REQUEST_AT + window + 1, request_at=[REQUEST_AT],
        step_fn=_step_reusing_freed_gradients(rig.device, []), window=window, consistency="replay",
        copier=_made(copiers, DelayedCopier, rig),
    )
    assert stats["step"] == version and copiers[0].delays >= window
    restored = restored_state(tmp_path, rig, SMALL_MODEL, "fused", version)
    assert mismatches(restored, twin[version], rig.replay_tolerance(window)) == {}


def test_stage_staging_reuse_with_delayed_drains(tmp_path, rig):
    # A checkpoint every 2 steps with W=4 and two slots: the next snapshot stages its groups
    # while the previous one's drains, held back on the side stream, still read staging. A
    # staging area reused (or freed and reallocated) before its drains landed would hand a
    # checkpoint the next snapshot's bytes.
    spec = SMALL_MODEL.on(rig)
    copiers: list[DelayedCopier] = []
    stats = checkpointed_run(
        tmp_path, rig, spec, "fused", steps=12, window=4, consistency="stage", every=2, max_inflight=2,
        copier=_made(copiers, DelayedCopier, rig),
    )
    versions = [st["step"] for st in stats]  # stage mode: the step each snapshot started at
    assert len(versions) >= 2, versions
    # At least two snapshots were open at once (the second started inside the first's window).
    assert any(b - a < 4 for a, b in zip(versions, versions[1:])), versions
    assert copiers[0].delays >= 2 * len(versions)  # group 0 and at least one drain of each
    twin = twin_states(rig, spec, "fused", versions=versions)
    for v in versions:
        assert mismatches(restored_state(tmp_path, rig, spec, "fused", v), twin[v]) == {}, v


def test_replay_window_8_error_against_the_twin(tmp_path, rig, request):
    # Eight 2048x2048 layers, one per group. Group 0 is replayed 7 steps, group 7 none. Fused AdamW:
    # replayed by CUDA's fused arithmetic, bit for bit (before it, through the CPU's fused kernel,
    # exp_avg_sq was 1.28e-5 off on an H200: 1 - float32(0.999) is not float32(1 - 0.999)).
    spec, window = ModelSpec(width=rig.scaled(2048), depth=8), 8
    version, tol = _version(window, "replay"), BIT_FOR_BIT
    stats = checkpointed_run(
        tmp_path, rig, spec, "fused", steps=version + 2, request_at=[REQUEST_AT], window=window, consistency="replay",
    )
    assert [st["step"] for st in stats] == [version]
    twin = twin_states(rig, spec, "fused", versions=(version, version + 1))
    assert mismatches(twin[version + 1], twin[version], tol)
    restored = restored_state(tmp_path, rig, spec, "fused", version)
    errors = error_report(restored, twin[version])
    report_to(request, f"replay_w8_fused_{rig.name}", {
        "window": window, "replayed_steps_max": window - 1, "tolerance": tol,
        "ulps_per_step_allowed": REPLAY_ULPS_PER_STEP, "errors": errors,
    })
    assert set(errors) == {"param_or_buffer", "exp_avg", "exp_avg_sq"}
    assert mismatches(restored, twin[version], tol) == {}, errors


def test_replay_of_a_tensor_lr_with_foreach_and_capturable(tmp_path, rig):
    # AdamW(foreach=True, capturable=True) takes a tensor lr on CUDA; the writer replays with
    # capturable off, where torch refuses a tensor lr with foreach.
    if not rig.is_cuda:
        pytest.skip("capturable=True runs only on a device (tests/test_multistep.py covers the replay's choice on CPU)")
    spec, window = ModelSpec(width=512, depth=4), 4
    version = _version(window, "replay")

    def run(ckpt=None):
        model = spec.build(rig)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=rig.device), foreach=True, capturable=True)
        gen = torch.Generator(device=rig.device).manual_seed(1)
        states = {}
        with (Checkpointer(model, opt, tmp_path, window=window, consistency="replay") if ckpt else _null()) as c:
            for s in range(1, version + 2):
                train_step(model, opt, torch.randn(spec.batch, spec.width, device=rig.device, generator=gen))
                if c is not None:
                    if s == REQUEST_AT:
                        c.request()
                    c.step()
                states[s] = flat_state(model, opt)
            if c is not None:
                c.wait(timeout_s=300)
        return states, model, opt

    twin, _, _ = run()
    run(ckpt=True)
    model = spec.build(rig)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=rig.device), foreach=True, capturable=True)
    load(str(tmp_path), model, opt, step=version)
    assert mismatches(flat_state(model, opt), twin[version], rig.replay_tolerance(window)) == {}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---- earlier tests, kept ----------------------------------------------------------------


def _model(rig, width: int, depth: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(rig.device)


def test_copy_longer_than_the_step_is_still_exact(tmp_path, rig):
    # On CUDA 2 x 8192^2 fp32 params + 2 Adam moments: ~1.5 GiB, far more than a tiny step's copy budget.
    width = rig.scaled(8192)
    model = _model(rig, width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    copier = None if rig.is_cuda else StreamCopier(rig.seam(opt))
    x = torch.randn(8, width, device=rig.device)

    def step():
        model(x).square().mean().backward()
        # The hooks run inside opt.step(); host synchronizations there raise.
        with sync_errors(rig, copier):
            opt.step()
        opt.zero_grad(set_to_none=True)

    with Checkpointer(model, opt, tmp_path, copier=copier) as ckpt:
        step()
        ckpt.request()
        reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        moments = {k: v.cpu().clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
        # The next step's update would overwrite the state mid-copy without the fence.
        for _ in range(3):
            step()
        ckpt.wait(timeout_s=600)
        assert ckpt.stats[0]["device_waits_inserted"] >= 1  # the next step's pre-hook fenced the copy
    fresh = _model(rig, width)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3, foreach=True)
    load(str(tmp_path), fresh, fresh_opt)
    for k, v in reference.items():
        assert torch.equal(fresh.state_dict()[k].cpu(), v), k
    for k, v in moments.items():
        assert torch.equal(fresh_opt.state[next(iter(fresh.parameters()))][k].cpu(), v), k


AUTO_MODEL = ModelSpec(width=512, depth=4, bias=True)


@pytest.mark.gpu  # CUDA's own events time forward+backward
def test_auto_window_times_forward_backward_with_events_and_stays_exact(tmp_path, rig):
    # The gap timer must read CUDA events on the compute stream (never synchronize) and the
    # second checkpoint must be chosen from a measured bandwidth; stage keeps version s exact,
    # with every copy held back so that a missing fence would show.
    model, opt, batch = make_run(rig, AUTO_MODEL, "fused")

    def step(model, opt, x):
        model(x).square().mean().backward()
        with sync_errors(rig, None):
            opt.step()
        opt.zero_grad(set_to_none=True)

    with Checkpointer(model, opt, tmp_path, window="auto", consistency="stage", max_window=4, copier=DelayedCopier(rig, opt)) as ckpt:
        assert type(engine_of(ckpt).parts.gap_timer).__name__ == "CudaGapTimer"
        for s in range(1, 15):
            step(model, opt, batch())
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
    twin = twin_states(rig, AUTO_MODEL, "fused", versions=(10,), step_fn=step)
    assert mismatches(restored_state(tmp_path, rig, AUTO_MODEL, "fused", 10), twin[10]) == {}


def _step_zeroing_gradients_in_place(model, opt, x):
    opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    opt.step()


def _replay_zeroing_gradients_in_place(tmp_path, rig, spec, optimizer_kind: str, window: int, steps: int, twin_versions=()):
    """A replay checkpoint while each iteration zeroes the gradients in place, drains held back:
    the twin's states at the version (and ``twin_versions``), and the restored state."""
    version = _version(window, "replay")
    twin = twin_states(rig, spec, optimizer_kind, versions=(version, *twin_versions), step_fn=_step_zeroing_gradients_in_place)
    (stats,) = checkpointed_run(
        tmp_path, rig, spec, optimizer_kind, steps=steps, request_at=[REQUEST_AT], step_fn=_step_zeroing_gradients_in_place,
        window=window, consistency="replay", copier=lambda opt: DelayedCopier(rig, opt),
    )
    assert stats["step"] == version
    return twin, version, restored_state(tmp_path, rig, spec, optimizer_kind, version)


def test_replay_stays_correct_when_gradients_are_zeroed_in_place(tmp_path, rig):
    # zero_grad(set_to_none=False) writes, in the next iteration, the tensors a gradient copy
    # reads: the copy, held back on the side stream, must still read the step's gradients.
    window = 4
    twin, version, restored = _replay_zeroing_gradients_in_place(
        tmp_path, rig, AUTO_MODEL.on(rig), "fused", window, steps=12, twin_versions=(_version(window, "replay") + 1,)
    )
    assert mismatches(twin[version + 1], twin[version], rig.replay_tolerance(window))
    assert mismatches(restored, twin[version], rig.replay_tolerance(window)) == {}


def test_replay_of_a_single_gradient_packed_clone_is_a_copy_not_a_view(tmp_path, rig):
    # Window 2 over two layers: the window's one logged step holds one layer's gradient, and
    # its packed clone is of one tensor, of which torch's flatten returns a view, not a copy.
    # Zeroed in place by the next iteration before the held-back drain reads it, a view would
    # log the next step's gradient.
    window = 2
    twin, version, restored = _replay_zeroing_gradients_in_place(
        tmp_path, rig, ModelSpec(width=512, depth=2).on(rig), "foreach", window, steps=8
    )
    assert mismatches(restored, twin[version], rig.replay_tolerance(window)) == {}
