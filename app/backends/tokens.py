"""A model segment's tokens as they enter the session's ids, from the model or forced by the guide: each one's text,
the stop check, who chose it and its log-probability, all in the segment's one record. Both backends force the guide's
tokens through `force`; the in-process one takes the model's through `take` too."""

from __future__ import annotations

import threading

from app.backends.base import SegmentRequest
from app.decoding.stops import Detokenizer, StopChecker
from app.episode import Provenance
from app.model.kvcache import TokenCache
from app.settings import Settings


class SegmentTokens:
    """Appends a segment's tokens to `cache` and fills its `record` (SegmentRequest.blank) as they come. The stop is
    the stop check's, the code that ends the segment: nothing after it is kept."""

    def __init__(self, tokenizer, lock: threading.RLock, stops: StopChecker, cache: TokenCache, settings: Settings,
                 request: SegmentRequest):
        self.cache, self.settings, self.lock = cache, settings, lock
        self.record = request.blank()
        self.stops, self.detok = stops.start(), Detokenizer(tokenizer, request.shown)
        self.added = 0  # tokens the segment added: the model's and the guide's (max_new_tokens bounds them all)

    def room(self) -> int:
        """How many more tokens the segment may add (max_new_tokens, max_length)."""
        return min(self.settings.max_new_tokens - self.added, self.settings.max_length - len(self.cache))

    def force(self, forced: list[int]) -> list[str]:
        """Append forced tokens (the guide's opening, or text its grammar fixed), within the budget. Their text deltas."""
        forced = forced[:self.room()]
        at = len(self.cache)
        self.cache.extend(forced)
        return self.take(forced, [Provenance.FORCED] * len(forced), at)

    def take(self, tokens: list[int], chosen_by: list[Provenance], at: int,
             logprobs: list[float] | None = None) -> list[str]:
        """The segment takes `tokens`, already in the ids from position `at`: each one's text, checked in order for a
        stop; nothing after a stop is kept. Their text deltas. `logprobs`: the tokens' own (None: forced, 0.0)."""
        record, settings, deltas = self.record, self.settings, []
        with self.lock:  # the tokenizer
            for i, token in enumerate(tokens):
                self.added += 1
                record.generated_tokens += chosen_by[i] is not Provenance.FORCED
                if record.provenance is not None:
                    record.provenance.append(chosen_by[i])
                if record.logprobs is not None:
                    record.logprobs.append(0.0 if logprobs is None else logprobs[i])
                deltas.append(self.detok.push(token))
                stop = self.stops.check(token, deltas[-1], self.added, settings.max_new_tokens, at + i + 1,
                                        settings.max_length)
                if stop is not None:
                    self.cache.truncate(at + i + 1)
                    record.stop = stop
                    break
        return deltas
