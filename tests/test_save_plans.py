"""DCP's save plans are made once per layout: a local plan's digest changes with anything DCP's plan holds, and every
rank reuses its plan only when the coordinator's verdict says every rank's came from a round over the plans made now."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from overlapckpt.errors import InternalError
from overlapckpt.protocol import new_store_key
from overlapckpt.writer import save_plans
from overlapckpt.writer.claims import PLANS_FIELD, ClaimBoard
from overlapckpt.writer.save_plans import LocalPlanDigests, PlannedSave, SavePlanCache
from overlapckpt.writer.sealed_store import SealedStore

from helpers import on_every_rank

KEY = new_store_key()
CLAIM = {"name": "step-000000003", "version": 3, "requested": 3}


def _local_plan(state_dict: dict) -> object:
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, None, False)
    return planner.create_local_plan()


def _state(**changes: object) -> dict:
    state = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    state.update(changes)
    return state


def test_equal_plans_have_one_digest_and_anything_the_plan_holds_changes_it():
    digest = LocalPlanDigests().digest
    same = digest(_local_plan(_state()))
    assert digest(_local_plan(_state())) == same  # new planner, new items, equal values
    assert digest(_local_plan(_state(optimizer={"param_groups": [{"lr": 0.5}]}))) == same  # a value, not the layout
    changed = {
        "a shape": _state(model={"w": torch.zeros(4, 4), "b": torch.zeros(3)}),
        "a dtype": _state(model={"w": torch.zeros(4, 3, dtype=torch.bfloat16), "b": torch.zeros(3)}),
        "a key": _state(model={"w": torch.zeros(4, 3), "b": torch.zeros(3), "c": torch.zeros(1)}),
        "a small value's key": _state(optimizer={"param_groups": [{"lr": 0.1, "momentum": 0.9}]}),
        "a flattened path (the same key, nested otherwise)": {**_state(), "model.w": torch.zeros(4, 3), "model": {"b": torch.zeros(3)}},
    }
    digests = {why: digest(_local_plan(state)) for why, state in changed.items()}
    assert all(d != same for d in digests.values()), digests
    assert len(set(digests.values())) == len(digests), digests


def test_an_item_seen_in_the_last_plan_is_not_described_again(monkeypatch):
    described: list[object] = []
    original = save_plans._item_text
    monkeypatch.setattr(save_plans, "_item_text", lambda item: described.append(item) or original(item))
    digests = LocalPlanDigests()
    plan = _local_plan(_state())
    first = digests.digest(plan)
    assert len(described) == len(plan.items)
    described.clear()
    assert digests.digest(plan) == first and described == []  # the same item objects (shards.py's WriteItemsMemo)
    fresh = _local_plan(_state())  # equal items, other objects: described, and the same digest
    assert digests.digest(fresh) == first and len(described) == len(fresh.items)


class Ranks:
    """``world_size`` writers' claim boards over one real store, each with its plan cache; plan rounds are counted."""

    def __init__(self, world_size: int) -> None:
        store = dist.HashStore()
        self.boards = [ClaimBoard(SealedStore(store, KEY, ""), rank=r, world_size=world_size, agreement_timeout_s=10) for r in range(world_size)]
        self.caches = [SavePlanCache() for _ in range(world_size)]
        self.rounds = 0

    def checkpoint(self, local_digests: list[str]) -> list[object]:
        """One checkpoint on every rank at once (a thread each): the central plan each rank writes with."""
        lock = threading.Lock()

        def run(rank: int) -> object:
            agreement = self.boards[rank].agree({**CLAIM, PLANS_FIELD: self.caches[rank].claim_field(local_digests[rank])})
            if agreement.plans_unchanged:
                return self.caches[rank].reused().central_plan
            with lock:
                self.rounds += 1
            planned = PlannedSave(central_plan=("plan of", rank, tuple(local_digests)), metadata=None)
            self.caches[rank].hold(planned, local_digests)
            return planned.central_plan

        return on_every_rank(len(self.boards), run)


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_plans_are_made_once_per_set_of_local_plans_and_again_when_one_changes_or_a_writer_is_new(world_size):
    ranks = Ranks(world_size)
    layout = [f"d{r}" for r in range(world_size)]
    expected = [("plan of", r, tuple(layout)) for r in range(world_size)]
    assert ranks.checkpoint(layout) == expected and ranks.rounds == world_size  # the first: a round
    assert ranks.checkpoint(layout) == expected and ranks.rounds == world_size  # unchanged: none
    grown = [*layout[:-1], "grown"]  # one rank's local plan changes: every rank plans again
    assert ranks.checkpoint(grown)[0] == ("plan of", 0, tuple(grown)) and ranks.rounds == 2 * world_size
    assert ranks.checkpoint(grown)[0] == ("plan of", 0, tuple(grown)) and ranks.rounds == 2 * world_size
    ranks.caches[1] = SavePlanCache()  # a replaced writer holds no plan
    ranks.checkpoint(grown)
    assert ranks.rounds == 3 * world_size
    ranks.caches[0].forget()  # a round that failed on a rank: its claim asks for a round
    ranks.checkpoint(grown)
    assert ranks.rounds == 4 * world_size


def test_a_claim_without_a_plan_never_reuses_one_and_reusing_what_is_not_held_is_an_internal_error():
    store = dist.HashStore()
    sealed = SealedStore(store, KEY, "")
    sealed.set("claim/0/1", '{"name": "step-000000003", "requested": 3, "version": 3}')
    board = ClaimBoard(sealed, rank=0, world_size=2, agreement_timeout_s=5)
    assert board.agree({**CLAIM, PLANS_FIELD: "x:y"}).plans_unchanged is False
    with pytest.raises(InternalError, match="reused a save plan this writer does not hold"):
        SavePlanCache().reused()
