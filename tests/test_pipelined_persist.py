"""A window-1 checkpoint goes to the writer while its copies land (train/lifecycle/pipelined_persist.py).

Before: a snapshot's persist request went out once every copy had landed, and the writer's
write followed the copy (0.13 s of copy, then the write, for a 768 MiB state on 2 cores).
Now the copy goes in batches in slot order and the request goes out once the boundary is
final; the writer writes each entry once the landing page says its bytes are in the slot.

Checked here: the checkpoint is bit for bit the state (both CPU devices), its manifest
records the copy's figures, the writer writes entries before the last batch has landed
(a copier holds that batch until the writer's shard has grown: without pipelining it never
grows, and the check fails), a copy that fails abandons the checkpoint and the next one
commits, and the writer's wait itself (``writer/slot_landing.py``) refuses a page about
another request, an abandoned copy and a copy that stopped.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time

import pytest
import torch
from torch import nn

from overlapckpt import list_checkpoints, load
from overlapckpt import protocol as p
from overlapckpt.errors import CheckpointWriteError, InternalError
from overlapckpt.seams import Checkpointer
from overlapckpt.train.consistency import snapshot_copies
from overlapckpt.train.copying.cpu_device import CpuDevice
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.landing import LandedFigures, OwnedLandingPage
from overlapckpt.train.copying.stream_copier import StreamCopier
from overlapckpt.train.lifecycle.pipelined_persist import PIPELINED_PERSIST_ENV
from overlapckpt.writer import slot_landing
from overlapckpt.writer.slot_landing import SlotLanding

from helpers import assert_state_equal, make_run, snapshot, train_step

WRITTEN_WITHIN_S = 30.0


@pytest.fixture
def small_batches(monkeypatch):
    """Batches of 256 bytes: the tiny model's state is copied in several, as a large state is."""
    monkeypatch.setattr(snapshot_copies, "LANDING_BATCH_BYTES", 256)


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "overlapckpt.json")) as f:
        return json.load(f)


class GatedCopier(StreamCopier):
    """Holds an armed snapshot's first batch on the side stream until released: it still lands when its boundary is final."""

    def __init__(self, device: object) -> None:
        super().__init__(device)  # type: ignore[arg-type]
        self.armed = False
        self.batches = 0
        self.released = threading.Event()

    def arm(self) -> None:
        self.armed, self.batches = True, 0
        self.released.clear()

    def release(self) -> None:
        self.armed = False
        self.released.set()

    def after_side_stream_wait(self) -> None:
        if self.armed:
            self.batches += 1
            self.on_batch(self.batches)

    def on_batch(self, number: int) -> None:
        if number == 1:  # runs on the side stream, before this batch's copy
            self.device.current_stream().enqueue(lambda: self.released.wait(WRITTEN_WITHIN_S))


def _device(name: str) -> object:
    return EmulatedDevice() if name == "emulated" else CpuDevice()


def test_a_pipelined_checkpoint_is_the_state_bit_for_bit(tmp_path, cpu_device, small_batches):
    model, opt, sched, sampler = make_run(width=64)
    root = str(tmp_path)
    copier = GatedCopier(_device(cpu_device))
    expected = {}
    # The sampler's generator state is a tensor: on the CPU device it is read at the call; on CUDA's
    # emulation it would travel behind the held batch, and the request wait for it (not pipelined).
    stateful = {"sched": sched, "sampler": sampler} if cpu_device == "plain" else {"sched": sched}
    with Checkpointer(model, opt, root, lease=False, stateful=stateful, copier=copier) as ckpt:
        for step in range(1, 4):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            copier.arm()
            ckpt.request()
            expected[step] = (*snapshot(model, opt), sched.state_dict(), copy.deepcopy(sampler.state_dict()))
            ckpt.step()  # the boundary is final: the request goes out with its first batch still held
            copier.release()
            ckpt.wait(timeout_s=120)
        stats = list(ckpt.stats)
    assert [s["step"] for s in stats] == [1, 2, 3]
    assert all(s["pipelined"] for s in stats)
    for s in stats:
        manifest = _manifest(s["path"])
        # The writer took the copy's figures from the landing page once every byte had landed.
        assert manifest["stats"]["pipelined"] is True
        assert manifest["stats"]["copy_s"] == pytest.approx(s["copy_s"], abs=1e-9)
        assert manifest["stats"]["copied_nbytes"] == s["copied_nbytes"] > 0
        assert manifest["ledger"]["complete_s"] == pytest.approx(s["ledger"]["complete_s"], abs=1e-9)
        assert manifest["ledger"]["groups"][0]["landed_s"] == pytest.approx(s["ledger"]["groups"][0]["landed_s"], abs=1e-9)
        assert s["ledger"]["groups"][0]["landed_s"] > 0
    for step in (1, 3):
        fresh, fresh_opt, fresh_sched, fresh_sampler = make_run(seed=9, width=64)
        restored = {"sched": fresh_sched, "sampler": fresh_sampler} if cpu_device == "plain" else {"sched": fresh_sched}
        load(root, fresh, fresh_opt, step=step, stateful=restored)
        model_sd, opt_sd, sched_sd, sampler_sd = expected[step]
        assert_state_equal(model_sd, opt_sd, fresh, fresh_opt)
        assert fresh_sched.state_dict() == sched_sd
        if cpu_device == "plain":  # read at the call: the boundary's own generator state, bit for bit
            assert fresh_sampler.position == sampler_sd["position"]
            assert torch.equal(fresh_sampler.generator.get_state(), sampler_sd["generator"])


def test_turned_off_it_sends_once_every_copy_landed(tmp_path, monkeypatch, small_batches):
    monkeypatch.setenv(PIPELINED_PERSIST_ENV, "0")
    model, opt, sched, sampler = make_run(width=64)
    with Checkpointer(model, opt, str(tmp_path), lease=False) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.step()
        ckpt.request()
        expected = snapshot(model, opt)
        ckpt.wait(timeout_s=120)
        assert [s["pipelined"] for s in ckpt.stats] == [False]
    fresh, fresh_opt, _, _ = make_run(seed=9, width=64)
    load(str(tmp_path), fresh, fresh_opt)
    assert_state_equal(*expected, fresh, fresh_opt)


def _shard_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files if f.endswith(".distcp"))


class HoldsTheSecondBatch(GatedCopier):
    """Holds an armed snapshot's second batch on the side stream until the writer's shard grew past one entry."""

    def __init__(self, root: str, grown_bytes: int) -> None:
        super().__init__(EmulatedDevice())
        self.root = root
        self.grown_bytes = grown_bytes
        self.written_before_landing: bool | None = None

    def on_batch(self, number: int) -> None:
        if number == 2:
            self.device.current_stream().enqueue(self._hold)  # runs on the side stream, before this batch's copy

    def _hold(self) -> None:
        deadline = time.monotonic() + WRITTEN_WITHIN_S
        while time.monotonic() < deadline:
            if _shard_bytes(self.root) >= self.grown_bytes:
                self.written_before_landing = True
                return
            time.sleep(0.005)  # the writer's file, polled: no event crosses the two processes
        self.written_before_landing = False


def test_the_writer_writes_entries_before_the_last_batch_lands(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_copies, "LANDING_BATCH_BYTES", 1 << 20)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(3)])  # 1 MiB per tensor, 9 MiB of state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    root = str(tmp_path)
    copier = HoldsTheSecondBatch(root, grown_bytes=1 << 20)
    with Checkpointer(model, opt, root, lease=False, copier=copier) as ckpt:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        ckpt.step()
        copier.arm()
        ckpt.request()
        ckpt.step()
        expected = snapshot(model, opt)
        ckpt.wait(timeout_s=120)
        copier.release()
        assert [s["pipelined"] for s in ckpt.stats] == [True]
    # The first batch's entry reached the shard while the second batch was held on the side stream.
    assert copier.written_before_landing is True
    torch.manual_seed(5)
    fresh = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(3)])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load(root, fresh, fresh_opt)
    assert_state_equal(*expected, fresh, fresh_opt)


class FailsTheSecondBatch(GatedCopier):
    """Its landing fails for the second batch of an armed snapshot, as a copy engine's error would."""

    def __init__(self) -> None:
        super().__init__(EmulatedDevice())
        self.awaited: list[int] = []

    def await_landing(self, ticket, timeout_s):
        if self.batches and threading.current_thread().name == "overlapckpt-landing-publisher":
            if id(ticket) not in self.awaited:
                self.awaited.append(id(ticket))
            if len(self.awaited) == 2:
                raise RuntimeError("the copy engine failed on purpose")
        return super().await_landing(ticket, timeout_s)


def test_a_failed_copy_abandons_the_checkpoint_and_the_next_commits(tmp_path, small_batches):
    model, opt, sched, sampler = make_run(width=64)
    root = str(tmp_path)
    copier = FailsTheSecondBatch()
    with Checkpointer(model, opt, root, lease=False, copier=copier) as ckpt:
        train_step(model, opt, sched, sampler)
        ckpt.step()
        copier.arm()
        ckpt.request()
        ckpt.step()
        copier.release()
        with pytest.raises(CheckpointWriteError, match="abandoned by the training process while its copies landed"):
            ckpt.wait(timeout_s=120)
        copier.batches = 0
        assert list_checkpoints(root) == []
        train_step(model, opt, sched, sampler)
        ckpt.step()
        ckpt.request()
        expected = snapshot(model, opt)
        ckpt.wait(timeout_s=120)
    assert [i.step for i in list_checkpoints(root)] == [2]
    fresh, fresh_opt, _, _ = make_run(seed=9, width=64)
    load(root, fresh, fresh_opt)
    assert_state_equal(*expected, fresh, fresh_opt)


# ---- the writer's wait, on a page of this process ---------------------------------------


def _request(request_id: int) -> p.PersistRequest:
    return p.PersistRequest(
        request_id=request_id, buffer_id=1, plan_id=1, name="step-000000001", step=1, requested_step=1, mode="single",
        window=1, small_state={}, extra_state={}, ledger={"groups": [{"index": 0, "landed_s": None}], "complete_s": 0.5},
        stats={"copy_s": 0.0, "copied_nbytes": 0}, keep=None, run_id="run", landing_buffer_id=2,
    )


@pytest.fixture
def page():
    owned = OwnedLandingPage(buffer_id=2)
    yield owned
    owned.release()


def _buffers(page: OwnedLandingPage) -> dict[int, torch.Tensor]:
    return {1: torch.zeros(4096, dtype=torch.uint8), 2: page.buffer.tensor}


def test_the_wait_returns_once_the_bytes_are_published(page):
    page.open(7)
    req = _request(7)
    landing = SlotLanding.of(_buffers(page), req)
    assert landing is not None
    published = threading.Event()

    def publish() -> None:
        page.publish(1000)
        published.set()

    threading.Thread(target=publish).start()
    landing.wait_for(1000)
    assert published.is_set()
    page.finish(LandedFigures(copy_s=0.25, copied_nbytes=4096, landed_after_request_s=0.75))
    landing.wait_all()
    assert req.stats == {"copy_s": 0.25, "copied_nbytes": 4096}
    assert req.ledger == {"groups": [{"index": 0, "landed_s": 0.75}], "complete_s": 0.75}


def test_a_page_about_another_request_is_refused(page):
    page.open(8)
    with pytest.raises(InternalError, match=r"request 7\) came pipelined, but its landing page is about request 8"):
        SlotLanding.of(_buffers(page), _request(7))


def test_an_abandoned_copy_is_refused(page):
    page.open(7)
    landing = SlotLanding.of(_buffers(page), _request(7))
    assert landing is not None
    page.publish(64)
    landing.wait_for(64)
    page.abandon()
    with pytest.raises(CheckpointWriteError, match="checkpoint step-000000001 was abandoned by the training process"):
        landing.wait_for(128)


def test_a_copy_that_stopped_is_refused(page, monkeypatch):
    monkeypatch.setattr(slot_landing, "STALL_TIMEOUT_S", 0.05)
    page.open(7)
    landing = SlotLanding.of(_buffers(page), _request(7))
    assert landing is not None
    page.publish(64)
    with pytest.raises(CheckpointWriteError, match=r"no byte of its slot landed for 0 s \(64 of 128 needed\)"):
        landing.wait_for(128)
