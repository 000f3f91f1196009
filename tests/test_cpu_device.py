"""The plain CPU device CPU training runs the copier on (train/copying/cpu_device.py), and which device a CPU run gets.

End to end, the tests that take the ``cpu_device`` fixture (test_checkpointer.py, test_multistep.py) run on it and
on the CUDA emulation alike, bit for bit against a twin.
"""

from __future__ import annotations

import threading

import pytest
import torch

from overlapckpt import ConfigError
from overlapckpt.train.copying.cpu_device import CpuDevice
from overlapckpt.train.copying.emulated_device import EmulatedDevice
from overlapckpt.train.copying.stream_copier import CPU_DEVICE_ENV, StreamCopier, make_copier


def test_cpu_training_gets_the_plain_device_and_the_tests_the_emulation(monkeypatch):
    monkeypatch.delenv(CPU_DEVICE_ENV, raising=False)
    copier = make_copier(torch.device("cpu"))
    assert isinstance(copier, StreamCopier) and type(copier.device) is CpuDevice
    assert not copier.pins_host_memory  # host memory: nothing to page-lock
    monkeypatch.setenv(CPU_DEVICE_ENV, "emulated")
    assert type(make_copier(torch.device("cpu")).device) is EmulatedDevice
    monkeypatch.setenv(CPU_DEVICE_ENV, "gpu")
    with pytest.raises(ConfigError, match=r"OVERLAPCKPT_CPU_DEVICE='gpu' is not a CPU device; use 'plain'"):
        make_copier(torch.device("cpu"))


def test_a_side_stream_runs_its_copies_in_order_on_a_worker_and_an_event_waits_for_them():
    device = CpuDevice()
    stream = device.new_stream()
    gate = threading.Event()
    ran_on: list[str] = []
    src, dst = torch.arange(1000, dtype=torch.float32), torch.zeros(1000)
    with device.stream_context(stream):
        stream.enqueue(lambda: (gate.wait(timeout=60), ran_on.append(threading.current_thread().name)))
        device.copy_([dst], [src])
        flat = device.flatten([src[:3], src[10:12]], torch.float32, 5)
    event = device.record_event(stream)
    assert not device.event_done(event) and not torch.equal(dst, src)  # held behind the first op: nothing ran yet
    gate.set()
    device.synchronize_event(event)
    assert torch.equal(dst, src) and torch.equal(flat, torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0]))
    assert ran_on and ran_on[0] != threading.current_thread().name
    device.close()


def test_a_failed_copy_is_raised_at_the_next_query_and_stays_raised():
    device = CpuDevice()
    stream = device.new_stream()
    with device.stream_context(stream):
        device.copy_([torch.zeros(3)], [torch.zeros(4)])  # the sizes differ: the op fails on the worker
    event = device.record_event(stream)
    with pytest.raises(RuntimeError):
        device.synchronize_event(event)
    with pytest.raises(RuntimeError):
        device.synchronize_event(device.record_event(stream))  # sticky, as a CUDA error is
    device.close()


def test_host_memory_figures_are_the_hosts():
    available, total = CpuDevice().mem_get_info()
    assert 0 < available <= total
    assert CpuDevice().empty(0).numel() == 0 and CpuDevice().empty(16).dtype == torch.uint8
