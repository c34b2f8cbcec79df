"""Groups of episodes that share a question (GRPO's num_generations completions of one prompt): the question is
prefilled once after the shared system prompt and forked into one session per completion, and every row of every
group runs in the backend's batched steps at once (app.engine.rows)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from app.engine.engine import Engine
from app.engine.rows import Row, stream_rows
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
    asked: int = 0  # the question's ids at the end of every session (its turn adds none)


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
    sessions = [Session(first.cache.fork(), first.prompt_tokens, seed=seed + j) for j in range(size)]
    return Group(question, sessions, settings, list(first.cache.ids), asked=len(query))


def run_groups(engine: Engine, groups: list[Group], cancel: threading.Event | None = None) -> list[list[Episode]]:
    """One turn in every session of every group, all rows at once (app.engine.rows); each group's episodes in order.
    A row that fails stops the others and raises."""
    places = [(g, i) for g, group in enumerate(groups) for i in range(len(group.sessions))]
    rows = [Row(lambda s=groups[g].sessions[i]: s, groups[g].question, groups[g].settings, groups[g].asked)
            for g, i in places]
    episodes: list[list[Episode | None]] = [[None] * len(group.sessions) for group in groups]
    for event in stream_rows(engine, rows, cancel, fail_fast=True):
        if isinstance(event, EpisodeFinished):
            g, i = places[event.row]
            if event.episode.error is not None:
                raise RuntimeError(f"group {g}, row {i} failed: {event.episode.error}")
            episodes[g][i] = event.episode
    missing = [places.index((g, i)) for g, eps in enumerate(episodes) for i, e in enumerate(eps) if e is None]
    if missing:
        raise RuntimeError(f"rows {missing} ended without an episode (cancelled)")
    return [list(eps) for eps in episodes]  # type: ignore[arg-type]
