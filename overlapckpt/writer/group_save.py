"""DCP's save in a writers' group: the plan round once per layout, the write round ending on the coordinator.

Runs in the writer process, for a tier the coordinator commits alone (the root; a local
tier on one node). It drives DCP's own planner and storage writer through the steps
``dcp.save`` takes (``state_dict_saver._save_state_dict``: set up, local plan, global plan
on the coordinator, finish plan, write, finish on the coordinator), with two of its
collectives gone:

- the plan round (a gather of the local plans, a scatter of the central ones) runs only
  when the claims' verdict says some rank's local plan changed (``save_plans.py``);
- the write round's broadcast of the global metadata back to every rank: no rank uses it.
  Each rank's results, or its failure, are gathered on the coordinator, which finishes
  (the manifest, then ``.metadata``); the commit barrier after its publish
  (``tier_write.py``) tells every rank the outcome.

Files, ``.metadata`` and results are DCP's own: the same planner and writer make them.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointWriteError
from ..format.manifest_records import RankSection
from ..format.shards import CoveringSavePlanner
from .claims import COORDINATOR_RANK as COORDINATOR
from .group import WriterGroup
from .save_plans import PlannedSave


@dataclass
class GroupSave:
    """One checkpoint's save in a group: its planner, set up with the state dict, and its local plan, made before the claims."""

    planner: CoveringSavePlanner
    local_plan: Any
    local_digest: str  # what this rank's claim says of its plan (save_plans.py)
    plans_unchanged: bool = False  # the verdict: every rank reuses its plan (set once the ranks agreed)
    planned: PlannedSave | None = None  # this checkpoint's plan, once had: a second tier reuses it
    # Per rank, the result of the write round, on the coordinator (ranks that failed: their failure).
    gathered: list[Any] = field(default_factory=list)
    sections: list[RankSection] | None = None  # every rank's manifest section, on the coordinator, where they rode along


def prepare(group: WriterGroup, state_dict: dict[str, Any]) -> GroupSave:
    """The planner set up with ``state_dict`` (as ``dcp.save`` would) and this rank's local plan, for its claim."""
    # dcp.save calls state_dict() on each top-level Stateful value first.
    state_dict = {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}
    # The union of the ranks' shapes is known after the claims (persist.py sets it then);
    # DCP's own plan caching is off: these plans are kept here, and the claims decide their reuse.
    planner = CoveringSavePlanner({}, dcp_plan_caching=False)
    planner.set_up_planner(state_dict=state_dict, storage_meta=None, is_coordinator=group.is_coordinator)
    local_plan = planner.create_local_plan()
    return GroupSave(planner, local_plan, group.plans.digests.digest(local_plan))


@dataclass
class TierWriter:
    """One tier's DCP storage writer, set up as ``dcp.save`` sets it up, with this rank's local plan as it prepared it; or why not."""

    writer: Any  # None where making it failed
    prepared_plan: Any  # None where setting it up failed
    failure: BaseException | None  # making or setting up the writer failed on this rank


def set_up(group: WriterGroup, save: GroupSave, make_writer: Callable[[], Any]) -> TierWriter:
    """The tier's writer, made and set up, and the local plan it prepared (its directory made, an existing ``.metadata`` refused).

    A failure here is carried by the next collective (the plan round's gather, or the write
    round's), where the others already wait: it never leaves them until the collective timeout.
    """
    writer = None
    try:
        writer = make_writer()
        _set_up_writer(writer, group)
        return TierWriter(writer, writer.prepare_local_plan(save.local_plan), None)
    except Exception as e:  # noqa: BLE001 - carried by the next collective, then raised
        return TierWriter(writer, None, e)


def plan(group: WriterGroup, save: GroupSave, tier: TierWriter) -> PlannedSave:
    """This rank's central plan: the one held, where the verdict says every rank holds its own, else a plan round (a collective).

    In a round, a failure of any rank's set-up or of the coordinator's planning raises on
    every rank: the planning's as itself (a ``CoverageError``, say); a set-up's on its own
    rank as itself, elsewhere as a ``CheckpointWriteError`` naming the rank.
    """
    if save.planned is not None:
        return save.planned
    if save.plans_unchanged:
        save.planned = group.plans.reused()
        return save.planned
    group.plans.forget()  # until this round succeeds
    mine: Any = (save.local_digest, tier.prepared_plan) if tier.failure is None else _Failed.of(tier.failure, group.rank)
    gathered: list[Any] | None = [None] * group.world_size if group.is_coordinator else None
    dist.gather_object(mine, gathered, dst=0, group=group.group)
    answers: list[Any] | None = None
    metadata: Any = None
    if group.is_coordinator:
        assert gathered is not None
        answers, metadata = _global_plans(save, tier, gathered)
    box: list[Any] = [None]
    dist.scatter_object_list(box, answers, src=0, group=group.group)
    answer = box[0]
    if isinstance(answer, _Failed):
        if tier.failure is not None:  # this rank's own set-up failed too: its own error, traceback and all
            raise tier.failure
        answer.raise_it("preparing the checkpoint", group.rank)
    central_plan, local_digests = answer
    planned = PlannedSave(central_plan, metadata)
    group.plans.hold(planned, local_digests)
    save.planned = planned
    return planned


def _global_plans(save: GroupSave, tier: TierWriter, gathered: list[Any]) -> tuple[list[Any], Any]:
    """On the coordinator: each rank's central plan with every rank's local digest, and the global metadata; or the failure for every rank."""
    failed = [g for g in gathered if isinstance(g, _Failed)]
    if failed:
        return [failed[0]] * len(gathered), None
    try:
        global_plans, metadata = save.planner.create_global_plan([local for _, local in gathered])
        global_plans = tier.writer.prepare_global_plan(global_plans)
    except Exception as e:  # noqa: BLE001 - every rank raises it, from the scatter
        return [_Failed.of(e, 0, everywhere=True)] * len(gathered), None
    digests = [digest for digest, _ in gathered]
    return [(central, digests) for central in global_plans], metadata


def write(
    group: WriterGroup, save: GroupSave, tier: TierWriter, planned: PlannedSave, make_section: Callable[[], RankSection] | None
) -> BaseException | None:
    """This rank's shards, written; every rank's results (and manifest section, where ``make_section``) gathered on the coordinator.

    The section is made after the write: it waits for the snapshot's checksums, which are
    hashed beside the write (``snapshot_sums.py``). Answers this rank's own failure, if any
    (its set-up's and its section's too). A rank that failed still joins the gather (and then
    the commit barrier): the others are already waiting there.
    """
    failure: BaseException | None = tier.failure
    results: Any = None
    section: RankSection | None = None
    if failure is None:
        try:
            final_plan = save.planner.finish_plan(planned.central_plan)
            future = tier.writer.write_data(final_plan, save.planner)
            future.wait()
            results = future.value()
            section = make_section() if make_section is not None else None
        except Exception as e:  # noqa: BLE001 - the coordinator hears of it in the gather; raised by the caller
            failure = e
    outcome = _Failed.of(failure, group.rank) if failure is not None else results
    gathered = group.gather_on_coordinator((outcome, section))
    if gathered is not None:
        save.gathered = [outcome for outcome, _ in gathered]
        if make_section is not None:  # every rank asks for one, or none does (the same tiers on every rank)
            save.sections = [theirs for _, theirs in gathered]
    return failure


def raise_failures(save: GroupSave) -> None:
    """On the coordinator, after ``write``: the first rank's failure the gather brought, naming the rank (its section is missing too)."""
    for result in save.gathered:
        if isinstance(result, _Failed):
            result.raise_it("writing its shards (or setting up its writer)", COORDINATOR)


def finish(save: GroupSave, tier: TierWriter, planned: PlannedSave) -> None:
    """On the coordinator, after ``write`` and ``raise_failures``: DCP's finish (the manifest, then ``.metadata``)."""
    tier.writer.finish(metadata=planned.metadata, results=save.gathered)


def _set_up_writer(writer: Any, group: WriterGroup) -> None:
    # As dcp.save does: torch's writers take the rank where their signature has **kwargs.
    if "kwargs" in inspect.signature(writer.set_up_storage_writer).parameters:
        writer.set_up_storage_writer(group.is_coordinator, rank=group.rank, use_collectives=True)
    else:
        writer.set_up_storage_writer(group.is_coordinator)


@dataclass
class _Failed:
    """A rank's failure, as a collective carries it: the exception itself where it pickles, else its text."""

    rank: int
    exception: BaseException | None
    text: str
    everywhere: bool = False  # raised as itself on every rank (the coordinator's planning: a CoverageError, say)

    @classmethod
    def of(cls, e: BaseException, rank: int, everywhere: bool = False) -> _Failed:
        text = f"{type(e).__name__}: {e}"
        try:
            pickle.loads(pickle.dumps(e))
            return cls(rank, e, text, everywhere)
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
            return cls(rank, None, text, everywhere)

    def raise_it(self, doing: str, here: int) -> None:
        """The failure on rank ``here``: its own error as itself, another rank's as a CheckpointWriteError naming that rank."""
        if self.exception is not None and (self.everywhere or self.rank == here):
            raise self.exception
        raise CheckpointWriteError(f"the writer of rank {self.rank} failed {doing}: {self.text}") from self.exception
