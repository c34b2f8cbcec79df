"""A turn's events produced on a thread of their own and handed to a streaming handler in batches.

Why: Gradio advances a handler's generator one yield at a time from its event loop, so a turn iterated inside the
handler would ask the model for its next token only after its last one had been rendered and sent, and under load
the scheduler would wait on the page's loop (docs/concurrency.md). Here the turn runs at the model's pace, and
each time the handler comes back it takes every event that arrived meanwhile and renders them once.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class _Done:
    """The producer's last item: the turn ended, with `error` if it raised."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def in_batches(events: Iterator[T], cancel: threading.Event) -> Iterator[list[T]]:
    """Run `events` on a thread; yield lists (never empty) of the events that arrived since the last yield. An
    exception the iterator raises is raised here, after the events before it. Leaving early (a break, a closed
    stream) sets `cancel`, which the iterator must watch, and waits for it to end: the turn is over on return."""
    handed: queue.SimpleQueue = queue.SimpleQueue()

    def produce() -> None:
        error = None
        try:
            for event in events:
                handed.put(event)
        except BaseException as exc:  # the thread's boundary: the consumer raises it
            error = exc
        handed.put(_Done(error))

    thread = threading.Thread(target=produce, name="turn-events", daemon=True)
    thread.start()
    done: _Done | None = None
    try:
        while done is None:
            items = [handed.get()]
            while not handed.empty():
                items.append(handed.get_nowait())
            if isinstance(items[-1], _Done):  # (always the last item: nothing follows it)
                done = items.pop()
            if items:
                yield items
        if done.error is not None:
            raise done.error
    finally:
        if done is None:  # left early: stop the turn (a turn that ended or failed is over already)
            cancel.set()
        thread.join()


def closes_elsewhere(handler: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    """A streaming handler whose stream, when closed early, is closed on a thread of its own: Gradio closes a
    gone client's generator on its event loop, and closing a turn's handler waits for the turn to end, which would
    stall every visitor's stream. The wrapper keeps the handler's signature, so the framework reads the same inputs."""

    @functools.wraps(handler)
    def streaming(*args, **kwargs) -> Iterator[T]:
        yield from _ClosedElsewhere(handler(*args, **kwargs))

    return streaming


class _ClosedElsewhere:
    """An iterator over a generator; `close` (which `yield from` calls when its own generator is closed) hands the
    generator's close to a thread. (The generator is suspended then: the one that delegates to it is not running.)"""

    def __init__(self, inner: Iterator[T]):
        self._inner = inner

    def __iter__(self) -> _ClosedElsewhere:
        return self

    def __next__(self) -> T:
        return next(self._inner)

    def close(self) -> None:
        threading.Thread(target=self._inner.close, name="stream-close", daemon=True).start()
