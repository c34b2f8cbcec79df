"""The model in this process: one model segment is a series of forward passes over the session's TokenCache
(only uncached tokens are fed), sampling or verified prompt-lookup drafts, and a per-token stop check. The
per-token work runs in the model scheduler's thread right after each pass (LocalSegment), as a serving engine's
loop does; the segment's own thread streams the text."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Generator, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from app.backends.base import BackendStats, SegmentRequest, SegmentStream
from app.backends.tokens import SegmentTokens
from app.decoding.choose import choose_tokens
from app.decoding.guide_matcher import GuideMatcher, GuideVocab
from app.decoding.sampling import PromptLookup, token_logprobs
from app.decoding.stops import StopChecker
from app.episode import Stop, StopReason
from app.model.family import describe, fast_path_reason
from app.model.kvcache import TokenCache
from app.model.loading import LoadedModel
from app.model.scheduler import Cancelled, PassResult, Scheduler

if TYPE_CHECKING:
    from app.settings import Settings

log = logging.getLogger(__name__)

# Draft tokens one step verifies across its rows: each row drafts at most DRAFTS_PER_STEP // rows. A verified token
# costs about the same in any batch while a row's share of a step shrinks as rows join, so a draft pays alone even
# when rarely accepted and in a full batch only when likely (the values tried: docs/concurrency.md).
DRAFTS_PER_STEP = 16


class LocalBackend:
    """Runs segments on a LoadedModel, and owns what runs it: the scheduler (the one owner of its forward passes,
    batched with every other session's), the guide's view of its tokenizer, and the lock that serializes tokenizer
    use. Thread-safe."""

    kv_in_process = True

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.lock = threading.RLock()  # fast tokenizers are not thread-safe
        self.scheduler = Scheduler(loaded.model)
        trained = f" + adapter {loaded.adapter.digest}" if loaded.adapter else ""
        self.name = f"in-process ({loaded.name}{trained}, {loaded.weights})"
        self.tuned_for = loaded.adapter.protocol if loaded.adapter else None  # (`auto` chooses it)
        self.special_token_texts = loaded.special_token_texts
        self.kv_bytes_per_token = loaded.kv_bytes_per_token
        self._stops: dict[tuple[str, ...], StopChecker] = {}  # by stop strings (a protocol's), built once each
        cfg = loaded.model.config.get_text_config()
        # a batch's rows at once where the scheduler batches them into one pass; else one after another
        self.parallel = self.scheduler.max_rows if self.scheduler.ragged else 1
        self.shares_prefix = self.scheduler.ragged  # cascade attention reads a shared prefix (app.model.ragged)
        self.context_limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.loaded.eos_ids

    @property
    def weights(self) -> str:
        return self.loaded.weights

    def stops(self, strings: tuple[str, ...]) -> StopChecker:
        """The stop check for a protocol's stop strings and this model's EOS, shared by every segment."""
        with self.lock:
            checker = self._stops.get(strings)
            if checker is None:
                checker = self._stops[strings] = StopChecker(strings, self.loaded.eos_ids)
            return checker

    @functools.cached_property
    def guide_vocab(self) -> GuideVocab:
        """The guide's view of the tokenizer (app.decoding.guide_matcher), built once when first needed."""
        with self.lock:  # the tokenizer
            return GuideVocab(self.tokenizer, self.loaded.eos_ids, self.lock)

    def stats(self) -> BackendStats:
        counts = self.scheduler.stats
        path = describe(self.model.config) if self.scheduler.ragged else \
            f"the model's own forward, one row a step: {fast_path_reason(self.model.config) or 'not a ragged model'}"
        if self.loaded.matmuls:
            path += f"; float32 matmuls on {self.loaded.matmuls}"
        adapter = self.loaded.adapter
        weights = f"{adapter.folder.name} {adapter.digest}, trained by {adapter.made_by or 'an unrecorded run'}" \
            if adapter else None
        return BackendStats(self.name, kv_in_process=True, runs=path, steps=counts.steps, rows=counts.rows,
                            peak_rows=counts.peak_rows, adapter=weights)

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """New weights for the running model (a trainer's, after its step), copied in between two scheduler steps.
        Float32 weights only: an int8 model's layers are quantized copies of weights it no longer holds."""
        if self.loaded.weights != "float32":
            raise ValueError(f"load_weights needs a float32 model; this one computes in {self.loaded.weights} "
                             "(WEIGHTS=float32)")
        self.scheduler.load_weights(state)

    def turn_scope(self) -> AbstractContextManager[None]:
        return self.scheduler.turn()  # between a turn's passes, the next step waits for it a moment

    def prefill(self, cache: TokenCache) -> None:
        if cache.cached == 0 and len(cache) > 1:
            self.scheduler.forward(cache)

    def prefill_rest(self, cache: TokenCache) -> None:
        """Compute the keys/values of `cache`'s uncached ids (a group's question after the shared system prompt,
        app.engine.groups), so that its forks need not."""
        if cache.cached < len(cache) - 1:
            self.scheduler.forward(cache)

    def run_segment(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                    request: SegmentRequest, generator: torch.Generator) -> SegmentStream:
        """The segment's passes go through the scheduler with their per-token work (LocalSegment) done in its
        thread right after each pass; the deltas stream the text they queue, in the caller's thread."""
        guide = None if request.grammar is None else self.guide_vocab.matcher(request.grammar)
        row = LocalSegment(self.tokenizer, self.lock, self.stops(request.stop_strings), self.scheduler, cache,
                           settings, cancel, request, generator, guide)
        return SegmentStream(self._deltas(row, cache, settings), row.record)

    @staticmethod
    def _deltas(row: LocalSegment, cache: TokenCache, settings: Settings) -> Generator[str, None, None]:
        if not settings.use_cache:
            cache.drop_kv()
        try:
            row.start()
            try:
                yield from row.stream()
            except GeneratorExit:  # closed before its end (Stop in the page): the row ends, the ids this thread's
                row.close()
                raise
        finally:
            if not settings.use_cache:
                cache.drop_kv()


class LocalSegment:
    """One model segment's per-row state between its passes: the tokens the model agrees with (drafts) and its own
    next one, the guide's forced tokens, their text, the stop check, the next drafts. The scheduler's RowOwner: it
    runs in the scheduler's thread right after each pass (`passed`), as a serving engine's loop does, so the row is
    in the next step without waking its thread, and once when the request is over (`ended`); the segment's thread
    reads the text from `stream()`. Its `record` (the model Segment it fills) takes each stop from the code that
    stopped the segment (`_finish`)."""

    def __init__(self, tokenizer, lock: threading.RLock, stops: StopChecker, scheduler: Scheduler,
                 cache: TokenCache, settings: Settings, cancel: threading.Event | None, request: SegmentRequest,
                 generator: torch.Generator, guide: GuideMatcher | None):
        self.cache, self.settings, self.cancel, self.opening = cache, settings, cancel, list(request.forced)
        self.tokens = SegmentTokens(tokenizer, lock, stops, cache, settings, request)
        self.record = self.tokens.record
        self.generator, self.scheduler, self.guide = generator, scheduler, guide
        self.first = True  # before the segment's first pass (its prefill)
        greedy_drafts = settings.draft_tokens and settings.temperature <= 0
        self.lookup = PromptLookup(cache.ids) if greedy_drafts else None
        # Draft length adapts like transformers' assisted generation: +2 after a fully accepted draft, -1 after a
        # rejection, so a long verification pass (it costs more than a one-token pass) is spent where copying pays.
        self.draft_len = max(1, settings.draft_tokens // 2)
        self.drafts: list[int] = []
        self.base = len(cache)  # the ids before the pass in flight (and its drafts)
        self._texts: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()  # a pass's deltas; None: the end
        self._closed = False  # set by the segment's thread when its stream is closed
        self._over = threading.Event()  # set once the request is over and recorded (`ended`)
        self._failure: BaseException | None = None  # a failed step's error, for the segment's thread

    def start(self) -> None:
        """Force the guide's opening, then submit the segment's first pass (the segment's thread), or end it where
        forced tokens already did."""
        if self.opening:  # (ahead of the grammar, which constrains what follows it)
            self._texts.put(self.tokens.force(self.opening))
        keep = self.next_pass()
        if keep is None:
            self.ended(None)
        else:
            self.scheduler.submit(self.cache, keep, self.cancel, owner=self)

    def stream(self) -> Iterator[str]:
        """The segment's text, as its passes add it, until the request ends (the segment's thread); then a failed
        step's error."""
        while (deltas := self._texts.get()) is not None:
            yield from filter(None, deltas)
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Nobody reads the stream any more (the segment's thread): the row ends after its pass in flight, which it
        drops; wait for that end (the session's ids are this thread's again), and log a failure nobody is told of."""
        self._closed = True
        self._over.wait()
        if self._failure is not None:
            log.error("a segment failed after its stream was closed", exc_info=self._failure)

    def next_pass(self) -> int | None:
        """The next pass's drafts, added to the ids: its keep; None when the segment is over."""
        cache = self.cache
        if self.record.stop is not None:
            return None
        if self._closed or (self.cancel is not None and self.cancel.is_set()):
            self._finish(Stop(StopReason.CANCELLED))
            return None
        if self.guide is not None and (forced := self.guide.forced()):  # the text the grammar fixes: no choice
            forced = forced[:self.tokens.room()]
            self.guide.consume(forced)
            self._texts.put(self.tokens.force(forced))
            if self.record.stop is not None:
                return None
        self.base = len(cache)
        room = self.tokens.room() - 1
        share = max(1, DRAFTS_PER_STEP // max(1, self.scheduler.rows_in_turns()))
        # (the first pass too: after a question or a tool's result the model mostly starts as the prompt's examples
        # do, "<request><", "Result = ...", so its first text comes a pass earlier)
        self.drafts = self.lookup.propose(min(self.draft_len, room, share)) if self.lookup else []
        cache.extend(self.drafts)
        return len(self.drafts) + 1

    def passed(self, result: PassResult) -> int | None:
        """A pass is done (the scheduler's thread): take its tokens, check the stops, queue their text; the next
        pass's keep, or None. An error here ends the request, and `ended` records it."""
        settings, cache, drafts = self.settings, self.cache, self.drafts
        if self._closed:  # nobody reads this segment any more: the pass it ran is dropped, the ids end at the last
            # token taken, its keys/values not computed, as after any step (a Stop instead keeps the pass's tokens,
            # which are streamed, and ends the segment before its next pass)
            last = cache.ids[self.base - 1]
            cache.truncate(self.base - 1)
            cache.extend([last])
            self._finish(Stop(StopReason.CANCELLED))
            return None
        if self.first:
            self.first = False
            # (neither drafts nor the tokens the guide forced before the first pass are prompt)
            self.record.prefill_tokens = result.fed - len(drafts) - self.tokens.added
            self.record.cached_tokens = result.reused
        tokens, chosen_by = choose_tokens(result.logits, drafts, settings.temperature, settings.top_p,
                                          self.generator, self.guide, settings.top_k)
        if drafts:
            full = len(tokens) > len(drafts)
            self.draft_len = min(settings.draft_tokens, self.draft_len + 2) if full else max(1, self.draft_len - 1)
        cache.truncate(self.base + len(tokens) - 1)  # rejected drafts leave the ids and the cache
        cache.extend(tokens[-1:])
        logprobs = None if self.record.logprobs is None else \
            token_logprobs(result.logits, tokens, settings.temperature)
        deltas = self.tokens.take(tokens, chosen_by, self.base, logprobs)
        if self.lookup:
            self.lookup.sync()
        self._texts.put(deltas)
        return self.next_pass()

    def ended(self, error: BaseException | None) -> None:
        """The request is over (the scheduler's thread, once; the segment's where no pass ran): a failure is recorded
        here, the tokens of the pass it stopped undone (its drafts, or the failed step's): Stop during a long prefill
        (Cancelled, between two chunks) as cancelled, any other error as the segment's. Then the stream ends."""
        if error is not None:
            self.cache.truncate(self.base)
            if isinstance(error, Cancelled):
                if self.first:
                    self.record.prefill_tokens, self.record.cached_tokens = error.fed, error.reused
                self._finish(Stop(StopReason.CANCELLED))
            else:
                self._failure = error
                self._finish(Stop(StopReason.ERROR))
        self._texts.put(None)
        self._over.set()

    def _finish(self, stop: Stop) -> None:
        """The segment stops, for the reason the code that stopped it gives: its next pass is not asked for."""
        self.record.stop = stop
