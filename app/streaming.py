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
_END = object()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def in_batches(events: Iterator[T], cancel: threading.Event) -> Iterator[list[T]]:
    """Run `events` on a thread; yield lists (never empty) of the events that arrived since the last yield. An
    exception the iterator raises is raised here, after the events before it. Leaving early (a break, a closed
    stream) sets `cancel`, which the iterator must watch, and waits for it to end: the turn is over on return."""
    handed: queue.SimpleQueue = queue.SimpleQueue()

    def produce() -> None:
        try:
            for event in events:
                handed.put(event)
        except BaseException as error:  # the thread's boundary: the consumer raises it
            handed.put(_Failed(error))
        finally:
            handed.put(_END)

    thread = threading.Thread(target=produce, name="turn-events", daemon=True)
    thread.start()
    ended = False
    try:
        while not ended:
            batch, item = [], handed.get()
            while True:
                if item is _END:
                    ended = True
                    break
                if isinstance(item, _Failed):
                    ended = True  # (the turn is over: nothing to cancel)
                    if batch:
                        yield batch
                    raise item.error
                batch.append(item)
                try:
                    item = handed.get_nowait()
                except queue.Empty:
                    break
            if batch:
                yield batch
    finally:
        if not ended:
            cancel.set()
        thread.join()
