"""Run one question two ways, side by side, from the same point of a session: the cache on and off (what the cache
saves), or the guide on and off (what the model writes alone, app.decoding.guide)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from app.engine.session import Session
from app.engine.engine import Engine
from app.episode import Episode
from app.episode import total_or_none
from app.settings import Settings


@dataclass(frozen=True)
class Comparison:
    cached: Episode
    uncached: Episode
    cached_s: float
    uncached_s: float

    @property
    def identical(self) -> bool:
        """Same tokens either way (what greedy decoding promises)."""
        return self.cached.token_ids == self.uncached.token_ids

    @property
    def stopped(self) -> bool:
        """Stop cut one of the runs short: its time and tokens say nothing about the cache."""
        return self.cached.cut_short or self.uncached.cut_short

    @property
    def speedup(self) -> float:
        return self.uncached_s / self.cached_s if self.cached_s > 0 else float("inf")


@dataclass(frozen=True)
class GuideComparison:
    """The same question with the guide on and off: what the guide chose, and what the model writes alone."""

    guided: Episode
    unguided: Episode
    guided_s: float
    unguided_s: float

    @property
    def same_answer(self) -> bool:
        return self.guided.answer == self.unguided.answer

    @property
    def stopped(self) -> bool:
        """Stop cut one of the runs short: its answer is not the one it would have written."""
        return self.guided.cut_short or self.unguided.cut_short


def forced_tokens(episode: Episode) -> int:
    """Tokens the guide forced over the episode's model segments."""
    return sum(s.forced_tokens for s in episode.model_segments)


def steered_tokens(episode: Episode) -> int | None:
    """Tokens the guide steered over the episode's model segments; None where a model server cannot say."""
    return total_or_none(s.steered_tokens for s in episode.model_segments)


def _run_twice(engine: Engine, session: Session, question: str, runs: list[tuple[Settings, bool]],
               cancel: threading.Event | None, turns: int | None) -> list[tuple[Episode, float]]:
    """Each run (its settings, and whether its fork copies the session's cache) on its own fork of the session (of
    its first `turns` turns: Session.fork), so the session itself is left as it was; with the wall time of each."""
    out = []
    for settings, kv in runs:
        fork = session.fork(kv=kv, turns=turns)
        began = time.perf_counter()
        episode = engine.ask(fork, question, settings, cancel)
        out.append((episode, time.perf_counter() - began))
    return out


def compare(engine: Engine, session: Session, question: str, settings: Settings,
            cancel: threading.Event | None = None, turns: int | None = None) -> Comparison:
    """The cache on, then off. A set `cancel` stops both runs between tokens (their segments say so)."""
    runs = [(dataclasses.replace(settings, use_cache=use_cache), use_cache)  # (the uncached run would drop a
            for use_cache in (True, False)]                                 # copied cache at once)
    (cached, cached_s), (uncached, uncached_s) = _run_twice(engine, session, question, runs, cancel, turns)
    return Comparison(cached, uncached, cached_s, uncached_s)


def compare_guide(engine: Engine, session: Session, question: str, settings: Settings,
                  cancel: threading.Event | None = None, turns: int | None = None) -> GuideComparison:
    """The guide on, then off, with the cache as `settings` say. A set `cancel` stops both runs between tokens."""
    runs = [(dataclasses.replace(settings, guide=guide), settings.use_cache) for guide in (True, False)]
    (guided, guided_s), (unguided, unguided_s) = _run_twice(engine, session, question, runs, cancel, turns)
    return GuideComparison(guided, unguided, guided_s, unguided_s)
