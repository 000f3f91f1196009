"""Shared pieces of the GPU tests: copiers that fail on purpose, models, twin runs, comparisons.

The copiers are real subclasses of ``CudaStreamCopier``, passed to the Checkpointer
with ``copier=``:

* ``DelayedCopier`` holds the side stream for about 100 ms after fence 1 (the side
  stream waited on the compute stream) and before the copies, with
  ``torch.cuda._sleep``. Without the fences that follow, the next optimizer step,
  the next forward or the next ``zero_grad`` then runs before the copy reads its
  source, so a missing fence tears the checkpoint on every run, not once in a while.
* ``UnfencedCopier`` adds to that delay the removal of fence 2: ``fence_compute``
  inserts no wait. The tests assert that its checkpoints differ from the twin run,
  which shows the delay really exposes a missing fence.

Why 100 ms is deterministic enough: after a request, the host enqueues the next
iteration (forward, backward, optimizer step: tens of kernel launches, well under a
millisecond of host time) and the device runs it in a few milliseconds for the
models here; every kernel the loop uses was loaded by the steps before the request.
The side stream reads only after its sleep, so without fence 2 it reads a later
version with a margin of about 20x, even at a lowered SM clock (the sleep then
lasts longer, which widens the margin).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from overlapckpt import Checkpointer, load
from overlapckpt.train import transfer
from overlapckpt.train.transfer import CudaStreamCopier

CUDA = torch.device("cuda")

# torch.cuda._sleep spins one thread for this many SM clock cycles (clock64): about
# 100 ms at the H200's 1.98 GHz boost clock, longer at any lower clock.
H200_SM_CLOCK_HZ = 1.98e9
SIDE_STREAM_DELAY_CYCLES = int(0.1 * H200_SM_CLOCK_HZ)

# What fence_compute returns when it inserted no wait: FenceResult.NOT_NEEDED in the
# protocol that has FenceResult, False in the one before it.
NO_WAIT = transfer.FenceResult.NOT_NEEDED if hasattr(transfer, "FenceResult") else False

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
REPLAY_ULPS_PER_STEP = 8


def replay_tolerance(window_steps: int) -> float:
    """The largest relative error a replayed state may show after ``window_steps - 1`` replayed steps."""
    return (window_steps - 1) * REPLAY_ULPS_PER_STEP * FP32_ULP


class DelayedCopier(CudaStreamCopier):
    """Sleeps on the side stream after fence 1, before every batch of copies."""

    def __init__(self, device: torch.device = CUDA, delay_cycles: int = SIDE_STREAM_DELAY_CYCLES) -> None:
        super().__init__(device)
        self.delay_cycles = delay_cycles
        self.delays = 0  # how many batches of copies were delayed: 0 means the seam was never called
        self.delays_off_side_stream = 0  # a sleep on another stream would delay training, not the copy

    def after_side_stream_wait(self) -> None:
        if torch.cuda.current_stream(self.device).cuda_stream != self.side_stream.cuda_stream:
            self.delays_off_side_stream += 1
        torch.cuda._sleep(self.delay_cycles)
        self.delays += 1


class UnfencedCopier(DelayedCopier):
    """Fence 2 removed: the compute stream never waits for a copy before mutating what it reads."""

    def __init__(self, device: torch.device = CUDA, delay_cycles: int = SIDE_STREAM_DELAY_CYCLES) -> None:
        super().__init__(device, delay_cycles)
        self.fences_skipped = 0

    def fence_compute(self, ticket):  # type: ignore[no-untyped-def, override]
        self.fences_skipped += 1
        return NO_WAIT


@dataclass(frozen=True)
class ModelSpec:
    """A stack of square Linear layers (BatchNorm and ReLU between them if asked), built on the GPU."""

    width: int
    depth: int
    batchnorm: bool = False
    bias: bool = False  # without biases, each copy group holds whole layers
    batch: int = 32

    def state_nbytes(self) -> int:
        """fp32 parameters and AdamW's two moments (step counters and buffers left out)."""
        per_layer = self.width * self.width + (self.width if self.bias else 0)
        return 3 * 4 * self.depth * per_layer

    def build(self) -> nn.Module:
        torch.manual_seed(0)  # seeds the CUDA generator too: every build is the same model
        layers: list[nn.Module] = []
        with torch.device(CUDA):
            for i in range(self.depth):
                layers.append(nn.Linear(self.width, self.width, bias=self.bias))
                if self.batchnorm and i < self.depth - 1:
                    layers += [nn.BatchNorm1d(self.width), nn.ReLU()]
        return nn.Sequential(*layers)


OPTIMIZERS: dict[str, dict[str, bool]] = {"fused": {"fused": True}, "foreach": {"foreach": True}}


def make_run(spec: ModelSpec, optimizer_kind: str) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """Model, AdamW and a seeded batch stream: every call gives the same training run."""
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **OPTIMIZERS[optimizer_kind])
    gen = torch.Generator(device=CUDA).manual_seed(1)
    return model, opt, lambda: torch.randn(spec.batch, spec.width, device=CUDA, generator=gen)


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
    spec: ModelSpec, optimizer_kind: str, versions: Iterable[int], step_fn: StepFn = train_step
) -> dict[int, dict[str, torch.Tensor]]:
    """The uninterrupted run's state at each of ``versions`` (after that many optimizer steps)."""
    wanted = set(versions)
    model, opt, batch = make_run(spec, optimizer_kind)
    states = {}
    for s in range(1, max(wanted) + 1):
        step_fn(model, opt, batch())
        if s in wanted:
            states[s] = flat_state(model, opt)
    return states


def checkpointed_run(
    path: str,
    spec: ModelSpec,
    optimizer_kind: str,
    steps: int,
    *,
    request_at: Iterable[int] = (),
    step_fn: StepFn = train_step,
    **checkpointer_kwargs: object,
) -> list[dict[str, object]]:
    """Train ``steps`` steps with a Checkpointer (requests after the listed steps); its stats once all committed."""
    model, opt, batch = make_run(spec, optimizer_kind)
    requests = set(request_at)
    with Checkpointer(model, opt, path, **checkpointer_kwargs) as ckpt:
        for s in range(1, steps + 1):
            step_fn(model, opt, batch())
            if s in requests:
                ckpt.request()
            ckpt.step()
        ckpt.wait(timeout_s=300)
    return sorted(ckpt.stats, key=lambda st: st["step"])


def restored_state(path: str, spec: ModelSpec, optimizer_kind: str, version: int) -> dict[str, torch.Tensor]:
    """The checkpoint of ``version`` loaded into a fresh model and optimizer, as ``flat_state``."""
    model, opt, _ = make_run(spec, optimizer_kind)
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
    """Sync debug mode "error" from before the Checkpointer's pre-hook to after its post-hook.

    Register it before constructing the Checkpointer (``__init__`` adds the pre-hook,
    which then runs first) and call ``close_around`` after (the post-hook then runs
    last). The mode then covers every hook of every step, including where the loop
    must let torch synchronize: ``GradScaler.step`` with a non-fused optimizer reads
    ``found_inf`` with ``.item()`` before it calls ``optimizer.step()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.steps = 0
        self._saved: list[int] = []
        self._pre = optimizer.register_step_pre_hook(self._enter)
        self._post = None

    def close_around(self) -> None:
        self._post = self.optimizer.register_step_post_hook(self._exit)
        pre = list(self.optimizer._optimizer_step_pre_hooks.values())
        post = list(self.optimizer._optimizer_step_post_hooks.values())
        assert len(pre) >= 2 and pre[0] == self._enter, "the Checkpointer's pre-hook runs before the guard's"
        assert len(post) >= 2 and post[-1] == self._exit, "the Checkpointer's post-hook runs after the guard's"

    def remove(self) -> None:
        self._pre.remove()
        if self._post is not None:
            self._post.remove()

    def _enter(self, *args: object) -> None:
        self._saved.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode("error")

    def _exit(self, *args: object) -> None:
        torch.cuda.set_sync_debug_mode(self._saved.pop() if self._saved else 0)
        self.steps += 1


@contextlib.contextmanager
def sync_errors(enabled: bool = True) -> Iterator[None]:
    """Inside the block, any host synchronization with the GPU raises (sync debug mode "error")."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
