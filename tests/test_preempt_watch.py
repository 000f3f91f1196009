"""The writers' preemption watch over a real TCPStore: forged values are refused, real signals agree.

Two watches (ranks 0 and 1 of one run) over one store and two real control pages, as
each rank's writer runs them. Another client of the store writes the values the issue
found: ``"not-a-number"`` (every rank exited by SIGTERM without a checkpoint), ``"9"``
(every rank raised OSError installing SIGKILL), and a well-formed ``"15"`` that is not
sealed with the run's key. Each is refused and counted; no rank holds or agrees; then
a real signal on one rank makes both agree on one step.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch.distributed as dist

from overlapckpt.control_page import AGREED, AGREED_SIGNAL, FORGED, HOLD, NOT_YET, SIGNAL, STEP, OwnedControlPage
from overlapckpt.protocol import WriterGroupSpec, new_store_key
from overlapckpt.writer.group import run_keys_prefix
from overlapckpt.writer.preempt_watch import AGREEMENT_MARGIN_STEPS, PreemptionWatch
from overlapckpt.writer.sealed_store import SealedStore

KEY = new_store_key()
WAIT_S = 30.0


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {WAIT_S} s waiting for {what}")
        time.sleep(0.005)  # polls the page the watch writes: the watch's own work, bounded above


@pytest.fixture
def run():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    specs = [
        WriterGroupSpec(
            store_host="127.0.0.1", store_port=master.port, rank=r, world_size=2, timeout_s=30.0, agreement_timeout_s=5.0,
            mesh_shape=(2,), key_prefix="watchtest", store_key=KEY,
        )
        for r in range(2)
    ]
    pages = [OwnedControlPage(), OwnedControlPage()]
    yield master, specs, pages
    for page in pages:
        page.buffer.release()


def _preempt_keys(master, spec) -> dist.PrefixStore:
    return dist.PrefixStore(run_keys_prefix(spec) + "preempt/", master)


def test_forged_signals_are_refused_and_a_real_one_is_agreed(run):
    master, specs, pages = run
    watches = [PreemptionWatch(page, spec, timeout_s=20.0, signals=(signal.SIGTERM,)) for page, spec in zip(pages, specs)]
    keys = _preempt_keys(master, specs[0])
    forged = [b"not-a-number", b"9", b"15", SealedStore(keys, new_store_key(), "").seal("signal", "15").encode()]
    for count, value in enumerate(forged, start=1):
        keys.set("signal", value)
        _wait_for(lambda count=count: all(p.read(FORGED) >= count for p in pages), f"both watches to refuse {value!r}")
    sealed_sigusr1 = SealedStore(keys, KEY, run_keys_prefix(specs[0]) + "preempt/")
    sealed_sigusr1.set("signal", str(int(signal.SIGUSR1)))  # sealed, but not in save_on_signal
    _wait_for(lambda: all(p.read(FORGED) >= len(forged) + 1 for p in pages), "both watches to refuse SIGUSR1")
    for page in pages:
        assert page.read(HOLD) == 0 and page.read(AGREED) == NOT_YET and page.read(AGREED_SIGNAL) == 0
    keys.delete_key("signal")

    pages[0].write(STEP, 7)
    pages[1].write(STEP, 9)
    pages[1].write(SIGNAL, int(signal.SIGTERM))  # rank 1's trainer was signalled
    _wait_for(lambda: all(p.read(AGREED) != NOT_YET for p in pages), "both ranks to agree")
    for page in pages:
        assert page.read(AGREED) == 9 + AGREEMENT_MARGIN_STEPS
        assert page.read(AGREED_SIGNAL) == int(signal.SIGTERM)
    for watch in watches:
        watch.thread.join(timeout=WAIT_S)
        assert not watch.thread.is_alive()


def test_a_forged_step_is_not_counted_until_the_rank_posts_its_own(run):
    master, specs, pages = run
    watch = PreemptionWatch(pages[0], specs[0], timeout_s=20.0, signals=(signal.SIGTERM,))
    keys = _preempt_keys(master, specs[0])
    keys.set("step/1", "1000")  # rank 1's step, forged: it would have moved the agreed step to 1002
    pages[0].write(STEP, 4)
    pages[0].write(SIGNAL, int(signal.SIGTERM))
    _wait_for(lambda: pages[0].read(FORGED) >= 1, "rank 0's watch to refuse the forged step")
    assert pages[0].read(HOLD) == 1 and pages[0].read(AGREED) == NOT_YET
    prefix = run_keys_prefix(specs[1]) + "preempt/"
    SealedStore(keys, KEY, prefix).set("step/1", "5")  # what rank 1's writer posts
    _wait_for(lambda: pages[0].read(AGREED) != NOT_YET, "rank 0 to agree")
    assert pages[0].read(AGREED) == 5 + AGREEMENT_MARGIN_STEPS
    watch.thread.join(timeout=WAIT_S)


class DeletedRightAfterEachRead:
    """A watch's client of the job's store, where another client deletes ``key`` right after each answer that it is there.

    The CI run that found it: rank 0's test code deleted its forged ``signal`` between
    rank 1's watch's ``check`` (there) and its ``get``, which waits for a missing key until
    the store's timeout (30 s here); rank 1's own SIGTERM went unposted past the grace.
    """

    def __init__(self, inner: dist.Store, key: str) -> None:
        self.inner = inner
        self.key = key
        self.deleted = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _delete(self) -> None:
        self.inner.delete_key(self.key)
        self.deleted += 1

    def check(self, keys):
        there = self.inner.check(keys)
        if there and self.key in keys:
            self._delete()
        return there

    def get(self, key):
        value = self.inner.get(key)
        if key == self.key:
            self._delete()
        return value

    def compare_set(self, key, expected, desired):
        answer = self.inner.compare_set(key, expected, desired)
        if key == self.key and answer != (expected.encode() if isinstance(expected, str) else expected):
            self._delete()
        return answer


class WatchWhoseSignalIsDeletedAfterEachRead(PreemptionWatch):
    def _connect(self) -> SealedStore:
        sealed = super()._connect()
        sealed.store = DeletedRightAfterEachRead(sealed.store, "signal")
        return sealed


def test_a_signal_key_deleted_while_the_watch_reads_it_neither_stalls_nor_stops_the_watch(run):
    master, specs, pages = run
    watches = [
        WatchWhoseSignalIsDeletedAfterEachRead(pages[0], specs[0], timeout_s=20.0, signals=(signal.SIGTERM,)),
        PreemptionWatch(pages[1], specs[1], timeout_s=20.0, signals=(signal.SIGTERM,)),
    ]
    keys = _preempt_keys(master, specs[0])
    keys.set("signal", "9")  # forged, and deleted as soon as rank 0's watch has read it
    _wait_for(lambda: pages[0].read(FORGED) == 1, "rank 0's watch to refuse the forged signal it read")
    assert watches[0].store.store.deleted == 1 and not keys.check(["signal"])
    assert pages[0].read(HOLD) == 0 and pages[0].read(AGREED) == NOT_YET

    pages[0].write(STEP, 3)
    pages[1].write(STEP, 4)
    pages[1].write(SIGNAL, int(signal.SIGTERM))  # rank 1's trainer: its watch posts; rank 0's reads it once, then it is gone
    _wait_for(lambda: all(p.read(AGREED) != NOT_YET for p in pages), "both ranks to agree")
    assert [p.read(AGREED) for p in pages] == [4 + AGREEMENT_MARGIN_STEPS] * 2
    for watch in watches:
        watch.thread.join(timeout=WAIT_S)
        assert not watch.thread.is_alive()
