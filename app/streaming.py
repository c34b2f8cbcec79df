"""A turn's events produced on a thread of their own and handed to a streaming handler in batches.

Why: Gradio advances a handler's generator one yield at a time from its event loop, so a turn iterated inside the
handler asked the model for its next token only after its last one had been rendered and sent. With 20 API
clients at once the scheduler then waited on the page's loop, not the other way round (a 28 s load phase: 72
steps, the server's two cores busy with per-token updates). Here the turn runs at the model's pace, and each
time the handler comes back it takes every event that arrived meanwhile and renders them once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
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
