"""A turn's events on a thread of their own, handed over in batches (app.streaming)."""

from __future__ import annotations

import threading
import time

import pytest

from app.streaming import in_batches


def counting(n: int, cancel: threading.Event, seen: list[int], pause_s: float = 0.0):
    for i in range(n):
        if cancel.is_set():
            return
        seen.append(i)
        yield i
        time.sleep(pause_s)


def test_every_event_arrives_once_in_order_and_no_batch_is_empty():
    cancel = threading.Event()
    batches = list(in_batches(counting(50, cancel, []), cancel))
    assert [e for batch in batches for e in batch] == list(range(50))
    assert all(batches) and not cancel.is_set()


def test_the_turn_runs_at_its_own_pace_while_the_page_renders():
    """Regression: iterated inside the handler, a turn asked for its next token only after the page had rendered
    the last one; now a slow consumer gets everything that arrived meanwhile in one batch."""
    cancel, seen = threading.Event(), []
    batches = in_batches(counting(20, cancel, seen), cancel)
    first = next(batches)
    time.sleep(0.3)  # the page is busy rendering `first`
    assert len(seen) == 20  # ... and the turn went on meanwhile
    rest = [e for batch in batches for e in batch]
    assert first + rest == list(range(20)) and len(rest) > 1


def test_an_error_is_raised_after_the_events_before_it():
    def failing():
        yield 1
        yield 2
        raise ValueError("the model failed")

    got, cancel = [], threading.Event()
    with pytest.raises(ValueError, match="the model failed"):
        for batch in in_batches(failing(), cancel):
            got += batch
    assert got == [1, 2]
    assert not cancel.is_set()  # (a failed turn is over, not stopped: the session's Stop flag stays as it was)


def test_leaving_early_cancels_the_turn_and_waits_for_it_to_end():
    cancel, seen = threading.Event(), []
    batches = in_batches(counting(10_000, cancel, seen, pause_s=0.001), cancel)
    next(batches)
    batches.close()  # the page was closed
    assert cancel.is_set()
    stopped_at = len(seen)
    time.sleep(0.05)
    assert len(seen) == stopped_at < 10_000  # the producer has ended: nothing more is produced
    assert not [t for t in threading.enumerate() if t.name == "turn-events"]
