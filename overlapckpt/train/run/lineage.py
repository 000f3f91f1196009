"""A run's lineage: its id, the checkpoint it continued from, and the versions other runs already hold.

Every Checkpointer is a new run with a random id, written into each manifest, with the
runs it descends from (``ancestors``: each with the version continued from). ``keep=``
counts this lineage: a restarted job's predecessors' checkpoints up to the restore
point count as its own, so restarts never grow a root or a tier beyond ``keep + 1``;
the newer checkpoints of an abandoned trajectory (a rollback after a loss spike) are
never deleted by the run that rolled back (in the root), and ``latest`` names this
run's newest. A version that another run's committed
checkpoint already holds gets a lineage-aware name (``step-000000004-<run>``), decided
here at construction or restore, never raised from ``optimizer.step()``.

A restore inside a run that has already committed checkpoints (a rollback after a loss
spike: ``every=1``, six steps, ``restore(step=4)``) starts a new lineage: a new run id,
derived from the old one and the restore point, so every rank derives the same one
without a collective. The run's own checkpoints newer than the restore point then
belong to an abandoned trajectory: they are named in a warning, kept (``keep=`` counts
the new lineage only, so the restore point survives too), and the versions they hold
are taken, so the new trajectory's checkpoints of those versions get lineage-aware
names instead of being skipped as already held.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import warnings
from dataclasses import dataclass, field

from ...format.manifest import RUN_ID_HEX, STEP_NAMES, NameStyle, checkpoint_name, step_of_name
from ...format.manifest_records import MAX_ANCESTORS
from ..warnings_text import ROOT_AHEAD_WARNING

log = logging.getLogger("overlapckpt.lineage")


def new_run_id() -> str:
    return secrets.token_hex(RUN_ID_HEX // 2)


@dataclass
class Lineage:
    run_id: str
    restored_from: str | None = None
    # Versions that committed checkpoints of other runs hold under the root.
    taken_versions: set[int] = field(default_factory=set)
    # This run holds the root's lease (format/lease.py): no other job writes the root.
    root_leased: bool = False
    names: NameStyle = STEP_NAMES  # step-000000100; step-100 (TorchTitan); checkpoint-100 (the Trainer)
    root: str = ""  # for the warning below
    # The runs this one descends from, nearest first: (run id, the version it continued from).
    # Retention counts their checkpoints up to those versions as this run's (writer/retention.py),
    # so restarts never grow a tier or the root beyond keep + 1.
    ancestors: tuple[tuple[str, int], ...] = ()
    _warned_root_ahead: bool = False

    def note_existing(self, committed_names: list[str], own: set[str]) -> None:
        """The root's committed checkpoints, less this run's own: their versions are taken."""
        self.taken_versions = {v for n in committed_names if n not in own and (v := step_of_name(n)) is not None}

    def name_for(self, version: int) -> str:
        """The directory name of this run's checkpoint of ``version``.

        The first time a run that continued from nothing names a version below one that
        another run's checkpoint holds, it warns once: its names would read as if training
        had started over (a resume with ``load()`` into new objects, or none at all).
        """
        if self.restored_from is None and not self._warned_root_ahead and self.taken_versions and max(self.taken_versions) > version:
            self._warned_root_ahead = True
            newest = sorted(self.taken_versions)
            warnings.warn(
                ROOT_AHEAD_WARNING.format(
                    root=self.root, newest=newest[-1], versions=", ".join(map(str, newest[-5:])), version=version
                ),
                stacklevel=2,
            )
        if version in self.taken_versions:
            return checkpoint_name(version, self.run_id, style=self.names)
        return checkpoint_name(version, style=self.names)

    def restored(
        self,
        name: str,
        version: int,
        committed_names: list[str],
        own: set[str],
        lineage_of_restored: tuple[tuple[str, int], ...] = (),
    ) -> list[str]:
        """This run continues from ``name``: returns the newer checkpoints it leaves alone, and warns of them.

        ``committed_names``: every tier's (the root's and the local tier's). ``own`` are the
        checkpoints this run committed before the restore: if some are newer than ``name``, the
        run continues as a new lineage (see the module's docstring). ``lineage_of_restored``:
        the restored checkpoint's run and version, then its own ancestors; they become this
        run's ancestors.
        """
        self.restored_from = name
        abandoned = sorted((n for n in own if (step_of_name(n) or 0) > version), key=lambda n: step_of_name(n) or 0)
        if abandoned:
            old = self.run_id
            self.run_id = hashlib.sha256(f"{old}/{name}/{version}".encode()).hexdigest()[:RUN_ID_HEX]
            warnings.warn(
                f"overlapckpt: restored {name} (version {version}) after this run committed {', '.join(abandoned)}: "
                f"they hold the trajectory this restore abandons. They are kept, keep= no longer counts them, and "
                f"this run continues as run {self.run_id[:8]} (was {old[:8]}): its checkpoints of those versions get "
                f"names with that id, and load(step=...) prefers the run latest names",
                stacklevel=3,
            )
        self.ancestors = tuple((run, v) for run, v in lineage_of_restored if run != self.run_id)[:MAX_ANCESTORS]
        self.note_existing(committed_names, own=set() if abandoned else own)
        newer = [n for n in committed_names if n not in own and (step_of_name(n) or 0) > version]
        if newer:
            log.warning(
                "restored %s (version %d) while newer checkpoints exist: %s. This run keeps them: keep= counts only "
                "this run's lineage (the restore point and what it continued from), latest will name this run's newest, "
                "and a version they hold gets a name with this run's id (%s)",
                name,
                version,
                ", ".join(newer),
                self.run_id[:8],
            )
        return newer
