"""At interpreter exit, a Checkpointer never closed commits what is complete, says what was lost, and releases everything.

Apart from the Checkpointer because it must not hold it: a script may drop the Checkpointer
(a local of its ``main()``) while its writer, host buffers and lease live on until exit.
"""

from __future__ import annotations

import warnings
import weakref

from .builder import BuiltCheckpointer
from .format.manifest import CheckpointInfo


class _ExitOrderAnchor:
    """An object whose finalizer registers weakref's exit hook at import (see below)."""


# atexit runs last-registered first. weakref registers its own exit hook (which runs the host
# buffers' finalizers: unmap, unregister) at its first finalizer; made here, at import, it is
# registered before any Checkpointer's exit commit, so it runs after it, never under it.
_EXIT_ORDER_ANCHOR = _ExitOrderAnchor()
weakref.finalize(_EXIT_ORDER_ANCHOR, lambda: None)


class ExitCommit:
    """At interpreter exit, for a Checkpointer never closed: commit what is complete, warn, release everything."""

    def __init__(self, built: BuiltCheckpointer, path: str, exit_timeout_s: float) -> None:
        self.built, self.path, self.exit_timeout_s = built, path, exit_timeout_s

    def __call__(self) -> None:
        built, engine = self.built, self.built.engine
        open_windows = engine.blocking.unfinished_versions()
        dropped_before = engine.state.snapshots_dropped
        if built.preemption is not None:
            built.preemption.uninstall()
        committed: list[CheckpointInfo] = []
        try:
            if engine.state.dead is None:
                committed = engine.abandon(self.exit_timeout_s)
        finally:
            built.writer_timeout_s = min(30.0, self.exit_timeout_s)
            built.teardown.close()
        lost = engine.state.snapshots_dropped - dropped_before
        if committed or lost:
            warnings.warn(
                f"overlapckpt: the Checkpointer of {self.path} was never closed. At interpreter exit "
                + (f"the checkpoint(s) of step(s) {[i.step for i in committed]} committed" if committed else "nothing committed")
                + (f"; {lost} still being copied (of {[v for v in open_windows if v is not None] or 'open windows'}) "
                   "were lost" if lost else "")
                + ". Call ckpt.close() at the end of training, or use `with Checkpointer(...) as ckpt:`",
                stacklevel=2,
            )
