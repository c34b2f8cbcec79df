"""The model in this process: one model segment is a series of forward passes over the session's TokenCache
(only uncached tokens are fed), sampling or verified prompt-lookup drafts, and a per-token stop check. The
per-token work runs in the model scheduler's thread right after each pass (app.backends.row.Row), as a serving
engine's loop does; the segment's own thread streams the text."""

from __future__ import annotations

import functools
import threading
from collections.abc import Generator, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from app.backends.base import BackendStats, SegmentRequest, SegmentStream
from app.backends.row import Row
from app.backends.scheduler import Scheduler
from app.backends.tokens import SegmentTokens
from app.decoding.guide_matcher import GuideVocab
from app.decoding.stops import StopChecker
from app.model.family import describe, fast_path_reason
from app.model.kvcache import TokenCache
from app.model.loading import LoadedModel

if TYPE_CHECKING:
    from app.settings import Settings


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
        """The segment's row (its per-token state) begins here; its passes go through the scheduler, which updates
        it in its thread right after each pass; the deltas stream the text it queues, in the caller's thread."""
        guide = None if request.grammar is None else self.guide_vocab.matcher(request.grammar)
        tokens = SegmentTokens(self.tokenizer, self.lock, self.stops(request.stop_strings), cache, settings, request)
        row = Row(tokens, settings, cancel, generator, guide, request.forced)
        return SegmentStream(self._deltas(row, cache, settings, cancel), tokens.record)

    def _deltas(self, row: Row, cache: TokenCache, settings: Settings,
                cancel: threading.Event | None) -> Generator[str, None, None]:
        if not settings.use_cache:
            cache.drop_kv()
        try:
            first = row.begin(self.scheduler.rows_in_turns())
            request = None if first.keep is None else self.scheduler.submit(cache, first.keep, cancel, row)
            try:
                yield from filter(None, first.deltas)
                if request is not None:
                    yield from request.stream()
            except GeneratorExit:  # closed before its end (Stop in the page): the row ends, the ids this thread's
                if request is not None:
                    request.close()
                raise
        finally:
            if not settings.use_cache:
                cache.drop_kv()
