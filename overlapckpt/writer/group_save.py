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
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ..errors import CheckpointWriteError
from ..format.manifest_records import RankSection
from ..format.shards import CoveringSavePlanner
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


def plan(group: WriterGroup, save: GroupSave, writer: Any) -> PlannedSave:
    """This rank's central plan: the one held, where the verdict says every rank holds its own, else a plan round (a collective)."""
    if save.planned is not None:
        return save.planned
    if save.plans_unchanged:
        save.planned = group.plans.reused()
        return save.planned
    group.plans.forget()  # until this round succeeds
    gathered: list[Any] | None = [None] * group.world_size if group.is_coordinator else None
    dist.gather_object((save.local_digest, save.local_plan), gathered, dst=0, group=group.group)
    answers: list[Any] | None = None
    metadata: Any = None
    if group.is_coordinator:
        assert gathered is not None
        answers, metadata = _global_plans(save, writer, gathered)
    box: list[Any] = [None]
    dist.scatter_object_list(box, answers, src=0, group=group.group)
    answer = box[0]
    if isinstance(answer, _Failed):  # the coordinator's planning failed: every rank raises its error (a CoverageError, say)
        answer.raise_it("planning the checkpoint", keep_type=True)
    central_plan, local_digests = answer
    planned = PlannedSave(central_plan, metadata)
    group.plans.hold(planned, local_digests)
    save.planned = planned
    return planned


def _global_plans(save: GroupSave, writer: Any, gathered: list[Any]) -> tuple[list[Any], Any]:
    """On the coordinator: each rank's central plan with every rank's local digest, and the global metadata; or the failure for every rank."""
    try:
        global_plans, metadata = save.planner.create_global_plan([local for _, local in gathered])
        global_plans = writer.prepare_global_plan(global_plans)
    except Exception as e:  # noqa: BLE001 - every rank raises it, from the scatter
        return [_Failed.of(e, 0)] * len(gathered), None
    digests = [digest for digest, _ in gathered]
    return [(central, digests) for central in global_plans], metadata


def write(group: WriterGroup, save: GroupSave, writer: Any, planned: PlannedSave, section: RankSection | None) -> BaseException | None:
    """This rank's shards, written; every rank's results (and ``section``, where given) gathered on the coordinator (a collective).

    Answers this rank's own failure, if any. A rank whose write failed still joins the
    gather (and then the commit barrier): the others are already waiting there.
    """
    failure: BaseException | None = None
    results: Any = None
    try:
        _set_up_writer(writer, group)
        writer.prepare_local_plan(save.local_plan)  # the directory, and DCP's refusal of an existing .metadata
        final_plan = save.planner.finish_plan(planned.central_plan)
        future = writer.write_data(final_plan, save.planner)
        future.wait()
        results = future.value()
    except Exception as e:  # noqa: BLE001 - the coordinator hears of it in the gather; raised by the caller
        failure = e
    gathered: list[Any] | None = [None] * group.world_size if group.is_coordinator else None
    outcome = _Failed.of(failure, group.rank) if failure is not None else results
    dist.gather_object((outcome, section), gathered, dst=0, group=group.group)
    if gathered is not None:
        save.gathered = [outcome for outcome, _ in gathered]
        if section is not None:  # every rank sends one, or none does (the same tiers on every rank)
            save.sections = [theirs for _, theirs in gathered]
    return failure


def finish(save: GroupSave, writer: Any, planned: PlannedSave) -> None:
    """On the coordinator, after ``write``: every rank's failure raised, else DCP's finish (the manifest, then ``.metadata``)."""
    for result in save.gathered:
        if isinstance(result, _Failed):
            result.raise_it("writing its shards", keep_type=False)
    writer.finish(metadata=planned.metadata, results=save.gathered)


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

    @classmethod
    def of(cls, e: BaseException, rank: int) -> _Failed:
        text = f"{type(e).__name__}: {e}"
        try:
            pickle.loads(pickle.dumps(e))
            return cls(rank, e, text)
        except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
            return cls(rank, None, text)

    def raise_it(self, doing: str, keep_type: bool) -> None:
        """The failure here: the exception itself (``keep_type``, where it pickled), else a CheckpointWriteError naming the rank."""
        if keep_type and self.exception is not None:
            raise self.exception
        raise CheckpointWriteError(f"the writer of rank {self.rank} failed {doing}: {self.text}") from self.exception
