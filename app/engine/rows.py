"""Many turns at once, each in its own session: the one runner of the Batch tab, the CLI's questions, Engine.run and
GRPO's groups (app.engine.groups). Every row's segments share the backend's batched steps; its events carry the
row's index in the caller's list."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Protocol

from app.backends.base import Backend
from app.engine.session import Session
from app.episode import EpisodeFinished, Event
from app.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One turn: `question` in the session `session()` makes (called in the row's own thread), with `settings`;
    `asked`: how many of that session's last ids are the question already (a group's fork)."""

    session: Callable[[], Session]
    question: str
    settings: Settings
    asked: int = 0


class Turns(Protocol):
    """What the runner needs of an engine (app.engine.engine.Engine)."""

    backend: Backend

    def turn(self, session: Session, question: str, settings: Settings | None = None,
             cancel: threading.Event | None = None, scope: AbstractContextManager[None] | None = None,
             asked: int = 0) -> Iterator[Event]: ...


def stream_rows(engine: Turns, rows: Sequence[Row], cancel: threading.Event | None = None,
                fail_fast: bool = False) -> Iterator[Event]:
    """Every row's events, interleaved as they come, each tagged with its row (in_row_order sorts them). A row that
    fails before its turn ran (its session could not be made) fails the whole run; one that fails mid-turn ends with
    its episode's `error` set, and the others go on, or with `fail_fast` stop at their next step. Closing the stream
    stops every row."""
    stop = cancel if cancel is not None else threading.Event()
    events: queue.SimpleQueue = queue.SimpleQueue()
    workers = max(1, min(len(rows), engine.backend.parallel))
    # The first rows' turn scopes open before any row starts, so the backend waits for all of their questions and
    # prefills them in one step (opened by each row's thread, the first question would take a step alone).
    scopes = [ExitStack() for _ in range(workers)]  # (`with` one is a no-op on entry and leaves the scope on exit)
    for scope in scopes:
        scope.enter_context(engine.backend.turn_scope())

    def answer(index: int, row: Row) -> None:
        session = None
        scope = scopes[index] if index < workers else None
        try:
            if stop.is_set():
                return
            session = row.session()
            for event in engine.turn(session, row.question, row.settings, stop, scope, row.asked):
                events.put(dataclasses.replace(event, row=index))
        except Exception as error:
            if session is None or not session.episodes:  # nothing ran: the whole run is wrong
                events.put(error)
                return
            log.exception("row %d failed", index)  # (its episode shows the message; the log, why)
            episode = session.episodes[-1]
            episode.error = str(error)
            events.put(EpisodeFinished(episode, index))
            if fail_fast:
                stop.set()
        finally:
            if scope is not None:
                scope.close()  # (the turn closed it, unless it never ran)
            events.put(index)  # this row is done

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="row") as pool:
        try:
            for index, row in enumerate(rows):
                pool.submit(answer, index, row)
            for _ in rows:
                while not isinstance(item := events.get(), int):
                    if isinstance(item, Exception):
                        raise item
                    yield item
        except BaseException:  # a bad row, or the consumer closed the stream: the others stop at their next step
            stop.set()
            raise
