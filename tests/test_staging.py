"""Stage mode's staging region on the emulated device: one region, allocated outside the checkpoints' hooks.

The emulated device accounts device memory as CUDA's caching allocator would (a block is
held while any tensor on it lives), so these tests see what a GPU would hold.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlapckpt import ConfigError, load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import StreamCopier

WIDTH = 160  # 100 KiB per tensor: above the packing size, so the region dominates what is held
LAYER_STATE_BYTES = 3 * WIDTH * WIDTH * 4  # a weight and AdamW's two moments
REGION_BYTES = 3 * LAYER_STATE_BYTES  # groups 1..3 at W=4 (the step counters add 3 x 64 bytes)


def _run():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    x = torch.randn(8, WIDTH)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def _state(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, {k: v.clone() for p in opt.state for k, v in opt.state[p].items() if k == "step"}


def test_stage_mode_holds_one_staging_region_at_a_time(tmp_path):
    # A checkpoint every 2 steps at W=4 with two slots: the next snapshot stages while the
    # previous one is sent but not yet committed. A region freed once its drains landed,
    # while the sent snapshot's views still held it, made the next snapshot allocate a second one.
    model, opt, step = _run()
    dev = EmulatedDevice("held")
    twin = {}
    with Checkpointer(model, opt, tmp_path, window=4, consistency="stage", every=2, max_inflight=2,
                      copier=StreamCopier(dev)) as ckpt:
        for s in range(1, 13):
            step()
            twin[s] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.step()
        infos = ckpt.wait(timeout_s=120)
        peak = dev.max_memory_allocated()
    assert len(infos) >= 3, infos  # snapshots overlapped: each started inside the previous one's window
    assert peak >= REGION_BYTES  # the precondition: a region was held
    assert peak < 1.5 * REGION_BYTES, (peak, REGION_BYTES)
    for info in infos:
        fresh, fresh_opt, fresh_step = _run()
        fresh_step()
        load(str(tmp_path), fresh, fresh_opt, step=info.step)
        assert all(torch.equal(v, twin[info.step][k]) for k, v in fresh.state_dict().items()), info.step


def test_no_checkpoint_allocates_the_staging_region_inside_optimizer_step(tmp_path):
    # Allocating it inside a hook can raise out-of-memory inside optimizer.step(), or take
    # the caching allocator's free-and-retry path (a device synchronization).
    model, opt, step = _run()
    dev = EmulatedDevice("eager")  # every drain lands by the next poll: no request waits for a slot
    large_inside_step: dict[int, list[int]] = {}
    infos = []
    with Checkpointer(model, opt, tmp_path, window=4, consistency="stage", every=4, copier=StreamCopier(dev)) as ckpt:
        for s in range(1, 12):
            before = len(dev.allocations)
            step()
            large_inside_step[s] = [n for n in dev.allocations[before:] if n >= REGION_BYTES]
            ckpt.step()
            if s in (7, 11):  # the window closed: the slot is free for the next scheduled checkpoint
                infos += ckpt.wait(timeout_s=120)
    assert [i.step for i in infos] == [4, 8]
    # Once, when the first step made the state's size known (as the host slots are sized); never for a checkpoint.
    assert len(large_inside_step[1]) == 1 and all(not large_inside_step[s] for s in range(2, 12)), large_inside_step
    assert dev.free_and_retry == 0


def test_a_region_that_cannot_fit_is_refused_at_construction_naming_the_bytes(tmp_path):
    model, opt, step = _run()
    step()  # the state exists: the region is sized and checked at construction
    dev = EmulatedDevice("held")
    # The allocator's cache holds 20 freed blocks of 64 KiB: counted as available they would
    # make room, but a region of ~900 KiB does not fit in any of them (fragmentation).
    blocks = [dev.empty(64 * 1024) for _ in range(20)]
    del blocks
    dev.capacity_bytes = dev.reserved_bytes + REGION_BYTES - 1
    free_bytes, _ = dev.mem_get_info()
    with pytest.raises(ConfigError, match=rf"stage mode needs \d+ bytes of device memory for staging \(window 4\), but a new allocation can get only {free_bytes} bytes"):
        Checkpointer(model, opt, tmp_path, window=4, consistency="stage", copier=StreamCopier(dev))
    assert dev.free_and_retry == 0
