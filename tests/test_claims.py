"""The writers' claims over a real torch.distributed store: malformed and forged claims are named
refusals, a forged marker alone refuses nothing, an idle poll is one request whatever the world
size, and decided checkpoints leave no keys."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from overlapckpt.errors import RankDisagreementError
from overlapckpt.protocol import new_store_key
from overlapckpt.writer.claims import ClaimBoard
from overlapckpt.writer.sealed_store import SealedStore

KEY = new_store_key()


LOCAL_CALLS = ("set_timeout",)


class CountingStore:
    """A real HashStore (``inner``: one several counting views share); each request through this view is counted."""

    def __init__(self, inner: dist.Store | None = None) -> None:
        self.inner = dist.HashStore() if inner is None else inner
        self.requests = 0

    def __getattr__(self, name):
        method = getattr(self.inner, name)
        if not callable(method) or name in LOCAL_CALLS:  # a property, or the client's own setting: no request
            return method

        def counted(*args, **kwargs):
            self.requests += 1
            return method(*args, **kwargs)

        return counted


def sealed(store, namespace: str = "") -> SealedStore:
    return SealedStore(store, KEY, namespace)


CLAIM = {"name": "step-000000003", "version": 3, "requested": 3}
OTHER_CLAIM = '{"name": "step-000000003", "requested": 3, "version": 3}'


@pytest.mark.parametrize("posted", ["[1, 2]", '{"name": "x", "version": "3", "requested": 3}'], ids=["list", "types"])
def test_a_malformed_claim_is_a_named_refusal(posted):
    store = CountingStore()
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    sealed(store.inner).set("claim/0/1", posted)  # sealed, but not a claim overlapckpt writes
    with pytest.raises(RankDisagreementError, match=r"rank 1's claim is malformed .*not written by overlapckpt"):
        board.agree(CLAIM)


@pytest.mark.parametrize("posted", [b"\xff not json", OTHER_CLAIM.encode(), b"0" * 64 + OTHER_CLAIM.encode()], ids=["bytes", "unsealed", "wrong-mac"])
def test_a_claim_another_client_wrote_is_a_named_refusal(posted):
    store = CountingStore()
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    store.inner.set("claim/0/1", posted)  # what another client of the store injected as rank 1's claim
    with pytest.raises(RankDisagreementError, match=r"rank 1's claim is forged .*not sealed by this run's writers.*not written by overlapckpt"):
        board.agree(CLAIM)


def test_a_claim_sealed_under_another_key_name_does_not_open():
    store = dist.HashStore()
    writer = sealed(store)
    writer.set("claim/0/0", OTHER_CLAIM)
    store.set("claim/0/1", store.get("claim/0/0"))  # a genuine sealed value, copied to another rank's key
    assert writer.get("claim/0/0") == OTHER_CLAIM
    assert writer.get("claim/0/1") is None


def test_a_forged_marker_alone_makes_no_idle_writer_refuse(caplog):
    """A marker with no rank's sealed claim behind it (another client wrote it) is ignored: before,
    an idle writer refused the checkpoint no rank had asked for, and its trainer raised."""
    store = dist.HashStore()
    idle = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=0.0)
    store.set("posted/0", "0")  # forged marker
    store.set("claim/0/0", OTHER_CLAIM)  # and a forged claim behind it
    with caplog.at_level("WARNING", logger="overlapckpt"):
        assert idle.missing_claim() is None
    assert idle.sequence == 0 and not store.check(["claim/0/1"])  # no refusal posted, nothing decided
    assert any("no rank's claim behind it" in r.getMessage() and "rank 0's claim is forged" in r.getMessage() for r in caplog.records)


def test_an_idle_writer_polls_one_key_whatever_the_world_size():
    store = CountingStore()
    board = ClaimBoard(sealed(store), rank=5, world_size=1024, agreement_timeout_s=5)
    before = store.requests
    for _ in range(10):
        assert board.missing_claim() is None
    assert store.requests - before == 10  # one request per poll, not 1,024


def test_an_idle_writer_refuses_a_checkpoint_it_never_requested():
    store = CountingStore()
    other = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=0.0)
    idle = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=0.0)
    sealed(store.inner).set("claim/0/0", OTHER_CLAIM)
    sealed(store.inner).set("posted/0", "0")
    refusal = idle.missing_claim()  # agreement_timeout_s=0: at once
    assert isinstance(refusal, RankDisagreementError) and "but this rank (1) requested none" in str(refusal)
    with pytest.raises(RankDisagreementError, match="rank 1 requested none"):
        other.agree(CLAIM)


def test_decided_checkpoints_leave_only_the_newest_verdict():
    """The coordinator forgets a verdict once every rank claimed the next checkpoint, so has read it:
    a rank slower to read it than the coordinator is to commit still finds it."""
    store = dist.HashStore()
    boards = [ClaimBoard(sealed(store), rank=r, world_size=2, agreement_timeout_s=5) for r in range(2)]
    for sequence in range(3):
        sealed(store).set(f"claim/{sequence}/1", OTHER_CLAIM)
        sealed(store).set(f"posted/{sequence}", "1")
        assert boards[0].agree(CLAIM).sequence == sequence
        boards[0].forget(sequence)  # the coordinator first: rank 1 has not read the verdict yet
        assert store.check([f"verdict/{sequence}"])
        boards[1].sequence = sequence
        assert boards[1].agree(CLAIM).sequence == sequence  # reads the verdict the coordinator kept
        boards[1].forget(sequence)
    # (rank 1 posts its marker again on its late agree here; in a run every rank posts before the coordinator decides)
    left = [f"verdict/{s}" for s in range(3)] + [f"claim/{s}/{r}" for s in range(3) for r in range(2)]
    assert [key for key in left if store.check([key])] == ["verdict/2"]


def test_the_verdict_carries_the_widest_window_any_rank_proposed_and_none_when_none_did():
    proposals = {0: {**CLAIM, "next_window": 2}, 1: {**CLAIM, "next_window": 8}, 2: CLAIM, 3: {**CLAIM, "next_window": 4}}
    _, outcomes = _agree_on_every_rank(4, proposals, agreement=True)
    assert [a.next_window for a in outcomes] == [8, 8, 8, 8]  # every rank, the coordinator's verdict
    _, outcomes = _agree_on_every_rank(2, {}, agreement=True)
    assert [a.next_window for a in outcomes] == [None, None]


def test_a_window_proposal_of_the_wrong_type_is_malformed():
    store = dist.HashStore()
    sealed(store).set("claim/0/1", '{"name": "step-000000003", "next_window": "8", "requested": 3, "version": 3}')
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    with pytest.raises(RankDisagreementError, match=r"rank 1's claim is malformed .*next_window"):
        board.agree(CLAIM)


def test_a_claim_forged_outside_the_runs_prefix_has_no_effect():
    """The writers' keys live under a random prefix shared over the training group: a claim written
    under any other prefix (the fixed one of earlier releases, a guess) is never read."""
    base = dist.HashStore()
    run = dist.PrefixStore("overlapckpt-writers/9f1c2e7d4b6a8c0e1f2a3b4c5d6e7f80/agree/", base)
    boards = [ClaimBoard(sealed(run), rank=r, world_size=2, agreement_timeout_s=5) for r in range(2)]
    forged = '{"requested": null}'  # a valid refusal, even sealed with the run's key
    for elsewhere in (dist.PrefixStore("overlapckpt-writers/agree/", base), dist.PrefixStore("overlapckpt-writers/0/agree/", base), base):
        sealed(elsewhere).set("claim/0/1", forged)
        sealed(elsewhere).set("posted/0", "1")
    assert boards[1].missing_claim() is None  # the idle writer sees no claim of this run
    sealed(run).set("claim/0/1", OTHER_CLAIM)
    assert boards[0].agree(CLAIM).sequence == 0  # the run's own claims agree; the forged ones are not seen


@pytest.mark.parametrize("replaced_when_dead", [True, False])
def test_a_broken_collective_waits_for_a_replacement_only_if_one_may_come(replaced_when_dead):
    """A writer whose collective failed regroups when a replacement opened the next generation,
    unless max_writer_restarts=0 (agreed by every rank): then it reports the failure as it is."""
    from overlapckpt.protocol import WriterGroupSpec
    from overlapckpt.writer.group import GENERATION_KEY, WriterGroup, run_keys_prefix

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    spec = WriterGroupSpec(
        store_host="127.0.0.1", store_port=host.port, rank=0, world_size=1, timeout_s=30.0, agreement_timeout_s=5.0,
        mesh_shape=(1,), key_prefix="t", replaced_when_dead=replaced_when_dead, store_key=KEY,
    )
    group = WriterGroup(spec)  # a one-writer group: joining needs no peer
    try:
        prefix = run_keys_prefix(spec)
        sealed(dist.PrefixStore(prefix, host), prefix).increment(GENERATION_KEY, 1)  # a replacement opened generation 1
        assert group.regroups_after(RuntimeError("gloo: Connection closed by peer")) is replaced_when_dead
        assert group.regroups_after(OSError(5, "Input/output error")) is False  # storage: never a regroup
    finally:
        group.close()


def test_ranks_that_would_write_different_tiers_disagree_by_name():
    """A local tier adds the tiers to the claim: ranks that would write different tiers (and so enter different
    collectives) get RankDisagreementError naming each rank's tiers, instead of a collective that never matches."""
    store = dist.HashStore()
    other = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=5)
    other._post(0, {**CLAIM, "tiers": "local"})
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    with pytest.raises(RankDisagreementError, match=r"rank 0 requested it after step 3 \(version 3, to local,root\), rank 1 requested it after step 3 \(version 3, to local\)"):
        board.agree({**CLAIM, "tiers": "local,root"})


def test_a_claim_with_tiers_of_the_wrong_type_is_malformed():
    store = dist.HashStore()
    sealed(store).set("claim/0/1", '{"name": "step-000000003", "requested": 3, "version": 3, "tiers": 7}')
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    with pytest.raises(RankDisagreementError, match=r"rank 1's claim is malformed"):
        board.agree({**CLAIM, "tiers": "local,root"})


def _agree_on_every_rank(
    world_size: int, claims: dict[int, dict], timeout_s: float = 10.0, agreement: bool = False
) -> tuple[list[int], list[object]]:
    """Every rank's writer agrees at once, one thread each, over one store: each rank's store requests and its outcome."""
    shared = dist.HashStore()
    views = [CountingStore(shared) for _ in range(world_size)]
    boards = [ClaimBoard(sealed(views[r]), rank=r, world_size=world_size, agreement_timeout_s=timeout_s) for r in range(world_size)]
    outcomes: list[object] = [None] * world_size

    def agree(rank: int) -> None:
        try:
            agreed = boards[rank].agree(claims.get(rank, CLAIM))
            outcomes[rank] = agreed if agreement else agreed.sequence
        except RankDisagreementError as e:
            outcomes[rank] = e

    threads = [threading.Thread(target=agree, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return [v.requests for v in views], outcomes


def test_a_checkpoint_costs_every_rank_the_coordinator_too_the_same_requests_whatever_the_world_size():
    """Before, every rank read every rank's claim (a check and a get each): 2N requests per rank, 2N^2 at the
    store's server (benchmarks/results/scale/run1.txt: 593 at 16 ranks). Then only the coordinator read them,
    one get per rank (benchmarks/results/scale/run4.txt: 8 + N). Now it reads them in one multi_get."""
    requests = {}
    for world_size in (2, 8):
        per_rank, outcomes = _agree_on_every_rank(world_size, {})
        assert outcomes == [0] * world_size  # agreed everywhere, as checkpoint #0
        requests[world_size] = per_rank
    others = {n: set(per_rank[1:]) for n, per_rank in requests.items()}
    assert others[2] == others[8] and len(others[8]) == 1  # the same constant on every other rank, at 2 and at 8
    assert requests[8][0] == requests[2][0]  # the coordinator's: the same constant at 2 and at 8
    assert sum(requests[8]) < 8 * 8  # O(N) at the server


def test_every_rank_raises_the_coordinators_refusal_when_one_rank_claims_another_checkpoint():
    other_checkpoint = {"name": "step-000000004", "version": 4, "requested": 4}
    _, outcomes = _agree_on_every_rank(4, {2: other_checkpoint})
    assert all(isinstance(o, RankDisagreementError) for o in outcomes)
    assert len({str(o) for o in outcomes}) == 1  # the coordinator's verdict, word for word, on every rank
    assert "the ranks disagree" in str(outcomes[0]) and "rank 2 requested it after step 4 (version 4)" in str(outcomes[0])


def test_a_forged_verdict_is_a_named_refusal():
    store = dist.HashStore()
    store.set("verdict/0", '{"refused": null}')  # "agreed", but not sealed by this run's writers
    board = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=5)
    with pytest.raises(RankDisagreementError, match=r"checkpoint #0: the verdict in the store is forged .*not written by overlapckpt"):
        board.agree(CLAIM)


def test_a_rank_whose_coordinator_never_claims_names_it_after_the_timeout():
    store = dist.HashStore()
    board = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=0.2)
    with pytest.raises(RankDisagreementError, match=r"checkpoint #0: ranks \[0\] requested no checkpoint .*rank 1 requested it after step 3"):
        board.agree(CLAIM)


def test_an_idle_coordinator_posts_the_verdict_so_the_others_fail_at_once():
    store = dist.HashStore()
    idle = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=0.0)
    sealed(store).set("claim/0/1", OTHER_CLAIM)
    sealed(store).set("posted/0", "1")
    assert isinstance(idle.missing_claim(), RankDisagreementError)
    other = ClaimBoard(sealed(store), rank=1, world_size=2, agreement_timeout_s=3600)  # would wait an hour for a verdict
    with pytest.raises(RankDisagreementError, match=r"the ranks disagree: rank 0 requested none, rank 1 requested it after step 3"):
        other.agree(CLAIM)


class ClaimDeletedOnceWaitedFor(CountingStore):
    """A store where another client deletes rank 1's claim right after the coordinator's wait saw every claim posted."""

    def __getattr__(self, name):
        method = super().__getattr__(name)
        if name != "wait":
            return method

        def wait_then_delete(keys, timeout):
            method(keys, timeout)
            if "claim/0/1" in keys:
                self.inner.delete_key("claim/0/1")

        return wait_then_delete


def test_a_claim_deleted_after_it_was_posted_is_a_named_refusal_without_waiting_the_stores_timeout():
    from datetime import timedelta

    store = ClaimDeletedOnceWaitedFor()
    store.inner.set_timeout(timedelta(seconds=60))  # a get() of the deleted key would wait this, then raise DistStoreError
    sealed(store.inner).set("claim/0/1", OTHER_CLAIM)
    board = ClaimBoard(sealed(store), rank=0, world_size=2, agreement_timeout_s=5)
    with pytest.raises(RankDisagreementError, match=r"checkpoint #0: ranks \[1\] requested no checkpoint .*rank 0 requested it after step 3"):
        board.agree(CLAIM)
    assert store.inner.timeout == timedelta(seconds=60)  # the client's own timeout, put back after the one-request read


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_that_failed_to_prepare_its_save_claims_its_error_and_every_rank_refuses_at_once_in_step(world_size):
    """Its claim carries the error (persist.py makes the local plan before the claims): no rank waits out the
    agreement timeout, and the next checkpoint's claims are in step on every rank."""
    from helpers import on_every_rank

    store = dist.HashStore()
    boards = [ClaimBoard(SealedStore(store, KEY, ""), rank=r, world_size=world_size, agreement_timeout_s=60) for r in range(world_size)]
    claim = {"name": "step-000000003", "version": 3, "requested": 3}

    def first(rank: int) -> str:
        with pytest.raises(RankDisagreementError) as refused:
            boards[rank].agree({**claim, "failed": "ValueError: boom"} if rank == 1 else claim)
        return str(refused.value)

    for text in on_every_rank(world_size, first, timeout_s=30):
        assert "checkpoint #0: the writer of rank 1 failed before it: ValueError: boom; nothing was committed" == text
    agreed = on_every_rank(world_size, lambda rank: boards[rank].agree({**claim, "name": "step-000000005", "version": 5, "requested": 5}))
    assert [a.sequence for a in agreed] == [1] * world_size
