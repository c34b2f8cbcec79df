"""One in-process model segment between its passes: a row of the scheduler's steps (app.backends.scheduler). It holds
the tokens the model agrees with (drafts) and its own next one, the guide's forced tokens, the stop check and the next
drafts. The scheduler owns the row while its passes run and updates it from each pass's result in its own thread,
right after the pass, as a serving engine's loop does; what comes back is plain data (RowStep)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from app.backends.tokens import SegmentTokens
from app.decoding.choose import choose_tokens
from app.decoding.guide_matcher import GuideMatcher
from app.decoding.sampling import PromptLookup, token_logprobs
from app.episode import Segment, Stop, StopReason
from app.settings import Settings

# Draft tokens one step verifies across its rows: each row drafts at most DRAFTS_PER_STEP // rows. A verified token
# costs about the same in any batch while a row's share of a step shrinks as rows join, so a draft pays alone even
# when rarely accepted and in a full batch only when likely (the values tried: docs/concurrency.md).
DRAFTS_PER_STEP = 16


@dataclass(frozen=True)
class RowStep:
    """What a row's update gives back: the text its tokens added, and the next pass's keep (None: the segment is
    over, its record's stop says why)."""

    deltas: list[str]
    keep: int | None


class Row:
    """A model segment's state between its passes; its `record` takes each stop from the code that stopped it."""

    def __init__(self, tokens: SegmentTokens, settings: Settings, cancel: threading.Event | None,
                 generator: torch.Generator, guide: GuideMatcher | None, opening: tuple[int, ...] = ()):
        self.tokens, self.cache, self.settings, self.cancel = tokens, tokens.cache, settings, cancel
        self.generator, self.guide, self.opening = generator, guide, list(opening)
        self.first = True  # before the segment's first pass (its prefill)
        greedy_drafts = settings.draft_tokens and settings.temperature <= 0
        self.lookup = PromptLookup(self.cache.ids) if greedy_drafts else None
        # Draft length adapts like transformers' assisted generation: +2 after a fully accepted draft, -1 after a
        # rejection, so a long verification pass (it costs more than a one-token pass) is spent where copying pays.
        self.draft_len = max(1, settings.draft_tokens // 2)
        self.drafts: list[int] = []
        self.base = len(self.cache)  # the ids before the pass in flight (and its drafts)
        self.closed = False  # set by the segment's thread once nobody reads the segment (close)

    @property
    def record(self) -> Segment:
        return self.tokens.record

    def begin(self, rows: int) -> RowStep:
        """The segment's start, before its first pass (its own thread): the guide's opening forced, ahead of the
        grammar, which constrains what follows it. `rows`: rows in turns now (they share the step's drafts)."""
        return self._next(self.tokens.force(self.opening) if self.opening else [], rows)

    def update(self, logits: torch.Tensor, fed: int, reused: int, rows: int) -> RowStep:
        """A pass is done (the scheduler's thread): take its tokens (the model's own next one and the drafts it
        agrees with), check the stops, and give their text and the next pass's keep. `fed`, `reused`: the pass's
        fed tokens and those whose keys/values came from the cache."""
        settings, cache, drafts = self.settings, self.cache, self.drafts
        if self.first:
            self.first = False
            # (neither drafts nor the tokens the guide forced before the first pass are prompt)
            self.record.prefill_tokens = fed - len(drafts) - self.tokens.added
            self.record.cached_tokens = reused
        tokens, chosen_by = choose_tokens(logits, drafts, settings.temperature, settings.top_p, self.generator,
                                          self.guide, settings.top_k)
        if drafts:
            full = len(tokens) > len(drafts)
            self.draft_len = min(settings.draft_tokens, self.draft_len + 2) if full else max(1, self.draft_len - 1)
        cache.truncate(self.base + len(tokens) - 1)  # rejected drafts leave the ids and the cache
        cache.extend(tokens[-1:])
        logprobs = None if self.record.logprobs is None else token_logprobs(logits, tokens, settings.temperature)
        deltas = self.tokens.take(tokens, chosen_by, self.base, logprobs)
        if self.lookup:
            self.lookup.sync()
        return self._next(deltas, rows)

    def close(self) -> None:
        """Nobody reads the segment any more (its own thread): it ends after its pass in flight, which it drops."""
        self.closed = True

    def drop(self) -> None:
        """Nobody reads the segment any more: the pass just run is dropped, the ids end at the last token taken, its
        keys/values not computed, as after any step (Stop instead keeps the pass's tokens, which are streamed, and
        ends the segment before its next pass)."""
        last = self.cache.ids[self.base - 1]
        self.cache.truncate(self.base - 1)
        self.cache.extend([last])
        self.record.stop = Stop(StopReason.CANCELLED)

    def cancelled(self, fed: int, reused: int) -> None:
        """Stop before its pass was done (during a long prefill, between two chunks): the pass's tokens (its drafts)
        undone; `fed`, `reused` as update's, for a first pass."""
        self.cache.truncate(self.base)
        if self.first:
            self.record.prefill_tokens, self.record.cached_tokens = fed, reused
        self.record.stop = Stop(StopReason.CANCELLED)

    def failed(self) -> None:
        """Its pass or its update failed: the pass's tokens undone, the segment's stop an error."""
        self.cache.truncate(self.base)
        self.record.stop = Stop(StopReason.ERROR)

    def _next(self, deltas: list[str], rows: int) -> RowStep:
        """The next pass after the text `deltas`: the guide's forced tokens, then the drafts, added to the ids."""
        cache = self.cache
        if self.record.stop is not None:
            return RowStep(deltas, None)
        if self.closed or (self.cancel is not None and self.cancel.is_set()):
            self.record.stop = Stop(StopReason.CANCELLED)
            return RowStep(deltas, None)
        if self.guide is not None and (forced := self.guide.forced()):  # the text the grammar fixes: no choice
            forced = forced[:self.tokens.room()]
            self.guide.consume(forced)
            deltas = deltas + self.tokens.force(forced)
            if self.record.stop is not None:
                return RowStep(deltas, None)
        self.base = len(cache)
        room = self.tokens.room() - 1
        share = max(1, DRAFTS_PER_STEP // max(1, rows))
        # (the first pass too: after a question or a tool's result the model mostly starts as the prompt's examples
        # do, "<request><", "Result = ...", so its first text comes a pass earlier)
        self.drafts = self.lookup.propose(min(self.draft_len, room, share)) if self.lookup else []
        cache.extend(self.drafts)
        return RowStep(deltas, len(self.drafts) + 1)
