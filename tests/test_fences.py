"""Every fence, driven through the CPU stream model: present, the snapshot is exact; removed, it tears.

``StreamCopier`` over the emulated device's held schedule runs a copy only once someone waits for
it: the latest moment a real stream could run it, so a missing fence lets the
mutation it guards run first on every run, not by chance. Each scenario first runs
with every fence (bit-exact against an uninterrupted twin), then with one fence
removed by a subclass, and the snapshot must then differ from the twin.

Fence 1 (the copy waits for the optimizer step that wrote the state) has no CPU
twin to remove: the host runs the step before the hook that enqueues the copy. The
GPU tests cover it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt import load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import StreamCopier
from overlapckpt.train.copying.transfer import CopyTicket, FenceResult

from helpers import make_run


class HeldCopier(StreamCopier):
    """The adversarial stream: a copy runs when waited for, no earlier."""

    def __init__(self) -> None:
        super().__init__(EmulatedDevice("held"))


class WithoutGroupFence(HeldCopier):
    """Fence 2 removed for the state copies: the next optimizer step does not wait for group 0."""

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        return FenceResult.NOT_NEEDED if ticket.group_index == 0 else super().fence_compute(ticket)


class WithoutGradientFence(HeldCopier):
    """Replay's gradient fence removed: the next iteration may write the gradients before they are read."""

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        return FenceResult.NOT_NEEDED if ticket.group_index is None else super().fence_compute(ticket)


class WithoutStagingFence(HeldCopier):
    """Fence 4 removed: a new snapshot overwrites the staging region under an earlier one's drains."""

    def fence_compute(self, ticket: CopyTicket) -> FenceResult:
        drain = ticket.group_index is not None and ticket.group_index > 0
        return FenceResult.NOT_NEEDED if drain else super().fence_compute(ticket)


class WithoutBufferClone(HeldCopier):
    """Fence 3 removed: buffers are copied in place, after the next forward has updated them."""

    def stage(self, sources):
        return list(sources)


def _train(model, opt, sched, sampler, steps, ckpt=None, request_at=(), set_to_none=True):
    states = {}
    for it in range(1, steps + 1):
        x, y = sampler.next_batch()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=set_to_none)  # False: the next backward writes gradients in place
        loss.backward()
        opt.step()
        sched.step()
        states[it] = (
            {k: v.clone() for k, v in model.state_dict().items()},
            {pid: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for pid, st in opt.state_dict()["state"].items()},
        )
        if ckpt is not None:
            if it in request_at:
                ckpt.request()
            ckpt.step()
    return states


def _differs(expected, model, opt) -> list[str]:
    """Names of the tensors that differ from ``expected`` (bit for bit)."""
    model_sd, opt_state = expected
    out = [k for k, v in model_sd.items() if not torch.equal(v, model.state_dict()[k])]
    for pid, st in opt_state.items():
        for k, v in st.items():
            if torch.is_tensor(v) and not torch.equal(v, opt.state_dict()["state"][pid][k]):
                out.append(f"optimizer.{pid}.{k}")
    return out


SCENARIOS = {
    # name: (Checkpointer settings, requests, steps, zero_grad set_to_none)
    "window-1": (dict(window=1), (3,), 6, True),
    "replay": (dict(window=3, consistency="replay"), (3,), 7, False),
    "stage-reuse": (dict(window=4, consistency="stage", every=2, max_inflight=2), (), 6, True),
}
# Which fence each removal takes away, and the scenario where only that fence guards the copy.
REMOVALS = [
    ("window-1", WithoutGroupFence),
    ("window-1", WithoutBufferClone),
    ("replay", WithoutGradientFence),
    ("stage-reuse", WithoutStagingFence),
]


def _checkpoint_run(tmp_path, scenario: str, copier_cls):
    settings, requests, steps, set_to_none = SCENARIOS[scenario]
    twin = _train(*make_run(), steps, set_to_none=set_to_none)
    model, opt, sched, sampler = make_run()
    copier = copier_cls()
    with Checkpointer(model, opt, tmp_path, stateful={"sched": sched}, copier=copier, **settings) as ckpt:
        _train(model, opt, sched, sampler, steps, ckpt, requests, set_to_none)
        infos = ckpt.wait(timeout_s=120)
        waits = sum(s["device_waits_in_flight"] for s in ckpt.stats)
    torn = {}
    for info in infos:
        fresh, fresh_opt, _, _ = make_run(seed=7)
        load(str(tmp_path), fresh, fresh_opt, step=info.step)
        torn[info.step] = _differs(twin[info.step], fresh, fresh_opt)
    return torn, waits


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_fence_in_place_gives_the_exact_state(tmp_path, scenario):
    torn, in_flight_waits = _checkpoint_run(tmp_path, scenario, HeldCopier)
    assert torn and all(not names for names in torn.values()), torn
    # The held stream really made the fences wait for copies still queued.
    assert in_flight_waits >= 1


@pytest.mark.parametrize("scenario, copier_cls", REMOVALS, ids=[c.__name__ for _, c in REMOVALS])
def test_removing_one_fence_tears_the_snapshot(tmp_path, scenario, copier_cls):
    torn, _ = _checkpoint_run(tmp_path, scenario, copier_cls)
    assert any(torn.values()), f"removing {copier_cls.__name__} left every checkpoint exact: {torn}"
    if copier_cls is WithoutBufferClone:
        assert all(name.startswith("norm.") for names in torn.values() for name in names)


def test_stream_copier_runs_copies_on_the_side_stream_in_order(tmp_path):
    copier = StreamCopier(EmulatedDevice("held"))
    src = [torch.full((1000,), float(i)) for i in range(3)]
    dst = [torch.zeros(1000) for _ in range(3)]
    tickets = [copier.copy_async([s], [d]) for s, d in zip(src, dst)]
    assert not any(copier.poll(t) for t in tickets)  # held: nothing ran
    assert all(torch.equal(d, torch.zeros(1000)) for d in dst)
    assert copier.fence_compute(tickets[1]) == FenceResult.WAITED_IN_FLIGHT
    # In order: waiting for the second ran the first too, and not the third.
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[1], src[1]) and torch.equal(dst[2], torch.zeros(1000))
    assert copier.poll(tickets[0]) and not copier.poll(tickets[2])
    copier.close()
    assert torch.equal(dst[2], src[2]) and copier.poll(tickets[2])


class DeviceValuesCopier(HeldCopier):
    """The held stream, where small values (a tensor lr) are device-resident too: their copies are deferred."""


class WithoutBoundaryValueClone(DeviceValuesCopier):
    """Fence 5 removed: a boundary value is copied from the live tensor, which scheduler.step() fills next."""

    def stage(self, sources):
        return list(sources)


@pytest.mark.parametrize("copier_cls, torn", [(DeviceValuesCopier, False), (WithoutBoundaryValueClone, True)])
def test_a_tensor_lr_is_captured_at_its_boundary(tmp_path, copier_cls, torn):
    """Window 1 with no ckpt.step(): the boundary is the post-hook, before scheduler.step() fills the lr tensor."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01), foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    x = torch.randn(16, 8)
    lr_at_post_hook = {}
    with Checkpointer(model, opt, tmp_path, copier=copier_cls()) as ckpt:
        for it in range(1, 5):
            model(x).square().mean().backward()
            opt.step()
            lr_at_post_hook[it] = float(opt.param_groups[0]["lr"])
            if it == 3:
                ckpt.request()
            sched.step()  # fills the lr tensor in place; the held copy has not run yet
            opt.zero_grad()
        (info,) = ckpt.wait(timeout_s=120)
    assert info.step == 3
    assert lr_at_post_hook[3] != float(opt.param_groups[0]["lr"])  # the precondition: the lr moved on
    fresh = nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=torch.tensor(0.5), foreach=False)
    load(str(tmp_path), fresh, fresh_opt)
    saved = float(fresh_opt.param_groups[0]["lr"])
    assert (saved != lr_at_post_hook[3]) == torn, (saved, lr_at_post_hook)
