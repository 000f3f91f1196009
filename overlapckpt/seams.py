"""The Checkpointer with its device seams exposed: for tests and benchmarks, not for training scripts.

What copies bytes to host memory (a ``Copier``: the device's ``StreamCopier`` by default,
``CpuCopier`` copies inside the hooks, a test's copier may hold or delay copies) and what
times the step's phases for ``window="auto"`` (a ``PhaseTimer``) are chosen from the
device. Tests replace them to drive every fence on the CPU; they import this module's
``Checkpointer`` in place of ``overlapckpt.Checkpointer``, whose constructor takes neither.

``engine_of`` is the one way in to a Checkpointer's units (its slots, writer link, dispatcher)
for the tests and benchmarks that look at them.
"""

from __future__ import annotations

from typing import Any

from . import checkpointer
from .builder import Seams
from .train.consistency.autowindow import PhaseTimer
from .train.copying.transfer import Copier
from .train.lifecycle.engine import SnapshotEngine


class Checkpointer(checkpointer.Checkpointer):
    """``overlapckpt.Checkpointer``, with ``copier=`` and ``phase_timer=`` as well."""

    def __init__(self, *args: Any, copier: Copier | None = None, phase_timer: PhaseTimer | None = None, **kwargs: Any) -> None:
        self._seams = Seams(copier=copier, phase_timer=phase_timer)  # read by the parent's constructor as it builds
        super().__init__(*args, **kwargs)


def engine_of(ckpt: checkpointer.Checkpointer) -> SnapshotEngine:
    """The snapshot engine behind ``ckpt``: its ``parts`` (units) and ``state``, for tests and benchmarks."""
    return ckpt._engine
