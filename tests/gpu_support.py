"""Shared pieces of the GPU tests: the device they run on, copiers that fail on purpose, models, twin runs.

The GPU tests run on a *rig*: the real CUDA device where there is one, else the CUDA
device emulated on the CPU (``overlapckpt.train.copying.emulated_device``), in ``make test``.
The copier is the same ``StreamCopier`` on both; only the device seam differs. Tests
marked ``device`` run on either rig; those marked ``gpu`` need real hardware (timing,
pinned pages, CUDA's own events and allocator) and are skipped without it.

The copiers are real subclasses of ``StreamCopier``, passed to the Checkpointer with
``copier=``:

* ``DelayedCopier`` holds the side stream back after fence 1 and before the copies.
  On CUDA it sleeps about 100 ms there (``torch.cuda._sleep``); on the emulated device
  the held schedule runs a copy only when something waits for it, the latest moment a
  stream could run it. Without the fences that follow, the next optimizer step, the next
  forward or the next ``zero_grad`` then runs before the copy reads its source, so a
  missing fence tears the checkpoint on every run, not once in a while.
* ``UnfencedCopier`` adds to that the removal of fence 2: ``fence_compute`` inserts no
  wait. The tests assert that its checkpoints differ from the twin run, which shows the
  delay really exposes a missing fence.

Why 100 ms is deterministic enough on CUDA: after a request, the host enqueues the next
iteration (forward, backward, optimizer step: tens of kernel launches, well under a
millisecond of host time) and the device runs it in a few milliseconds for the models
here. The side stream reads only after its sleep, so without fence 2 it reads a later
version with a margin of about 20x, even at a lowered SM clock.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from overlapckpt import load
from overlapckpt.seams import Checkpointer
from overlapckpt.train.copying import transfer
from overlapckpt.train.copying.emulated_device import EmulatedDevice, torch_cuda_placement
from overlapckpt.train.copying.stream_copier import StreamCopier

# torch.cuda._sleep spins one thread for this many SM clock cycles (clock64): about
# 100 ms at the H200's 1.98 GHz boost clock, longer at any lower clock.
H200_SM_CLOCK_HZ = 1.98e9
SIDE_STREAM_DELAY_CYCLES = int(0.1 * H200_SM_CLOCK_HZ)

NO_WAIT = transfer.FenceResult.NOT_NEEDED

# fp32 unit roundoff: one ulp of a value in [1, 2) is 2**-23, and for any value x,
# ulp(x) <= 2**-23 * |x|.
FP32_ULP = 2.0**-23
# Replay re-runs AdamW on the CPU; the twin ran CUDA's kernels. Per replayed step each
# of m, v and the parameter goes through 2-3 roundings whose order differs (the fused
# kernel contracts b*m + (1-b)*g into an FMA, torch's CPU ops use lerp/addcmul), so one
# step may differ by about 1 ulp of the element, and the differences add up at most
# linearly over the steps (m and v decay, the parameter moves by lr-sized updates, so
# nothing amplifies them). The figure compared is max|got - ref| / max|ref| per tensor,
# at most the elementwise relative error, but the tensor's largest element may shrink
# over the window (m by up to 0.9**7 ~ 0.48 when gradients shrink), hence x2; and x4
# for the 2-3 roundings per update. A torn copy or a step replayed wrongly is off by
# about one Adam update, lr/|w| ~ 1e-3/1.5e-2 ~ 7e-2 here: 4 orders of magnitude above.
# On the emulated device the twin ran the CPU's own kernels, which replay repeats: 0.
REPLAY_ULPS_PER_STEP = 8


@dataclass(frozen=True)
class Rig:
    """Where a GPU test runs: ``cuda`` (a real device) or ``emulated`` (the CPU model of one)."""

    name: str

    @property
    def is_cuda(self) -> bool:
        return self.name == "cuda"

    @property
    def device(self) -> torch.device:
        """Where the tests' models and batches live."""
        return torch.device("cuda") if self.is_cuda else torch.device("cpu")

    def scaled(self, width: int) -> int:
        """A layer width for this rig: the GPU's sizes are for PCIe and HBM, the CPU's for 2 cores."""
        return width if self.is_cuda else max(64, width // 16)

    def seam(self, optimizer: torch.optim.Optimizer | None = None, schedule: str = "held") -> Any:
        """The device seam: CUDA's, or the emulated one with torch's CUDA placement for ``optimizer``."""
        if self.is_cuda:
            from overlapckpt.train.copying.cuda_device import CudaDevice

            return CudaDevice(self.device)
        placement = torch_cuda_placement(optimizer) if optimizer is not None else None
        return EmulatedDevice(schedule, clone_is_cheap=True, host_resident=placement)

    def replay_tolerance(self, window_steps: int) -> float:
        """The largest relative error a replayed state may show after ``window_steps - 1`` replayed steps."""
        return (window_steps - 1) * REPLAY_ULPS_PER_STEP * FP32_ULP if self.is_cuda else 0.0

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def set_sync_errors(self, copier: StreamCopier | None, enabled: bool) -> None:
        """Host synchronizations raise (torch's sync debug mode "error"; the emulated device's twin of it)."""
        if self.is_cuda:
            torch.cuda.set_sync_debug_mode("error" if enabled else "default")
        elif copier is not None:
            copier.device.sync_debug_error = enabled

    def side_stream_idle(self, copier: StreamCopier) -> bool:
        side = copier.side_stream
        return bool(side.query()) if self.is_cuda else side.done_through(side.last_seq())


def current_rig() -> Rig:
    """CUDA where there is a device, else the emulated one (``OVERLAPCKPT_TEST_DEVICE=emulated`` forces it)."""
    if os.environ.get("OVERLAPCKPT_TEST_DEVICE") == "emulated" or not torch.cuda.is_available():
        return Rig("emulated")
    return Rig("cuda")


class DelayedCopier(StreamCopier):
    """Holds the side stream back after fence 1, before every batch of copies (see the module docstring)."""

    def __init__(self, rig: Rig, optimizer: torch.optim.Optimizer | None = None, delay_cycles: int = SIDE_STREAM_DELAY_CYCLES) -> None:
        super().__init__(rig.seam(optimizer))
        self.rig = rig
        self.delay_cycles = delay_cycles
        self.delays = 0  # how many batches of copies were delayed: 0 means the seam was never called
        self.delays_off_side_stream = 0  # a delay on another stream would hold training back, not the copy

    def after_side_stream_wait(self) -> None:
        if self.device.current_stream() is not self.side_stream and not (
            self.rig.is_cuda and self.device.current_stream().cuda_stream == self.side_stream.cuda_stream
        ):
            self.delays_off_side_stream += 1
        if self.rig.is_cuda:
            torch.cuda._sleep(self.delay_cycles)
        self.delays += 1


class UnfencedCopier(DelayedCopier):
    """Fence 2 removed: the training stream never waits for a copy before mutating what it reads."""

    def __init__(self, rig: Rig, optimizer: torch.optim.Optimizer | None = None, delay_cycles: int = SIDE_STREAM_DELAY_CYCLES) -> None:
        super().__init__(rig, optimizer, delay_cycles)
        self.fences_skipped = 0

    def fence_compute(self, ticket: transfer.CopyTicket) -> transfer.FenceResult:
        self.fences_skipped += 1
        return NO_WAIT


CopierFactory = Callable[[torch.optim.Optimizer], StreamCopier]


@dataclass(frozen=True)
class ModelSpec:
    """A stack of square Linear layers (BatchNorm and ReLU between them if asked), built on the rig."""

    width: int
    depth: int
    batchnorm: bool = False
    bias: bool = False  # without biases, each copy group holds whole layers
    batch: int = 32

    def on(self, rig: Rig) -> ModelSpec:
        """This spec at the rig's width."""
        return ModelSpec(rig.scaled(self.width), self.depth, self.batchnorm, self.bias, self.batch)

    def state_nbytes(self) -> int:
        """fp32 parameters and AdamW's two moments (step counters and buffers left out)."""
        per_layer = self.width * self.width + (self.width if self.bias else 0)
        return 3 * 4 * self.depth * per_layer

    def build(self, rig: Rig) -> nn.Module:
        torch.manual_seed(0)  # seeds the CUDA generator too: every build is the same model
        layers: list[nn.Module] = []
        with torch.device(rig.device):
            for i in range(self.depth):
                layers.append(nn.Linear(self.width, self.width, bias=self.bias))
                if self.batchnorm and i < self.depth - 1:
                    layers += [nn.BatchNorm1d(self.width), nn.ReLU()]
        return nn.Sequential(*layers)


OPTIMIZERS: dict[str, dict[str, bool]] = {"fused": {"fused": True}, "foreach": {"foreach": True}}


def make_run(rig: Rig, spec: ModelSpec, optimizer_kind: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """Model, AdamW and a seeded batch stream: every call gives the same training run."""
    model = spec.build(rig)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **OPTIMIZERS[optimizer_kind])
    gen = torch.Generator(device=rig.device).manual_seed(1)
    return model, opt, lambda: torch.randn(spec.batch, spec.width, device=rig.device, generator=gen)


StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor], None]


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Host copies of every tensor a checkpoint holds, by name: ``model.<key>``, ``optim.<param>.<key>``."""
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    names = {p: n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{names[p]}.{k}"] = v.detach().cpu().clone()
    return out


def twin_states(
    rig: Rig, spec: ModelSpec, optimizer_kind: str, versions: Iterable[int], step_fn: StepFn = train_step
) -> dict[int, dict[str, torch.Tensor]]:
    """The uninterrupted run's state at each of ``versions`` (after that many optimizer steps)."""
    wanted = set(versions)
    model, opt, batch = make_run(rig, spec, optimizer_kind)
    states = {}
    for s in range(1, max(wanted) + 1):
        step_fn(model, opt, batch())
        if s in wanted:
            states[s] = flat_state(model, opt)
    return states


def checkpointed_run(
    path: str,
    rig: Rig,
    spec: ModelSpec,
    optimizer_kind: str,
    steps: int,
    *,
    request_at: Iterable[int] = (),
    step_fn: StepFn = train_step,
    copier: CopierFactory | None = None,
    **checkpointer_kwargs: object,
) -> list[dict[str, object]]:
    """Train ``steps`` steps with a Checkpointer (requests after the listed steps); its stats once all committed.

    ``copier(optimizer)`` builds the copier; by default the rig's plain one (``None`` on CUDA:
    the Checkpointer's own default).
    """
    model, opt, batch = make_run(rig, spec, optimizer_kind)
    requests = set(request_at)
    if copier is not None:
        checkpointer_kwargs["copier"] = copier(opt)
    elif not rig.is_cuda:
        checkpointer_kwargs["copier"] = StreamCopier(rig.seam(opt, schedule="async"))
    with Checkpointer(model, opt, path, **checkpointer_kwargs) as ckpt:  # type: ignore[arg-type]
        for s in range(1, steps + 1):
            step_fn(model, opt, batch())
            if s in requests:
                ckpt.request()
            ckpt.step()
        ckpt.wait(timeout_s=300)
    return sorted(ckpt.stats, key=lambda st: st["step"])


def restored_state(path: str, rig: Rig, spec: ModelSpec, optimizer_kind: str, version: int) -> dict[str, torch.Tensor]:
    """The checkpoint of ``version`` loaded into a fresh model and optimizer, as ``flat_state``."""
    model, opt, _ = make_run(rig, spec, optimizer_kind)
    load(str(path), model, opt, step=version)
    return flat_state(model, opt)


def max_rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest absolute error relative to the reference tensor's largest magnitude (NaN if got has NaN)."""
    # fp32 is enough: the difference of two values within a factor 2 of each other is exact.
    got, ref = got.float(), ref.float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def mismatches(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tolerance: float = 0.0) -> dict[str, object]:
    """Tensors of ``got`` that differ from ``ref``: bit for bit when ``tolerance`` is 0, else by relative error.

    Step counters and integer tensors (num_batches_tracked) are always compared bit for bit.
    """
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    bad: dict[str, object] = {}
    for k, r in ref.items():
        g = got[k]
        if g.shape != r.shape or g.dtype != r.dtype:
            bad[k] = f"{g.dtype}{tuple(g.shape)} != {r.dtype}{tuple(r.shape)}"
        elif tolerance == 0 or not r.is_floating_point() or k.endswith(".step"):
            if not torch.equal(g, r):
                bad[k] = "differs"
        elif not torch.isfinite(g).all():
            bad[k] = "not finite"
        else:
            err = max_rel_error(g, r)
            if err > tolerance:
                bad[k] = err
    return bad


def error_report(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, object]:
    """Per kind of tensor (parameters, exp_avg, exp_avg_sq), the largest relative error and the share of equal bits."""
    kinds: dict[str, dict[str, float]] = {}
    for k, r in ref.items():
        if not r.is_floating_point() or k.endswith(".step"):
            continue
        kind = k.rsplit(".", 1)[1] if k.startswith("optim.") else "param_or_buffer"
        entry = kinds.setdefault(kind, {"max_rel_error": 0.0, "equal_elements": 0, "elements": 0})
        g = got[k]
        entry["max_rel_error"] = max(entry["max_rel_error"], max_rel_error(g, r))
        entry["equal_elements"] += int((g == r).sum().item())
        entry["elements"] += r.numel()
    for entry in kinds.values():
        entry["bit_identical_share"] = entry.pop("equal_elements") / max(1, entry.pop("elements"))
    return kinds


def report_to(request: object, name: str, entry: dict[str, object]) -> None:
    """Add ``entry`` under ``name`` to the ``--gpu-report`` JSON file, if one was asked for.

    Read and written whole at each call, so every test module adds to the same file and a
    run cut short by a timeout still leaves what it measured.
    """
    path = request.config.getoption("--gpu-report", default=None)  # type: ignore[attr-defined]
    if not path:
        return
    report: dict[str, object] = {}
    if os.path.exists(path):
        with open(path) as f:
            report = json.load(f)
    report[name] = entry
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


class SyncErrorsInHooks:
    """Host synchronizations raise from before the Checkpointer's pre-hook to after its post-hook.

    The Checkpointer's pre-hook is a *global* one that it moves to the front of all pre-hooks
    (global pre-hooks run before per-instance ones), and its post-hook is the optimizer's
    own. So the guard's are global too: ``close_around()``, called once the Checkpointer
    exists, moves the guard's pre-hook in front of it, and global post-hooks run after every
    per-instance one. The mode then covers every hook of every step, including where the
    loop must let torch synchronize: ``GradScaler.step`` with a non-fused optimizer reads
    ``found_inf`` with ``.item()`` before it calls ``optimizer.step()``.
    """

    def __init__(self, rig: Rig, optimizer: torch.optim.Optimizer) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.rig = rig
        self.optimizer = optimizer
        self.copier: StreamCopier | None = None
        self.steps = 0
        self._pre = register_optimizer_step_pre_hook(self._enter)
        self._post = register_optimizer_step_post_hook(self._exit)

    def close_around(self, copier: StreamCopier | None) -> None:
        from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

        self.copier = copier
        _global_optimizer_pre_hooks.move_to_end(self._pre.id, last=False)  # type: ignore[attr-defined]
        _global_optimizer_post_hooks.move_to_end(self._post.id)  # type: ignore[attr-defined]
        assert next(iter(_global_optimizer_pre_hooks)) == self._pre.id, "the guard's pre-hook runs first"
        assert list(_global_optimizer_post_hooks)[-1] == self._post.id, "the guard's post-hook runs last"
        assert len(_global_optimizer_pre_hooks) >= 2, "the Checkpointer's global pre-hook runs inside the guard"

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()

    def _enter(self, optimizer: Any, *args: object) -> None:
        if optimizer is self.optimizer:
            self.rig.set_sync_errors(self.copier, True)

    def _exit(self, optimizer: Any, *args: object) -> None:
        if optimizer is self.optimizer:
            self.rig.set_sync_errors(self.copier, False)
            self.steps += 1


@contextlib.contextmanager
def sync_errors(rig: Rig, copier: StreamCopier | None, enabled: bool = True) -> Iterator[None]:
    """Inside the block, any host synchronization with the device raises."""
    if not enabled:
        yield
        return
    rig.set_sync_errors(copier, True)
    try:
        yield
    finally:
        rig.set_sync_errors(copier, False)
