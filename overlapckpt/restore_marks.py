"""Which live model and optimizer ``load()`` just restored, and from which checkpoint.

A run that resumes with ``load(root, model, opt)`` and then builds a ``Checkpointer`` on
those objects continues that checkpoint's version count and lineage by itself, exactly
as ``ckpt.restore()`` does: without it, the first checkpoint after the resume would be
named ``step-000000001`` while the state is that checkpoint's version plus one, listed
beside the older run's, and picked as the newest by nothing but its name.

The mark is weak (it keeps neither object alive), taken by the first Checkpointer built
on the pair, and stale once the optimizer has stepped since the load (its step counters
moved): the state is then no longer the checkpoint's version.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .format.manifest import CheckpointInfo
from .optimizers import step_owner


@dataclass(frozen=True)
class RestoreMark:
    info: CheckpointInfo
    optimizer: Any  # a weakref.ref to the optimizer load() restored
    step_counters: tuple[float, ...]  # its state's step counters when load() returned


_MARKS: weakref.WeakKeyDictionary[nn.Module, RestoreMark] = weakref.WeakKeyDictionary()


def _step_counters(optimizers: Any) -> tuple[float, ...]:
    """Every parameter's ``step`` counter (Adam and the like; SGD has none), in a fixed order."""
    out: list[float] = []
    for opt in optimizers if isinstance(optimizers, (list, tuple)) else (optimizers,):
        for group in opt.param_groups:
            for p in group["params"]:
                step = opt.state[p].get("step") if p in opt.state else None
                if isinstance(step, torch.Tensor):
                    out.append(float(step))
                elif isinstance(step, (int, float)):
                    out.append(float(step))
    return tuple(out)


def mark_restored(model: nn.Module, optimizer: Any, optimizers: Any, info: CheckpointInfo) -> None:
    """``load()`` restored ``model`` and ``optimizer`` (its torch ``optimizers``) from ``info``."""
    _MARKS[model] = RestoreMark(info, weakref.ref(step_owner(optimizer)), _step_counters(optimizers))


def take_restore_mark(model: nn.Module, optimizer: Any, optimizers: Any) -> CheckpointInfo | None:
    """The checkpoint ``model`` and ``optimizer`` hold, if ``load()`` restored them and they did not step since."""
    mark = _MARKS.pop(model, None)
    if mark is None or mark.optimizer() is not step_owner(optimizer):
        return None
    if _step_counters(optimizers) != mark.step_counters:
        return None
    return mark.info
