"""A turn's events on a thread of their own, handed over in batches (app.serving.streaming)."""

from __future__ import annotations

import threading
import time

import pytest

from app.serving.streaming import in_batches


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
    the last one; now a slow consumer gets everything that arrived meanwhile in one batch. (No timing: the turn
    holds its second event until the page has its first, and the page renders until the turn has ended.)"""
    cancel, seen = threading.Event(), []
    page_has_first, turn_ended = threading.Event(), threading.Event()

    def turn():
        for i in counting(20, cancel, seen):
            yield i
            if i == 0:
                page_has_first.wait()
        turn_ended.set()

    batches = in_batches(turn(), cancel)
    first = next(batches)
    page_has_first.set()
    turn_ended.wait()  # the page is busy rendering `first` (without a thread of its own, the turn never ends)
    assert first == [0] and len(seen) == 20  # ... and the turn went on meanwhile
    assert list(batches) == [list(range(1, 20))]  # everything that arrived meanwhile, in one batch


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


def test_a_closed_stream_returns_at_once_and_its_handler_closes_on_a_thread():
    """Regression: Gradio closes a stream whose client went away with `iterator.close()` on its event loop, and a
    turn's handler waits there for the turn to end (in_batches: up to one step) and gives back its place in the
    KV budget; meanwhile every visitor's stream stalled. The wrapped handler's close returns at once; its
    `finally` runs, in order, on a thread. Its signature is the handler's (Gradio reads the inputs from it)."""
    import inspect

    from app.serving.streaming import closes_elsewhere

    ended, proceed, finished = [], threading.Event(), threading.Event()
    caller = threading.current_thread()

    def handler(message: str, request=None, seed=0):
        """the handler's own words"""
        try:
            yield from range(10)
        finally:
            if threading.current_thread() is caller and message == "hi":  # (the close waited for the finally)
                ended.append("closed on the caller's thread")
            else:
                proceed.wait()  # (a turn ending: the next step, which comes after close has returned)
                ended.append(message)
                finished.set()

    wrapped = closes_elsewhere(handler)
    assert inspect.isgeneratorfunction(wrapped) and inspect.signature(wrapped) == inspect.signature(handler)
    assert wrapped.__doc__ == handler.__doc__
    stream = wrapped("hi")
    assert next(stream) == 0
    stream.close()
    assert ended == []  # (not waiting for the handler's finally, which waits for `proceed`)
    proceed.set()
    finished.wait()
    assert ended == ["hi"]
    assert list(wrapped("all")) == list(range(10)) and ended == ["hi", "all"]  # (run to its end: as before)


def test_the_pages_streaming_handlers_close_off_the_event_loop(tiny_llama):
    """The page's turns, Compare and Batch, and the /chat API are registered wrapped (closes_elsewhere)."""
    import inspect

    from app.serving import MB, Service
    from components.layout import build_demo
    from components.page import Page

    def handler_of(wrapped):
        """The handler that closes_elsewhere wraps: through components.wiring.page_event's adapter (its `handler`)
        where the page's typed updates are wired."""
        inner = wrapped.__wrapped__
        return inspect.getclosurevars(inner).nonlocals.get("handler", inner)

    page = Page(Service(loader=lambda: tiny_llama, budget_bytes=512 * MB, idle_timeout_s=3600))
    demo = build_demo(page)
    by_name = {fn.api_name: fn.fn for fn in demo.fns.values()}
    for name, handler in [("ui_turn", page.chat.turn), ("ui_submit", page.chat.turn), ("ui_compare", page.chat.compare),
                          ("ui_compare_guide", page.chat.compare_guide), ("ui_batch", page.batch.run),
                          ("chat", page.api.chat)]:
        assert getattr(by_name[name], "__wrapped__", None) is not None, name
        assert handler_of(by_name[name]) == handler, name
