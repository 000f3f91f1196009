"""Which CPU arithmetic replays a fused Adam / AdamW step the way this run's device computed it.

Replay steps the optimizer on the CPU (``writer/replay.py``). A fused optimizer on a GPU ran
CUDA's fused kernel, whose roundings differ from the CPU's fused kernel by far more than an
ulp (``fused_adam_math.py``). Rather than guess from the torch version, this measures it
once per optimizer class and device, outside any training step: a few fused steps of a
small random state on the device, the same steps by each CPU candidate, and the candidate
whose state is bit for bit the device's wins; with none exact, the closest, and a warning.

Cost: one small fused step on the device and a host synchronization, once per process for
each (class, device), when the Checkpointer is built for replay. CPU training needs none:
the CPU's own fused kernel is what ran.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...fused_adam_math import (
    ARITHMETICS,
    EMULATED_DTYPES,
    decouples_weight_decay,
    step_like_cuda_fused_adam,
    torch_fused_adam_class,
)

log = logging.getLogger("overlapckpt")

# Sized so that every candidate that rounds differently shows it (thousands of elements, a
# spread of magnitudes), and small enough to cost a millisecond on the device.
_PROBE_ELEMENTS = 4096
_PROBE_STEPS = 3
_PROBE_HYPERPARAMETERS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
_measured: dict[tuple[type, str], str | None] = {}


def fused_device(optimizer_cls: type, param_groups: list[dict[str, Any]]) -> torch.device | None:
    """The accelerator this optimizer's fused Adam / AdamW groups step on, if any: the one to measure.

    None where replay keeps the CPU's kernel: no fused group on an accelerator, a subclass with
    its own ``step()`` (replay runs it as it is), or fused parameters on the CPU and an accelerator
    in one run (the log names one arithmetic for all; a warning says so).
    """
    if torch_fused_adam_class(optimizer_cls) is None:
        return None
    devices = {
        p.device
        for group in param_groups if group.get("fused")
        for p in group["params"] if p.dtype in EMULATED_DTYPES
    }
    accelerators = sorted((d for d in devices if d.type != "cpu"), key=str)
    if not accelerators:
        return None
    if len(accelerators) < len(devices) or len({d.type for d in accelerators}) > 1:
        log.warning(
            "replay of fused %s: its parameters step on %s; replay uses the CPU's fused kernel for all of them, "
            "whose roundings differ from an accelerator's by about 1e-5 in exp_avg_sq (docs/gpu.md)",
            optimizer_cls.__qualname__, sorted(str(d) for d in devices),
        )
        return None
    return accelerators[0]


def replay_arithmetic(optimizer_cls: type, param_groups: list[dict[str, Any]]) -> str | None:
    """The arithmetic replay uses for this optimizer's fused groups: a name from ``fused_adam_math``, or None (the CPU's kernel)."""
    device = fused_device(optimizer_cls, param_groups)
    if device is None:
        return None
    key = (optimizer_cls, str(device))
    if key not in _measured:
        try:
            _measured[key] = measure(optimizer_cls, device)
        except Exception as e:  # noqa: BLE001 - a measurement that cannot run must not stop training
            log.warning(
                "replay of fused %s on %s: could not measure the device's arithmetic (%s: %s); replay uses the CPU's "
                "fused kernel, whose roundings may differ from the device's (docs/gpu.md)",
                optimizer_cls.__qualname__, device, type(e).__name__, e,
            )
            _measured[key] = None
    return _measured[key]


def _state_after(optimizer_cls: type, device: torch.device, start: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state after ``grads`` stepped by ``optimizer_cls(fused=True)`` on ``device`` (a torch.optim class: no user hooks).

    ``start`` is copied, never stepped in place: on the CPU, ``.to(device)`` would return it
    itself, and the candidates measured after this one would start from the stepped state.
    """
    param = torch.nn.Parameter(start.to(device, copy=True))
    optimizer = optimizer_cls([param], fused=True, **_PROBE_HYPERPARAMETERS)
    for g in grads:
        param.grad = g.to(device, copy=True)
        optimizer.step()
    state = optimizer.state[param]
    return [t.detach().to("cpu", copy=True) for t in (param, state["exp_avg"], state["exp_avg_sq"])]


def _state_by_emulation(optimizer_cls: type, start: torch.Tensor, grads: list[torch.Tensor], arithmetic: str) -> list[torch.Tensor]:
    param = start.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(start), torch.zeros_like(start)
    step = torch.zeros((), dtype=torch.float32, device="cpu")
    # The class's own flags for these hyperparameters (AdamW decouples its weight decay, Adam not).
    group = optimizer_cls([torch.nn.Parameter(start[:1].clone())], **_PROBE_HYPERPARAMETERS).param_groups[0]
    decoupled = decouples_weight_decay(group, optimizer_cls)
    betas = _PROBE_HYPERPARAMETERS["betas"]
    for g in grads:
        step_like_cuda_fused_adam(
            [param], [g], [exp_avg], [exp_avg_sq], None, [step], lr=_PROBE_HYPERPARAMETERS["lr"], beta1=betas[0], beta2=betas[1],
            weight_decay=_PROBE_HYPERPARAMETERS["weight_decay"], eps=_PROBE_HYPERPARAMETERS["eps"], maximize=False,
            decoupled_weight_decay=decoupled, arithmetic=arithmetic,
        )
    return [param, exp_avg, exp_avg_sq]


def _differing_elements(got: list[torch.Tensor], ref: list[torch.Tensor]) -> int:
    return sum(int((g != r).sum()) for g, r in zip(got, ref))


def measure(optimizer_cls: type, device: torch.device) -> str | None:
    """Step a small random state with ``optimizer_cls(fused=True)`` on ``device`` and on each CPU candidate; the closest one."""
    torch_cls = torch_fused_adam_class(optimizer_cls)
    if torch_cls is None:
        raise ValueError(f"{optimizer_cls.__qualname__} is not torch's Adam or AdamW with its own step(): nothing to measure")
    optimizer_cls = torch_cls  # torch's own class: a user's subclass may hook its steps
    generator = torch.Generator().manual_seed(0)
    # Magnitudes over several decades, as a model's parameters and gradients have; float32 on the CPU
    # whatever torch's default dtype and device.
    on_cpu: dict[str, Any] = {"dtype": torch.float32, "device": "cpu"}
    start = torch.randn(_PROBE_ELEMENTS, generator=generator, **on_cpu) * torch.logspace(-3, 1, _PROBE_ELEMENTS, **on_cpu)
    grads = [
        torch.randn(_PROBE_ELEMENTS, generator=generator, **on_cpu) * torch.logspace(-4, 0, _PROBE_ELEMENTS, **on_cpu)
        for _ in range(_PROBE_STEPS)
    ]
    on_device = _state_after(optimizer_cls, device, start, grads)  # .to("cpu") synchronizes: once, outside any step
    candidates: dict[str | None, list[torch.Tensor]] = {name: _state_by_emulation(optimizer_cls, start, grads, name) for name in ARITHMETICS}
    try:
        candidates[None] = _state_after(optimizer_cls, torch.device("cpu"), start, grads)
    except RuntimeError as e:  # a torch without a CPU fused kernel: the emulation is the only candidate
        log.info("fused %s has no CPU kernel here (%s): replay measures the emulation alone", optimizer_cls.__qualname__, e)
    differing = {name: _differing_elements(state, on_device) for name, state in candidates.items()}
    # A tie goes to torch's own CPU kernel, then to the first emulation listed.
    best = min(differing, key=lambda name: (differing[name], name is not None, ARITHMETICS.index(name) if name else 0))
    total = 3 * _PROBE_ELEMENTS
    if differing[best]:
        log.warning(
            "replay of fused %s stepped on %s: no CPU arithmetic reproduces the device's bit for bit (%s differ of %d "
            "elements after %d steps); replay uses the closest, %s, and its state differs from the device's by roundings",
            optimizer_cls.__qualname__, device, differing, total, _PROBE_STEPS, best or "the CPU's fused kernel",
        )
    else:
        log.info("replay of fused %s stepped on %s: the CPU reproduces it with %s", optimizer_cls.__qualname__, device,
                 best or "the CPU's fused kernel")
    return best
