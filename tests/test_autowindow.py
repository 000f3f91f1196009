"""window="auto": the tuner's rule, and the window a known workload gets."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from overlapckpt import load
from overlapckpt.errors import UnsupportedOptimizerError
from overlapckpt.seams import Checkpointer, engine_of
from overlapckpt.train.consistency.autowindow import AUTO_FILL_FRACTION, HostGapTimer, WindowTuner
from overlapckpt.train.copying.cpu_copier import CpuCopier
from overlapckpt.train.copying.layout import build_layout
from overlapckpt.train.copying.plan import make_plan
from overlapckpt.train.copying.replay_tables import gradient_layout
from overlapckpt.train.copying.transfer import CopyTicket

LAYERS = 24
WIDTH = 64
PARAM_BYTES = LAYERS * WIDTH * WIDTH * 4  # float32, no biases: 393,216 bytes
UNIT_BYTES = 3 * WIDTH * WIDTH * 4 + 4  # parameter, exp_avg, exp_avg_sq, and the float32 step
FWD_BWD_S = 0.05  # simulated forward+backward per iteration
OPT_S = 0.03  # simulated optimizer step
COPY_BYTES_PER_S = 6_000_000.0  # simulated device-to-host bandwidth


class SimulatedClock:
    """A clock the test advances: forward+backward and copies take exactly what they are told."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class SimulatedBandwidthCopier(CpuCopier):
    """Copies for real, and takes nbytes / bandwidth on the simulated clock."""

    def __init__(self, clock: SimulatedClock, bytes_per_s: float) -> None:
        self.clock = clock
        self.bytes_per_s = bytes_per_s

    def copy_async(self, sources, destinations, keepalive=None, route=None) -> CopyTicket:
        ticket = super().copy_async(sources, destinations, keepalive, route)
        ticket.enqueued_at_s = self.clock()
        ticket.copy_s = ticket.nbytes / self.bytes_per_s
        self.clock.advance(ticket.copy_s)
        ticket.landed_at_s = self.clock()
        return ticket


class Chain(nn.Module):
    """Equal square layers, so the groups of every window that divides 24 hold equal bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


# ---- the rule, on figures given directly ------------------------------------------------


def _even(total: int, gradient_bytes: int = 0):
    """A window's schedule: equal groups, and gradient_bytes more per step after the first."""
    return lambda w: [(total // w, i * gradient_bytes // w) for i in range(w)]


def test_first_choice_without_a_bandwidth_is_the_widest_window():
    tuner = WindowTuner(max_window=6)
    tuner.observe_compute_gap(0.1)
    choice = tuner.choose(_even(1000), lambda w: True)
    assert (choice.window_steps, choice.copy_bytes_per_s, choice.fwd_bwd_s) == (6, None, 0.1)
    assert choice.reason.startswith("no copy bandwidth measured yet")


def test_smallest_window_that_fits_and_the_median_gap():
    tuner = WindowTuner(max_window=8)
    for gap in (0.1, 0.1, 5.0):  # one slow step does not move the median
        tuner.observe_compute_gap(gap)
    tuner.observe_copies(nbytes=1000, seconds=1.0)  # 1,000 B/s: 0.08 s of copy = 80 bytes per step
    choice = tuner.choose(_even(1000), lambda w: True)
    assert choice.fwd_bwd_s == 0.1
    # Nothing fits; the least stall is 8 x (125 B / 1000 B/s - 0.1 s) = 0.2 s, at W=8.
    assert choice.window_steps == 8 and choice.candidates[7]["estimated_stall_s"] == pytest.approx(0.2)
    assert choice.reason.startswith("no window up to max_window=8 hides every copy")
    tuner.observe_copies(nbytes=3000, seconds=1.0)  # the newest bandwidth replaces the old: 240 bytes per step
    choice = tuner.choose(_even(1000), lambda w: True)
    assert choice.window_steps == 5  # 1000 // 4 = 250 > 240, 1000 // 5 = 200 <= 240
    assert [c["window_steps"] for c in choice.candidates] == list(range(1, 9))
    assert choice.candidates[4] == {
        "window_steps": 5, "largest_group_bytes": 200, "largest_gradient_bytes": 0, "fits": True, "estimated_stall_s": 0.0,
    }
    assert choice.candidates[3]["fits"] is False


def test_window_one_when_the_copy_already_fits_and_disallowed_windows_are_skipped():
    tuner = WindowTuner(max_window=8)
    tuner.observe_compute_gap(1.0)
    tuner.observe_copies(nbytes=10_000, seconds=1.0)
    assert tuner.choose(_even(1000), lambda w: True).window_steps == 1
    tuner.observe_copies(nbytes=300, seconds=1.0)  # 240 bytes per step: 5 would fit, but only 1..3 are allowed
    choice = tuner.choose(_even(1000), lambda w: w <= 3)
    assert [c["window_steps"] for c in choice.candidates] == [1, 2, 3]
    assert choice.window_steps == 3


def test_gradients_are_held_against_the_optimizer_step_not_forward_backward():
    tuner = WindowTuner(max_window=4)
    tuner.observe_compute_gap(1.0)  # forward+backward hides 1,000 bytes at 1,000 B/s (800 within the margin)
    tuner.observe_optimizer_step(0.01)  # the optimizer step hides 10 bytes
    tuner.observe_copies(nbytes=1000, seconds=1.0)
    choice = tuner.choose(_even(1000, gradient_bytes=100), lambda w: True)
    # W=1: one group of 1,000 B is 1.0 s, past the margin but not past forward+backward: no stall.
    # W=2: 500 B groups fit, but its 50 B of gradients take 0.05 s in a 0.01 s step: 0.04 s of stall.
    assert [c["fits"] for c in choice.candidates] == [False] * 4
    assert choice.candidates[0]["estimated_stall_s"] == 0.0
    assert choice.candidates[1]["estimated_stall_s"] == pytest.approx(0.04)
    assert choice.window_steps == 1
    assert choice.optimizer_step_s == 0.01


# ---- the engine, on a workload with known step time and copy cost --------------------------


def _run_auto(tmp_path, consistency: str) -> tuple[list[dict], dict[int, tuple[dict, dict]], Chain, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    clock = SimulatedClock()
    states: dict[int, tuple[dict, dict]] = {}
    # The step's own time: a post-hook registered before the Checkpointer's runs before its
    # post-hook, inside the span from the update point to the step's end.
    opt.register_step_post_hook(lambda *args: clock.advance(OPT_S))
    ckpt = Checkpointer(
        model, opt, tmp_path, window="auto", consistency=consistency, max_window=8,
        copier=SimulatedBandwidthCopier(clock, COPY_BYTES_PER_S), phase_timer=HostGapTimer(clock),
    )
    try:
        for it in range(1, 27):
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clock.advance(FWD_BWD_S)  # forward+backward, as the workload defines it
            opt.step()
            states[it] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            if it in (3, 16):
                ckpt.request()
            ckpt.step()
            if it == 14:
                ckpt.wait(timeout_s=60)  # the first has committed before the second is requested
        ckpt.close(timeout_s=60)
    finally:
        ckpt.close(timeout_s=30)
    return ckpt.stats, states, model, opt


# At 6e6 B/s a unit (parameter + 2 moments + step) copies in 8.19 ms, a gradient in 2.73 ms.
# stage: only group 0 is fenced; within 0.8 x 50 ms = 40 ms it may hold 4 units, so W=6
#        (W=5's group 0 holds 5 units: 41 ms).
# replay: no window fits (the last step's gradients, >= 12 of them, outlast 0.8 x 30 ms);
#        the least stall is W=4: groups of 6 units (49.2 ms) fit in 50 ms, and gradients
#        of 12 and 18 parameters stall 32.8 - 30 and 49.2 - 30 ms: 21.9 ms in all.
EXPECTED = {"stage": (6, 0.0), "replay": (4, (12 * 16384 + 18 * 16384) / COPY_BYTES_PER_S - 2 * OPT_S)}


@pytest.mark.parametrize("consistency", ["stage", "replay"])
def test_auto_window_on_a_known_workload(tmp_path, consistency):
    assert 0.8 == AUTO_FILL_FRACTION  # the margins in EXPECTED's comment
    stats, states, _, _ = _run_auto(tmp_path, consistency)
    first, second = stats
    assert first["window"] == 8 and first["requested_step"] == 3
    assert first["ledger"]["window_choice"]["reason"].startswith("no copy bandwidth measured yet")
    assert first["ledger"]["window_choice"]["fwd_bwd_s"] == pytest.approx(FWD_BWD_S, rel=1e-9)

    window, stall_s = EXPECTED[consistency]
    choice = second["ledger"]["window_choice"]
    assert (second["window"], second["mode"], choice["window_steps"]) == (window, consistency, window)
    assert choice["fwd_bwd_s"] == pytest.approx(FWD_BWD_S, rel=1e-9)
    assert choice["optimizer_step_s"] == pytest.approx(OPT_S, rel=1e-9)
    assert choice["copy_bytes_per_s"] == pytest.approx(COPY_BYTES_PER_S, rel=1e-9)
    chosen = choice["candidates"][window - 1]
    assert chosen["estimated_stall_s"] == pytest.approx(stall_s, rel=1e-9, abs=1e-12)
    assert chosen["fits"] is (consistency == "stage")
    if consistency == "stage":
        assert chosen["largest_group_bytes"] == 4 * UNIT_BYTES and choice["candidates"][window - 2]["fits"] is False
    else:
        assert chosen["largest_gradient_bytes"] == 18 * WIDTH * WIDTH * 4
        assert all(c["estimated_stall_s"] > stall_s for c in choice["candidates"] if c["window_steps"] != window)

    # The choice is in the manifest on disk, and the checkpoint holds its version exactly.
    manifest = json.loads((tmp_path / os.path.basename(second["path"]) / "overlapckpt.json").read_text())
    assert manifest["ledger"]["window_choice"] == choice
    version = second["step"]
    assert version == (16 if consistency == "stage" else 16 + window - 1)
    torch.manual_seed(5)
    fresh = Chain()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=True)
    assert not torch.equal(fresh.layers[0].weight, states[version][0]["layers.0.weight"])
    load(tmp_path, fresh, fresh_opt, step=version)
    model_sd, opt_sd = states[version]
    for k, v in model_sd.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for pid, st in opt_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(fresh_opt.state_dict()["state"][pid][k], v), (pid, k)


def test_auto_with_replay_refuses_an_optimizer_it_cannot_replay(tmp_path):
    model = Chain()
    opt = torch.optim.LBFGS(model.parameters())
    with pytest.raises(UnsupportedOptimizerError, match=r"LBFGS cannot be replayed.*or 'auto' with consistency='stage'"):
        Checkpointer(model, opt, tmp_path, window="auto")


def test_a_wider_window_reuses_the_preallocated_gradient_buffer_and_both_checkpoints_are_exact(tmp_path):
    # Step phases change mid-run: with a 30 ms optimizer step, replay's least-stall window is
    # 4; once the step takes 200 ms the gradients fit and the smallest fitting window is 6
    # (group 0 within 40 ms needs 4 units). The gradient buffer was sized for max_window up
    # front, so the wider window allocates nothing inside a hook.
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    clock, opt_s = SimulatedClock(), [OPT_S]
    states: dict[int, tuple[dict, dict]] = {}
    opt.register_step_post_hook(lambda *args: clock.advance(opt_s[0]))  # the step's own time (see _run_auto)
    ckpt = Checkpointer(
        model, opt, tmp_path, window="auto", consistency="replay", max_window=8,
        copier=SimulatedBandwidthCopier(clock, COPY_BYTES_PER_S), phase_timer=HostGapTimer(clock),
    )
    engine_of(ckpt).parts.windows.tuner.observe_copies(nbytes=6_000_000, seconds=1.0)  # as if measured on an earlier checkpoint
    try:
        for it in range(1, 37):
            if it == 13:
                opt_s[0] = 0.2
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            clock.advance(FWD_BWD_S)
            opt.step()
            states[it] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            if it in (3, 27):
                ckpt.request()
            if it == 3:
                w4_buffer = engine_of(ckpt).parts.slots.slots[0].grad_buffer
            if it == 27:
                w6_buffer = engine_of(ckpt).parts.slots.slots[0].grad_buffer
            ckpt.step()
            if it == 12:
                ckpt.wait(timeout_s=60)
        ckpt.close(timeout_s=60)
    finally:
        ckpt.close(timeout_s=30)
    assert [s["window"] for s in ckpt.stats] == [4, 6]
    assert ckpt.stats[1]["ledger"]["window_choice"]["reason"].startswith("smallest window whose copies fit")
    assert [s["step"] for s in ckpt.stats] == [3 + 4 - 1, 27 + 6 - 1]
    assert engine_of(ckpt).parts.slots.slots == []  # released at close
    layout = build_layout(model, opt)
    w8_nbytes = gradient_layout(make_plan(layout.entries, 8), layout)[1]
    assert w6_buffer is w4_buffer and w4_buffer.nbytes == w8_nbytes
    for stats in ckpt.stats:
        version = stats["step"]
        torch.manual_seed(5)
        fresh = Chain()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, foreach=True)
        load(tmp_path, fresh, fresh_opt, step=version)
        model_sd, opt_sd = states[version]
        for k, v in model_sd.items():
            assert torch.equal(fresh.state_dict()[k], v), (version, k)
        for pid, st in opt_sd["state"].items():
            for k, v in st.items():
                assert torch.equal(fresh_opt.state_dict()["state"][pid][k], v), (version, pid, k)
