"""window="auto": the tuner's rule, and the window a known workload gets."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from overlapckpt import Checkpointer, UnsupportedOptimizerError, load
from overlapckpt.autowindow import AUTO_FILL_FRACTION, HostGapTimer, WindowTuner
from overlapckpt.transfer import CopyTicket, CpuCopier

LAYERS = 24
WIDTH = 64
PARAM_BYTES = LAYERS * WIDTH * WIDTH * 4  # float32, no biases: 393,216 bytes
UNIT_BYTES = 3 * WIDTH * WIDTH * 4 + 4  # parameter, exp_avg, exp_avg_sq, and the float32 step
FWD_BWD_S = 0.125  # simulated forward+backward per iteration
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

    def copy_async(self, sources, destinations, keepalive=None) -> CopyTicket:
        ticket = super().copy_async(sources, destinations, keepalive)
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


def test_first_choice_without_a_bandwidth_is_the_widest_window():
    tuner = WindowTuner(max_window=6)
    tuner.observe_compute_gap(0.1)
    choice = tuner.choose(lambda w: 1000 // w, lambda w: True)
    assert (choice.window_steps, choice.copy_bytes_per_s, choice.fwd_bwd_s) == (6, None, 0.1)
    assert choice.reason.startswith("no copy bandwidth measured yet")


def test_smallest_window_that_fits_and_the_median_gap():
    tuner = WindowTuner(max_window=8)
    for gap in (0.1, 0.1, 5.0):  # one slow step does not move the median
        tuner.observe_compute_gap(gap)
    tuner.observe_copies(nbytes=1000, seconds=1.0)  # 1,000 B/s: budget 0.08 s = 80 bytes per step
    choice = tuner.choose(lambda w: 1000 // w, lambda w: True)
    assert choice.fwd_bwd_s == 0.1
    assert choice.window_steps == 8  # 1000 // 8 = 125 > 80: nothing fits, and 8 copies the fewest
    assert choice.reason.startswith("no window up to max_window=8 hides the copy")
    tuner.observe_copies(nbytes=3000, seconds=1.0)  # the newest bandwidth replaces the old: 240 bytes per step
    choice = tuner.choose(lambda w: 1000 // w, lambda w: True)
    assert choice.window_steps == 5  # 1000 // 4 = 250 > 240, 1000 // 5 = 200 <= 240
    assert [c["window_steps"] for c in choice.candidates] == list(range(1, 9))
    assert choice.candidates[4] == {"window_steps": 5, "busiest_step_bytes": 200, "busiest_step_copy_s": 200 / 3000}


def test_window_one_when_the_copy_already_fits_and_disallowed_windows_are_skipped():
    tuner = WindowTuner(max_window=8)
    tuner.observe_compute_gap(1.0)
    tuner.observe_copies(nbytes=10_000, seconds=1.0)
    assert tuner.choose(lambda w: 1000 // w, lambda w: True).window_steps == 1
    tuner.observe_copies(nbytes=300, seconds=1.0)  # 240 bytes per step: 5 would fit, but only 1..3 are allowed
    choice = tuner.choose(lambda w: 1000 // w, lambda w: w <= 3)
    assert [c["window_steps"] for c in choice.candidates] == [1, 2, 3]
    assert choice.window_steps == 3


def test_no_gradient_copy_fits_then_the_fewest_bytes_win_not_the_widest():
    tuner = WindowTuner(max_window=8)
    tuner.observe_compute_gap(1.0)
    tuner.observe_copies(nbytes=1, seconds=1.0)
    per_step = {1: 300, 2: 200, 3: 167, 4: 150, 5: 160, 6: 170, 7: 180, 8: 190}
    assert tuner.choose(per_step.__getitem__, lambda w: True).window_steps == 4


# ---- the engine, on a workload with known step time and copy cost --------------------------


def _run_auto(tmp_path, consistency: str) -> tuple[list[dict], dict[int, tuple[dict, dict]], Chain, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Chain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1))
    clock = SimulatedClock()
    states: dict[int, tuple[dict, dict]] = {}
    ckpt = Checkpointer(model, opt, tmp_path, window="auto", consistency=consistency, max_window=8)
    ckpt._engine.copier = SimulatedBandwidthCopier(clock, COPY_BYTES_PER_S)
    ckpt._engine.gap_timer = HostGapTimer(clock)
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


# Budget per step: 0.8 x 0.125 s x 6e6 B/s = 600,000 bytes.
#   stage:  W=1 copies 24 units = 1,179,744 B; W=2 copies 12 units = 589,872 B  -> W=2
#   replay: W=2 step 1: 12 units + 12 gradients = 786,480 B; W=3 step 2: 8 units + 16 gradients
#           = 655,392 B; W=4 step 3: 6 units + 18 gradients = 589,848 B           -> W=4
EXPECTED = {"stage": (2, 12 * UNIT_BYTES), "replay": (4, 6 * UNIT_BYTES + 18 * PARAM_BYTES // LAYERS)}


@pytest.mark.parametrize("consistency", ["stage", "replay"])
def test_auto_window_on_a_known_workload(tmp_path, consistency):
    assert 0.8 == AUTO_FILL_FRACTION  # the budget in EXPECTED's comment
    stats, states, _, _ = _run_auto(tmp_path, consistency)
    first, second = stats
    assert first["window"] == 8 and first["requested_step"] == 3
    assert first["ledger"]["window_choice"]["reason"].startswith("no copy bandwidth measured yet")
    assert first["ledger"]["window_choice"]["fwd_bwd_s"] == pytest.approx(FWD_BWD_S, rel=1e-9)

    window, busiest = EXPECTED[consistency]
    choice = second["ledger"]["window_choice"]
    assert (second["window"], second["mode"], choice["window_steps"]) == (window, consistency, window)
    assert choice["fwd_bwd_s"] == pytest.approx(FWD_BWD_S, rel=1e-9)
    assert choice["copy_bytes_per_s"] == pytest.approx(COPY_BYTES_PER_S, rel=1e-9)
    chosen = choice["candidates"][window - 1]
    assert chosen["busiest_step_bytes"] == busiest
    assert choice["candidates"][window - 2]["busiest_step_copy_s"] > AUTO_FILL_FRACTION * FWD_BWD_S

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
