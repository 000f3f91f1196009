"""The writers' store values, sealed: another client of the job's TCPStore cannot steer or stop the writers.

Each attack is made on a real TCPStore, as a client of it would make it: values written
raw under the writers' keys, a counter replaced with text, a connection the server drops.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing import Pipe

import pytest
import torch.distributed as dist

from overlapckpt.errors import ForgedStoreValueError
from overlapckpt.protocol import WriterGroupSpec, new_store_key
from overlapckpt.writer.group import GENERATION_KEY, WriterGroup, run_keys_prefix
from overlapckpt.writer.process import idle_poll
from overlapckpt.writer.sealed_store import SealedStore

KEY = new_store_key()


def set_on_the_server(store, key: str, value: str) -> None:
    """Set a value and wait until the store server holds it.

    TCPStore's set() returns without an answer from the server, and the server serves each
    client's connection in turn: a second client's request can overtake it. The get() is a
    round trip on the same connection, so it returns only after the set was applied.
    """
    store.set(key, value)
    assert store.get(key) == value.encode()


@pytest.fixture
def master():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store


@pytest.fixture
def group(master):
    spec = WriterGroupSpec(
        store_host="127.0.0.1", store_port=master.port, rank=0, world_size=1, timeout_s=30.0, agreement_timeout_s=5.0,
        mesh_shape=(1,), key_prefix="sealedtest", store_key=KEY,
    )
    writer_group = WriterGroup(spec)  # a one-writer group: joining needs no peer
    yield writer_group
    writer_group.close()


def test_values_open_only_under_their_own_key_name_and_run_key():
    store = dist.HashStore()
    ours, theirs = SealedStore(store, KEY, "p/"), SealedStore(store, new_store_key(), "p/")
    ours.set("a", "15")
    assert ours.get("a") == "15"
    assert theirs.get("a") is None  # another run's key (or a guess)
    assert SealedStore(store, KEY, "q/").get("a") is None  # the same key under another prefix
    store.set("b", store.get("a"))
    assert ours.get("b") is None  # a sealed value moved to another name
    store.set("c", "15")
    assert ours.get("c") is None  # unsealed


def test_concurrent_increments_each_count_once():
    store = SealedStore(dist.HashStore(), KEY, "")
    results: list[int] = []

    def bump() -> None:
        for _ in range(200):
            results.append(store.increment("n", 1))

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == list(range(1, 801))  # every increment won exactly once
    assert store.read_counter("n") == 800


def test_a_forged_counter_is_refused_by_name_and_the_connection_survives(master):
    prefix = "overlapckpt-writers/x/"
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    sealed = SealedStore(dist.PrefixStore(prefix, client), KEY, prefix)
    sealed.increment(GENERATION_KEY, 0)
    set_on_the_server(dist.PrefixStore(prefix, master), GENERATION_KEY, "xyz")  # another client replaced it
    assert sealed.read_counter(GENERATION_KEY) is None
    with pytest.raises(ForgedStoreValueError, match=r"overlapckpt-writers/x/generation in the job's store holds a value this run's writers did not write"):
        sealed.increment(GENERATION_KEY, 1)
    # compare_set and get never hit the server's integer parse: the connection still works (add did not).
    assert sealed.check([GENERATION_KEY])


def test_an_idle_writer_ignores_a_forged_generation_and_claim_marker(group, master, caplog):
    run_keys = dist.PrefixStore(run_keys_prefix(group.spec), master)
    agree_keys = dist.PrefixStore(run_keys_prefix(group.spec) + "agree/", master)
    set_on_the_server(run_keys, GENERATION_KEY, "xyz")
    set_on_the_server(agree_keys, "posted/0", "xyz")
    set_on_the_server(agree_keys, "count/0", "xyz")  # the counter earlier releases polled with add()
    reader, writer = Pipe(duplex=False)
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        for _ in range(3):
            idle_poll(writer, group)
    assert not reader.poll(0)  # no refusal or error sent to the trainer
    assert group.generation == 0 and group.claims.sequence == 0
    assert [r.getMessage() for r in caplog.records if "generation counter" in r.getMessage()] != []


def test_an_idle_writer_whose_store_connection_broke_reconnects(group, master, caplog):
    # Break the group's own connection for real: add() on a value that is not a number makes
    # the store server drop that client (what a poisoned counter did to the writers before).
    set_on_the_server(master, "poison", "xyz")
    with pytest.raises(dist.DistNetworkError):
        group._base.add("poison", 1)
    group.claims.sequence = 4
    reader, writer = Pipe(duplex=False)
    with caplog.at_level(logging.WARNING, logger="overlapckpt"):
        idle_poll(writer, group)  # the store error is logged, and the group connects again
    assert any("lost the job's store while idle" in r.getMessage() for r in caplog.records)
    idle_poll(writer, group)  # the new connection works
    assert not reader.poll(0)
    assert group.claims.sequence == 4  # the checkpoints decided so far are kept
    prefix = run_keys_prefix(group.spec)
    SealedStore(dist.PrefixStore(prefix, master), KEY, prefix).increment(GENERATION_KEY, 1)
    assert group.generation_moved()  # and it still sees a real replacement


def a_client_waiting_60_s(master, kind: str):
    """A client of ``master`` (TCPStore) or a HashStore, whose get() of a missing key would wait 60 s."""
    from datetime import timedelta

    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=60))
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=60))
    return store


@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_read_raw_answers_absent_keys_at_once_and_creates_none(master, kind):
    store = a_client_waiting_60_s(master, kind)
    prefixed = dist.PrefixStore("r", store)
    sealed = SealedStore(prefixed, KEY, "r/")
    # A get() of a missing key would wait the store's 60 s and raise; read_raw answers None at once.
    assert sealed.read_raw("missing") is None
    assert sealed.get("missing") is None
    assert not prefixed.check(["missing"])  # nothing created by asking
    sealed.set("there", "7")
    prefixed.set("forged", b"\0absent:0123")  # shaped like read_raw's own mark, yet stored: it is answered as stored
    assert sealed.read_raw("forged") == b"\0absent:0123" and sealed.get("forged") is None
    assert sealed.open("there", sealed.read_raw("there")) == "7" and sealed.get("there") == "7"
    assert prefixed.get("there") == sealed.seal("there", "7").encode()  # reading changed nothing


class DeletesAfterTheWait:
    """A client of a real store under which another client deletes ``gone`` right before a multi_get reaches the server."""

    def __init__(self, store, gone: str) -> None:
        self.store, self.gone, self.multi_gets = store, gone, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def multi_get(self, keys):
        self.multi_gets += 1
        self.store.delete_key(self.gone)
        return self.store.multi_get(keys)


@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_read_posted_reads_every_key_in_one_request_and_a_key_deleted_since_as_absent(master, kind):
    from datetime import timedelta

    store = a_client_waiting_60_s(master, kind)
    prefixed = dist.PrefixStore("p", store)
    sealed = SealedStore(prefixed, KEY, "p/")
    for rank in range(3):
        sealed.set(f"claim/{rank}", str(rank))
    prefixed.set("claim/3", "forged")
    names = [f"claim/{rank}" for rank in range(4)]
    raws = sealed.read_posted(names)
    assert [sealed.open(n, r) for n, r in zip(names[:3], raws[:3])] == ["0", "1", "2"] and raws[3] == b"forged"
    # A multi_get of a key deleted since would wait the client's 60 s: read_posted cuts that wait
    # to POSTED_READ_TIMEOUT, then reads each key on its own, which never waits.
    deleting = DeletesAfterTheWait(prefixed, "claim/1")
    raws = SealedStore(deleting, KEY, "p/").read_posted(names)
    assert deleting.multi_gets == 1 and raws[1] is None and sealed.open("claim/2", raws[2]) == "2"
    assert prefixed.timeout == store.timeout == timedelta(seconds=60)  # the client's timeout put back
    assert sealed.read_posted([]) == []


class AnswersADeletedKeyEmpty:
    """A store whose multi_get answers one key empty: what a store's server answers for a key deleted between its wait and the read."""

    def __init__(self, store, emptied: str) -> None:
        self.store, self.emptied = store, emptied

    def __getattr__(self, name):
        return getattr(self.store, name)

    def multi_get(self, keys):
        return [b"" if key == self.emptied else value for key, value in zip(keys, self.store.multi_get(keys))]


def test_read_posted_reads_an_empty_answer_as_absent_not_forged():
    store = dist.HashStore()
    sealed = SealedStore(store, KEY, "")
    sealed.set("claim/0", "0")
    sealed.set("claim/1", "1")
    raws = SealedStore(AnswersADeletedKeyEmpty(store, "claim/1"), KEY, "").read_posted(["claim/0", "claim/1"])
    assert sealed.open("claim/0", raws[0]) == "0" and raws[1] is None
