"""Run one question with the cache on and off, side by side, from the same point of a session."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass

from app.engine import Engine, Episode, Session, Settings


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


def compare(engine: Engine, session: Session, question: str, settings: Settings,
            cancel: threading.Event | None = None, turns: int | None = None) -> Comparison:
    """Each run works on its own fork of the session (of its first `turns` turns: Session.fork), so the session
    itself is left as it was. A set `cancel` stops both runs between tokens (their segments say so)."""
    runs = []
    for use_cache in (True, False):
        fork = session.fork(kv=use_cache, turns=turns)  # the uncached run would drop a copied cache at once
        began = time.perf_counter()
        episode = engine.ask(fork, question, dataclasses.replace(settings, use_cache=use_cache), cancel)
        runs.append((episode, time.perf_counter() - began))
    (cached, cached_s), (uncached, uncached_s) = runs
    return Comparison(cached, uncached, cached_s, uncached_s)
