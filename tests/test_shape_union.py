"""The shape union is gathered once per plan: every rank reuses its cached union only when the coordinator's
verdict says every rank's union came from a gather of exactly the tables the ranks hold now."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from overlapckpt.errors import CheckpointWriteError
from overlapckpt.protocol import new_store_key
from overlapckpt.writer.claims import ClaimBoard
from overlapckpt.writer.sealed_store import SealedStore
from overlapckpt.writer.shape_union import ShapeUnionCache, merged, shapes_digest

from helpers import on_every_rank

KEY = new_store_key()
CLAIM = {"name": "step-000000003", "version": 3, "requested": 3}


class Ranks:
    """``world_size`` writers' claim boards over one real store, each with its shape cache; gathers are counted."""

    def __init__(self, world_size: int) -> None:
        store = dist.HashStore()
        self.boards = [ClaimBoard(SealedStore(store, KEY, ""), rank=r, world_size=world_size, agreement_timeout_s=10) for r in range(world_size)]
        self.caches = [ShapeUnionCache() for _ in range(world_size)]
        self.gathers = 0

    def checkpoint(self, tables: list[dict[str, tuple[int, ...]]]) -> list[dict[str, tuple[int, ...]]]:
        """One checkpoint on every rank at once (a thread each): every rank's union, and whether it gathered."""
        gathered = threading.Barrier(len(self.boards))  # the all-gather: every rank or none
        lock = threading.Lock()

        def gather(local: tuple[str, dict[str, tuple[int, ...]]]) -> list[tuple[str, dict[str, tuple[int, ...]]]]:
            with lock:
                self.gathers += 1
            gathered.wait(timeout=30)
            return [(shapes_digest(table), table) for table in tables]  # what every rank's all-gather returns

        def run(rank: int) -> dict[str, tuple[int, ...]]:
            claim = {**CLAIM, "shapes": self.caches[rank].claim_field(tables[rank])}
            agreement = self.boards[rank].agree(claim)
            return self.caches[rank].union(tables[rank], agreement.shapes_unchanged, gather)

        return on_every_rank(len(self.boards), run)


def test_the_union_is_gathered_once_per_set_of_tables_and_again_when_one_changes_or_a_writer_is_new():
    stage_tables = [{"a": (4, 2)}, {"b": (3,)}, {"c": (5, 5)}]  # pipeline stages: each rank holds other tensors
    ranks = Ranks(3)
    union = {"a": (4, 2), "b": (3,), "c": (5, 5)}
    assert ranks.checkpoint(stage_tables) == [union] * 3 and ranks.gathers == 3  # the first: every rank gathers
    assert ranks.checkpoint(stage_tables) == [union] * 3 and ranks.gathers == 3  # unchanged: nobody gathers
    assert ranks.checkpoint(stage_tables) == [union] * 3 and ranks.gathers == 3
    grown = [stage_tables[0], stage_tables[1], {"c": (5, 5), "d": (1,)}]  # one rank's tensors change
    grown_union = {**union, "d": (1,)}
    assert ranks.checkpoint(grown) == [grown_union] * 3 and ranks.gathers == 6
    assert ranks.checkpoint(grown) == [grown_union] * 3 and ranks.gathers == 6
    ranks.caches[1] = ShapeUnionCache()  # a replaced writer holds no union: every rank gathers again
    assert ranks.checkpoint(grown) == [grown_union] * 3 and ranks.gathers == 9


def test_a_claim_without_shapes_never_reuses_a_union():
    store = dist.HashStore()
    sealed = SealedStore(store, KEY, "")
    sealed.set("claim/0/1", '{"name": "step-000000003", "requested": 3, "version": 3}')
    board = ClaimBoard(sealed, rank=0, world_size=2, agreement_timeout_s=5)
    assert board.agree({**CLAIM, "shapes": "x:y"}).shapes_unchanged is False


def test_a_tensor_with_two_global_shapes_on_two_ranks_is_a_named_error():
    with pytest.raises(CheckpointWriteError, match=r"tensor 'w' has global shape \(4,\) on one rank and \(5,\) on rank 1"):
        merged([{"w": (4,)}, {"w": (5,)}])
