"""Groups of episodes that share a question (GRPO's num_generations completions of one prompt): the question is
prefilled once after the shared system prompt and forked into one session per completion, and every row of every
group runs in the backend's batched steps at once (as Engine.stream_batch runs its rows)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from app.engine.engine import Engine
from app.engine.session import Session
from app.episode import Episode, EpisodeFinished
from app.settings import Settings, clean_question


@dataclass
class Group:
    """One question's sessions: each holds the system prompt and the question (prefilled once, then forked)."""

    question: str
    sessions: list[Session]
    settings: Settings
    prompt_ids: list[int]  # the system prompt and the question, as every session of the group holds them


def open_group(engine: Engine, question: str, size: int, settings: Settings, seed: int = 0) -> Group:
    """`size` sessions for `question` whose next turn starts after it: the question's ids follow the engine's
    prefilled system prompt in one session, are prefilled there (where the backend holds keys/values in this
    process), and that session is forked `size` times (the system prompt's keys/values stay shared)."""
    question = clean_question(question)
    first = engine.new_session(use_cache=settings.use_cache, seed=seed)
    query = engine.query_ids(first, question, settings)
    first.cache.extend(query)
    if settings.use_cache:
        engine.backend.prefill_rest(first.cache)
    sessions = []
    for j in range(size):
        session = Session(first.cache.fork(), first.prompt_tokens, seed=seed + j)
        session.asked = len(query)
        sessions.append(session)
    return Group(question, sessions, settings, list(first.cache.ids))


def run_groups(engine: Engine, groups: list[Group], cancel: threading.Event | None = None) -> list[list[Episode]]:
    """One turn in every session of every group, all rows at once; each group's episodes in order. A row that fails
    stops the others and raises."""
    rows = [(g, i) for g, group in enumerate(groups) for i in range(len(group.sessions))]
    stop = cancel if cancel is not None else threading.Event()
    workers = max(1, min(len(rows), engine.backend.parallel))
    scopes = [ExitStack() for _ in range(workers)]  # every first row's turn scope opens before any row starts, so
    for scope in scopes:  # their first passes are one step (Engine.stream_batch)
        scope.enter_context(engine.backend.turn_scope())
    episodes: list[list[Episode | None]] = [[None] * len(group.sessions) for group in groups]

    def answer(row: int) -> None:
        g, i = rows[row]
        group = groups[g]
        try:
            if stop.is_set():
                return
            for event in engine.turn(group.sessions[i], group.question, group.settings, stop, row,
                                     scopes[row] if row < workers else None):
                if isinstance(event, EpisodeFinished):
                    episodes[g][i] = event.episode
        except BaseException:
            stop.set()
            raise
        finally:
            if row < workers:
                scopes[row].close()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="group-row") as pool:
        futures = [pool.submit(answer, row) for row in range(len(rows))]
        for future in futures:
            future.result()  # (the first failure raises here)
    missing = [rows.index((g, i)) for g, eps in enumerate(episodes) for i, e in enumerate(eps) if e is None]
    if missing:
        raise RuntimeError(f"rows {missing} ended without an episode (cancelled)")
    return [list(eps) for eps in episodes]  # type: ignore[arg-type]
