"""Which CPU arithmetic replays each optimizer param group the way its training device computed it, and how exactly.

Replay steps the optimizer on the CPU (``writer/replay.py``). A group that steps on a GPU runs
CUDA's kernels, whose roundings differ from the CPU's: fused Adam by about 1e-5 in
``exp_avg_sq`` (``fused_adam_math.py``), the default foreach path by an ulp in a tenth of the
elements (``foreach_adam_math.py``). Rather than guess from the torch version, this measures
each param group once, outside any training step, with the group's own hyperparameters and
dtypes: a few steps of a small random state on the device and by each CPU candidate (the
emulations of the group's path, and the CPU's own kernel), stepped by the very code the
writer runs (``device_adam_step.py``); the candidate whose state is bit for bit the device's
wins. With none exact, the closest, and a warning naming the group.

The probe covers what a model's groups meet: an odd length (the kernels' unaligned tails),
magnitudes over several decades and subnormal gradients, the group's weight decay, amsgrad,
maximize, capturable and dtypes, and step counts 1 to 3 then 9,999 and 10,000 (the bias
corrections' powers far from 1). Where the kernel computes its bias corrections on the device
(fused, capturable foreach), the device's ``pow(beta, k)`` is tabled there first
(``beta_powers.py``), and the emulations, the probe's and the writer's, take it.

Cost: a few small steps on the device and a host synchronization per distinct group
configuration, once per process, when the Checkpointer is built for replay. CPU training needs
none: the CPU's own kernel is what ran, so its groups are exact by construction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ...beta_powers import BetaPowerTables, powers_on
from ...device_adam_step import (
    DEVICE_POWER_PATHS,
    EMULATIONS,
    FOR_LOOP,
    FOREACH,
    FOREACH_CAPTURABLE,
    FUSED,
    OWN_STEP,
    replay_hyperparameters,
    step_like_the_device,
)
from ...float32_math import EMULATED_DTYPES
from ...format.manifest_records import GroupArithmetic
from ...fused_adam_math import torch_fused_adam_class

log = logging.getLogger("overlapckpt")

# An odd length: the vectorized kernels' unaligned tail is stepped too. Thousands of elements
# over several decades show every candidate that rounds differently, and cost a millisecond.
_PROBE_ELEMENTS = 4096 + 13
_SUBNORMAL_GRADIENTS = 16  # the first gradients of each step are subnormal float32 values
_FIRST_STEPS = 3  # step counts 1, 2, 3
_JUMP_TO_STEP = 9998  # then the count is set here, and 2 more steps take counts 9,999 and 10,000
_LATER_STEPS = 2
_measured: dict[tuple[Any, ...], tuple[str | None, int, int]] = {}
_device_powers: dict[tuple[str, float], torch.Tensor] = {}  # (device, beta): its pow(beta, k) table, computed once
_CANNOT_RUN = 1 << 62  # a candidate that cannot run here differs everywhere


@dataclass(frozen=True)
class _GroupConfiguration:
    """What decides a group's arithmetic: measured once per process for each distinct one."""

    torch_cls: type
    device: torch.device
    path: str
    dtypes: tuple[torch.dtype, ...]
    hyperparameters: tuple[tuple[str, Any], ...]  # the group's, as the probe's optimizer takes them

    def key(self) -> tuple[Any, ...]:
        return (self.torch_cls, str(self.device), self.path, self.dtypes, repr(self.hyperparameters))


def step_path(group: dict[str, Any], params: list[torch.Tensor]) -> str:
    """The implementation torch.optim's Adam / AdamW runs for ``group``: fused, foreach or the for-loop."""
    if group.get("fused"):
        return FUSED
    if group.get("differentiable"):
        return FOR_LOOP
    foreach = group.get("foreach")
    if foreach is None:  # as torch.optim.adam.adam() resolves it
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(params, False, use_fused=False)
        if foreach and isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"):
            foreach = False
    if not foreach:
        return FOR_LOOP
    return FOREACH_CAPTURABLE if group.get("capturable") else FOREACH


def group_arithmetics(optimizer_cls: type, param_groups: list[dict[str, Any]]) -> tuple[list[GroupArithmetic], BetaPowerTables]:
    """Each param group's replay arithmetic and how exact it is, and the device's power tables those arithmetics take.

    A sync per new configuration: call it outside any step.
    """
    torch_cls = torch_fused_adam_class(optimizer_cls)
    powers = BetaPowerTables()
    records = [_group_arithmetic(optimizer_cls, torch_cls, index, group, powers) for index, group in enumerate(param_groups)]
    return records, powers


def device_power_tables(device: torch.device, betas: list[float], into: BetaPowerTables) -> None:
    """The device's ``pow(beta, k)`` tables for ``betas`` (computed there once per process), added to ``into``."""
    for beta in betas:
        if into.covers(beta):  # another group of the same betas added it already
            continue
        key = (str(device), float(beta))
        if key not in _device_powers:
            _device_powers[key] = powers_on(device, beta)  # .to("cpu") synchronizes: once, outside any step
        into.add(beta, _device_powers[key])


def _group_arithmetic(optimizer_cls: type, torch_cls: type | None, index: int, group: dict[str, Any], powers: BetaPowerTables) -> GroupArithmetic:
    name = f"{optimizer_cls.__name__} param group {index}"
    params = list(group["params"])
    devices = sorted({str(p.device) for p in params}) or ["cpu"]
    accelerators = [d for d in devices if not d.startswith("cpu")]
    if not accelerators:
        path = step_path(group, params) if torch_cls is not None else OWN_STEP
        return GroupArithmetic(index, "cpu", path, None, True, "trained on the CPU: replay runs the same kernel")
    device = accelerators[0]
    if torch_cls is None:
        evidence = "not Adam or AdamW with torch's own step(): replay runs the CPU's kernels, which round differently from a GPU's"
        log.warning("replay of %s on %s is approximate: %s", name, device, evidence)
        return GroupArithmetic(index, device, OWN_STEP, None, False, evidence)
    path = step_path(group, params)
    emulated_dtypes = tuple(sorted({p.dtype for p in params if p.dtype in EMULATED_DTYPES}, key=str))
    if len(devices) > 1:
        evidence = f"its parameters are on {devices}: replay steps them all by the CPU's kernel"
        log.warning("replay of %s is approximate: %s", name, evidence)
        return GroupArithmetic(index, device, path, None, False, evidence)
    if not emulated_dtypes:
        evidence = "float64 parameters: CUDA computes them in double, as the CPU's kernel does; not measured"
        return GroupArithmetic(index, device, path, None, False, evidence)
    hyperparameters = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    if any(isinstance(v, torch.Tensor) for v in [hyperparameters.get("lr"), *(hyperparameters.get("betas") or ())]):
        evidence = "a tensor lr or betas: not measured (the probe steps Python numbers)"
        log.warning("replay of %s on %s may be approximate: %s", name, device, evidence)
        return GroupArithmetic(index, device, path, None, False, evidence)
    configuration = _GroupConfiguration(torch_cls, torch.device(device), path, emulated_dtypes, tuple(sorted(hyperparameters.items())))
    key = configuration.key()
    if key not in _measured:
        try:
            if path in DEVICE_POWER_PATHS:
                device_power_tables(configuration.device, list(hyperparameters["betas"]), powers)
            _measured[key] = measure(configuration, powers)
        except Exception as e:  # noqa: BLE001 - a measurement that cannot run must not stop training
            log.warning("replay of %s (%s on %s): could not measure the device's arithmetic (%s: %s); replay uses the CPU's "
                        "kernel, whose roundings may differ from the device's (docs/gpu.md)", name, path, device, type(e).__name__, e)
            _measured[key] = (None, -1, 0)
    elif path in DEVICE_POWER_PATHS and _measured[key][1] >= 0:
        # Measured for another optimizer of this process: its tables were computed then, a lookup now.
        device_power_tables(configuration.device, list(hyperparameters["betas"]), powers)
    best, differing, total = _measured[key]
    if differing < 0:
        return GroupArithmetic(index, device, path, None, False, "the device's arithmetic could not be measured")
    counts = f"step counts 1-{_FIRST_STEPS}, {_JUMP_TO_STEP + 1}-{_JUMP_TO_STEP + _LATER_STEPS}"
    if differing:
        evidence = f"the closest candidate: {differing} of {total} probe elements differ ({counts})"
        log.warning("replay of %s (%s on %s) is approximate: no CPU arithmetic reproduces the device's bit for bit; replay uses "
                    "the closest, %s, and %s", name, path, device, best or "the CPU's own kernel", evidence)
        return GroupArithmetic(index, device, path, best, False, evidence)
    log.info("replay of %s (%s on %s): the CPU reproduces it with %s", name, path, device, best or "the CPU's own kernel")
    return GroupArithmetic(index, device, path, best, True, f"the probe: {total} elements bit for bit ({counts})")


def _probe_tensors(dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A start and the gradients of every probe step, in ``dtype`` on the CPU, whatever torch's defaults."""
    generator = torch.Generator().manual_seed(0)
    on_cpu: dict[str, Any] = {"dtype": torch.float32, "device": "cpu"}
    start = torch.randn(_PROBE_ELEMENTS, generator=generator, **on_cpu) * torch.logspace(-3, 1, _PROBE_ELEMENTS, **on_cpu)
    grads = []
    for _ in range(_FIRST_STEPS + _LATER_STEPS):
        g = torch.randn(_PROBE_ELEMENTS, generator=generator, **on_cpu) * torch.logspace(-4, 0, _PROBE_ELEMENTS, **on_cpu)
        g[:_SUBNORMAL_GRADIENTS] = torch.linspace(-1e-39, 1e-39, _SUBNORMAL_GRADIENTS, **on_cpu)
        grads.append(g.to(dtype))
    return start.to(dtype), grads


def _state_names(hyperparameters: dict[str, Any]) -> list[str]:
    return ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hyperparameters.get("amsgrad") else [])


def _stepped(optimizer: torch.optim.Optimizer, param: torch.Tensor, grads: list[torch.Tensor], device: torch.device, step: Any) -> list[torch.Tensor]:
    """``grads`` stepped by ``step()``, the count set to ``_JUMP_TO_STEP`` after the first steps; the state, copied to the CPU."""
    for k, g in enumerate(grads):
        if k == _FIRST_STEPS:
            optimizer.state[param]["step"].fill_(_JUMP_TO_STEP)
        param.grad = g.to(device, copy=True)
        step()
    state = optimizer.state[param]
    names = _state_names(optimizer.param_groups[0])
    return [param.detach().to("cpu", copy=True)] + [state[n].detach().to("cpu", copy=True) for n in names]


def _state_after(configuration: _GroupConfiguration, device: torch.device, start: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The state after ``grads`` stepped by torch's own class on ``device``, with the group's flags.

    ``start`` is copied, never stepped in place: on the CPU, ``.to(device)`` would return it
    itself, and the candidates measured after this one would start from the stepped state.
    """
    hyperparameters = dict(configuration.hyperparameters)
    if device.type == "cpu":
        hyperparameters = replay_hyperparameters(hyperparameters)  # as the writer builds it: capturable off
    param = torch.nn.Parameter(start.to(device, copy=True))
    optimizer = configuration.torch_cls([param], **hyperparameters)
    return _stepped(optimizer, param, grads, device, optimizer.step)


def _state_by_emulation(
    configuration: _GroupConfiguration, start: torch.Tensor, grads: list[torch.Tensor], arithmetic: str, powers: BetaPowerTables | None = None
) -> list[torch.Tensor]:
    """The same steps by the emulation ``arithmetic``, as the writer runs it (``step_like_the_device``), with the device's powers."""
    param = torch.nn.Parameter(start.clone())
    optimizer = configuration.torch_cls([param], **replay_hyperparameters(dict(configuration.hyperparameters)))
    return _stepped(optimizer, param, grads, torch.device("cpu"), lambda: step_like_the_device(optimizer, [arithmetic], powers))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _differing_elements(got: list[torch.Tensor], ref: list[torch.Tensor]) -> int:
    # bitwise: a NaN equals itself, and -0.0 differs from 0.0
    return sum(int((_bits(g) != _bits(r)).sum()) for g, r in zip(got, ref))


def candidates_of(path: str) -> list[str | None]:
    """The arithmetics the probe tries for a path: None, the CPU's own kernel for the group's flags, then the emulations."""
    return [None] + [name for name, emulated in EMULATIONS.items() if emulated == path]


def measure(configuration: _GroupConfiguration, powers: BetaPowerTables | None = None) -> tuple[str | None, int, int]:
    """Step the probe on the device and by each candidate, for each of the group's dtypes: (the closest, its differing elements, of how many)."""
    differing: dict[str | None, int] = {}
    total = 0
    for dtype in configuration.dtypes:
        start, grads = _probe_tensors(dtype)
        on_device = _state_after(configuration, configuration.device, start, grads)  # .to("cpu") synchronizes: once, outside any step
        total += sum(t.numel() for t in on_device)
        for name in candidates_of(configuration.path):
            try:
                state = (_state_after(configuration, torch.device("cpu"), start, grads) if name is None
                         else _state_by_emulation(configuration, start, grads, name, powers))
            except RuntimeError as e:  # e.g. a torch without a CPU fused kernel: that candidate cannot run here
                log.info("replay candidate %s cannot run here (%s)", name or "the CPU's own kernel", e)
                differing[name] = _CANNOT_RUN
                continue
            differing[name] = differing.get(name, 0) + _differing_elements(state, on_device)
    order = candidates_of(configuration.path)
    # A tie goes to the first listed: torch's own CPU kernel, then the emulations in their order.
    best = min(differing, key=lambda name: (differing[name], order.index(name)))
    return best, differing[best], total
