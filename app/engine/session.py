"""One conversation's state: its tokens and KV cache, its episodes, its sampling generator, its lock."""

from __future__ import annotations

import threading

import torch

from app.episode import Episode, Span
from app.model.kvcache import TokenCache


class Session:
    """One conversation: its tokens and KV cache, its episodes, its sampling generator, its lock."""

    def __init__(self, cache: TokenCache, prompt_tokens: int, seed: int = 0):
        self.cache = cache
        self.prompt_tokens = prompt_tokens
        self.episodes: list[Episode] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()

    def fork(self, kv: bool = True, turns: int | None = None) -> "Session":
        """An independent copy (tokens, history so far, and the cache unless kv=False), e.g. to run one question
        two ways side by side; `turns`: only the first turns, as they were before the next one was asked (to
        run a turn again; the sampling generator's state stays the latest)."""
        with self.lock:
            other = Session(self.cache.fork() if kv else TokenCache(self.cache.ids), self.prompt_tokens)
            other.episodes = list(self.episodes[:turns])
            if len(other.episodes) < len(self.episodes):
                other.cache.truncate(self.episodes[len(other.episodes)].query_start)
            other.generator.set_state(self.generator.get_state())
            return other

    def spans(self) -> list[Span]:
        """Who wrote each part of the session's tokens: system prompt, user, model, tool."""
        spans = [Span("system", 0, self.prompt_tokens)]
        for episode in self.episodes:
            spans.append(Span("user", episode.query_start, episode.query_end))
            spans.extend(Span(s.kind, s.start, s.end) for s in episode.segments)
        return [s for s in spans if s.end > s.start]
