"""A snapshot whose copies have landed reaches the writer while the loop is idle (train/lifecycle/landing_watch.py).

Before: the last step's checkpoint waited, unlisted, for the next hook: a loop that paused
after it (evaluation, a data stall) left it in host memory for as long as the pause, and a
kill during the pause lost it. Here the loop trains to the checkpoint's step and then calls
nothing of overlapckpt: the checkpoint must commit and be listed within the timeout.
"""

from __future__ import annotations

import threading
import time

import pytest

from overlapckpt import Checkpointer, list_checkpoints
from overlapckpt.train.lifecycle.landing_watch import LandingWatch, WatchState

from helpers import assert_state_equal, make_run, snapshot, train_step

LISTED_WITHIN_S = 60.0


def _listed_while_idle(root: str) -> list[int]:
    """Wait on the checkpoint itself: poll the listing until it shows one, or the timeout passes."""
    deadline = time.monotonic() + LISTED_WITHIN_S
    while time.monotonic() < deadline:
        steps = [i.step for i in list_checkpoints(root)]
        if steps:
            return steps
        time.sleep(0.02)  # a listing's poll interval, not a wait for work: the work is the checkpoint above
    return []


# Replay's scheduled window opens W-1 steps early, so its copies are all queued by step 4; stage mode
# copies step 4 into device memory and drains it to the host over the next W-1 steps.
@pytest.mark.parametrize("window,consistency,steps", [(1, "replay", 4), (3, "replay", 4), (3, "stage", 6)])
def test_the_last_steps_checkpoint_commits_while_the_loop_is_idle(tmp_path, window, consistency, steps):
    model, opt, sched, sampler = make_run()
    root = str(tmp_path)
    with Checkpointer(model, opt, root, window=window, consistency=consistency, every=4, stateful={"sched": sched}) as ckpt:
        expected = None
        for step in range(1, steps + 1):
            train_step(model, opt, sched, sampler)
            ckpt.step()
            if step == 4:
                expected = snapshot(model, opt)
        assert _listed_while_idle(root) == [4]  # no hook, no wait(), no close() yet
    fresh, fresh_opt, _, _ = make_run(seed=9)
    from overlapckpt import load

    load(root, fresh, fresh_opt, step=4)
    assert expected is not None
    assert_state_equal(*expected, fresh, fresh_opt)


class _ClosedTicket:
    landed_at_s = None
    done_event = None


def test_the_watch_stops_when_closed_even_while_a_copy_never_lands():
    never = threading.Event()
    progressed: list[int] = []

    def await_landing(ticket, timeout_s):
        return never.wait(timeout_s)  # a copy that never lands: the watch waits in slices

    watch = LandingWatch(threading.RLock(), await_landing, lambda: progressed.append(1), lambda e: None)
    watch.note([_ClosedTicket()])
    watch.close()
    assert watch.state is WatchState.CLOSED and progressed == []
