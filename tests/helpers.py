"""Small models, training loops and comparisons shared by the tests."""

from __future__ import annotations

import copy
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class TinyNet(nn.Module):
    """Linear layers, BatchNorm (a buffer that forward mutates) and dropout."""

    def __init__(self, width: int = 16, features: int = 8, outputs: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.norm(self.inp(x)))))


class StatefulSampler:
    """A data source with its own generator and position: state a resume must restore."""

    def __init__(self, seed: int = 1234, features: int = 8, outputs: int = 4) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.position = 0
        self.features, self.outputs = features, outputs

    def next_batch(self, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        x = torch.randn(n, self.features, generator=self.generator)
        return x, x[:, : self.outputs] * 2.0

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.position = state["position"]


def make_run(seed: int = 0, optimizer: str = "adamw", width: int = 16, **opt_kwargs: Any):
    torch.manual_seed(seed)
    model = TinyNet(width)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    elif optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, **opt_kwargs)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4, **opt_kwargs)
    else:
        raise ValueError(optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    sampler = StatefulSampler()
    return model, opt, sched, sampler


def train_step(model, opt, sched, sampler, clip: float | None = 1.0, skip: bool = False) -> float:
    x, y = sampler.next_batch()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if not skip:  # a skipped step, as GradScaler does on inf: optimizer.step() is not called
        opt.step()
    sched.step()
    return float(loss.detach())


def snapshot(model, opt) -> tuple[dict, dict]:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def twin_states(steps: int, step_fn=None, **run_kwargs: Any) -> dict[int, tuple[dict, dict]]:
    """An uninterrupted run's (model, optimizer) state dicts after each step 1..steps (``step_fn``: train_step)."""
    step_fn = step_fn or train_step
    model, opt, sched, sampler = make_run(**run_kwargs)
    states = {}
    for it in range(1, steps + 1):
        step_fn(model, opt, sched, sampler)
        states[it] = snapshot(model, opt)
    return states


def assert_state_equal(model_sd: dict, opt_sd: dict, model, opt) -> None:
    """Bit-for-bit equality of a reference (model, optimizer) state with live objects."""
    live_m = model.state_dict()
    assert set(model_sd) == set(live_m)
    for k, v in model_sd.items():
        assert torch.equal(v, live_m[k]), f"model tensor {k} differs"
    live_o = opt.state_dict()
    assert set(opt_sd["state"]) == set(live_o["state"])
    for pid, st in opt_sd["state"].items():
        for k, v in st.items():
            w = live_o["state"][pid][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, w), f"optimizer state {pid}.{k} differs"
            else:
                assert v == w
    for g_ref, g_live in zip(opt_sd["param_groups"], live_o["param_groups"]):
        assert g_ref == g_live


def states_differ(model_sd: dict, model) -> bool:
    return any(not torch.equal(v, model.state_dict()[k]) for k, v in model_sd.items())


def closure_train_step(model, opt, sched, sampler, clip: float | None = 1.0) -> float:
    """One iteration as Lightning drives it: zero_grad, forward, backward and clipping inside step(closure)."""
    x, y = sampler.next_batch()

    def closure() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        return loss

    loss = opt.step(closure)
    sched.step()
    return float(loss.detach())


def tensors_that_differ(expected: tuple[dict, dict], model, opt) -> list[str]:
    """Names of the tensors of a (model, optimizer) state dict pair that differ, bit for bit, from live objects."""
    model_sd, opt_sd = expected
    live_m, live_o = model.state_dict(), opt.state_dict()["state"]
    out = [k for k, v in model_sd.items() if not torch.equal(v, live_m[k])]
    for pid, st in opt_sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v) and (k not in live_o.get(pid, {}) or not torch.equal(v, live_o[pid][k])):
                out.append(f"optimizer.{pid}.{k}")
    return out


def scaled_train_step(model, opt, sched, sampler, scaler) -> None:
    """One GradScaler step (the optimizer's fused path when it has one), then the scheduler."""
    x, y = sampler.next_batch()
    opt.zero_grad(set_to_none=True)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)  # a fused optimizer: GradScaler hands it grad_scale and found_inf
    scaler.update()
    sched.step()


def read_fifo_line(path: str, timeout_s: float) -> str:
    """The first line written into FIFO ``path``, or TimeoutError after ``timeout_s`` (no sleeps: select)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        deadline = time.monotonic() + timeout_s
        data = b""
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(0.0, remaining))
            if not readable:
                raise TimeoutError(f"nothing arrived on {path} within {timeout_s} s")
            data += os.read(fd, 64)
        return data.decode()
    finally:
        os.close(fd)


def exited_within(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` exits within ``timeout_s``: waits on a pidfd (no polling), and reaps nothing,
    so a parent's next look still sees the death."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def read_child_line(child: subprocess.Popen, timeout_s: float) -> str:
    """The child's next stdout line (a binary pipe), or AssertionError if none comes within ``timeout_s``."""
    fd = child.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert readable, f"the child printed no whole line within {timeout_s} s (so far {line!r})"
        byte = os.read(fd, 1)  # one byte at a time: nothing is buffered past the line
        assert byte, f"the child closed its output (so far {line!r})"
        line += byte
    return line.decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(worker: str, scenario: str, world_size: int, out: str, timeout_s: float) -> list[dict]:
    """Run ``worker SCENARIO OUT`` as ``world_size`` gloo ranks (torchrun's environment); each rank's OUT/rank<R>.json."""
    os.makedirs(out, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, worker, scenario, out], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return read_rank_results([os.path.join(out, f"rank{rank}.json") for rank in range(world_size)], outputs)


def write_rank_result_and_leave(path: str, scenario: Callable[[], dict]) -> None:
    """A worker rank's end: ``scenario()``'s result (or its traceback, as ``crashed``) to ``path``, for
    ``read_rank_results``; then a barrier, and ``os._exit(0)``: nothing is closed, as in a killed job, and
    gloo's teardown, which can abort at exit, never runs."""
    import traceback

    import torch.distributed as dist

    try:
        result = scenario()
    except BaseException:
        result = {"crashed": traceback.format_exc()}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    try:
        dist.barrier()
    finally:
        sys.stdout.flush()
        os._exit(0)


class LogLines(logging.Handler):
    """The messages of the records it is given, at INFO and above, in order."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def read_rank_results(paths: list[str], outputs: list[str]) -> list[dict]:
    """Each rank's result file, by rank; AssertionError naming a rank that wrote none (with the launch's output) or crashed."""
    results = []
    for rank, path in enumerate(paths):
        assert os.path.exists(path), f"rank {rank} wrote no result ({path}):\n" + "\n".join(o[-3000:] for o in outputs)
        with open(path) as f:
            result = json.load(f)
        assert "crashed" not in result, result.get("crashed")
        results.append(result)
    return results


def on_every_rank(world_size: int, run: Callable[[int], Any], timeout_s: float = 60.0) -> list[Any]:
    """``run(rank)`` for every rank at once, a thread each (ranks that meet in a store or a barrier); the answers in rank order.

    An exception in a rank's thread is raised again here, once every thread has ended.
    """
    answers: list[Any] = [None] * world_size

    def one(rank: int) -> None:
        try:
            answers[rank] = run(rank)
        except Exception as e:  # raised again in the caller's thread below
            answers[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), f"a rank's thread is still running after {timeout_s} s"
    for answer in answers:
        if isinstance(answer, Exception):
            raise answer
    return answers
