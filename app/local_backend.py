"""The model in this process: one model segment is a loop of forward passes over the session's TokenCache
(only uncached tokens are fed), sampling or verified prompt-lookup drafts, and a per-token stop check."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from app.answer_line import AnswerLine
from app.backend import SegmentRun
from app.decoding import Detokenizer, PromptLookup, Stop, StopChecker, StopReason, greedy, next_token
from app.kvcache import TokenCache
from app.model import LoadedModel
from app.protocol import STOP_STRINGS
from app.scheduler import Cancelled

if TYPE_CHECKING:
    from app.engine import Settings

# Draft tokens one step verifies across its rows: each row drafts at most DRAFTS_PER_STEP // rows. A verified token
# costs ~1.8 ms of an int8 step whatever the batch, while a step's share per row shrinks as rows join (one row: a
# 32 ms step; eight: 61 ms, 7.6 ms each), so a draft pays alone even when rarely accepted and in a full batch only
# when likely. Measured, 8 questions at once (Engine.run / 8 chats, two runs each): 16 gave 1.84-1.91 s / 120-128
# tokens/s, no cap 2.00-2.17 s / 105-126, 8 gave 1.87-1.99 s / 119.
DRAFTS_PER_STEP = 16


class LocalBackend:
    """Runs segments on a LoadedModel. Thread-safe: forward passes go through the model's scheduler (batched
    with every other session's), tokenizer use through the model's lock."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.lock = loaded.lock
        self.name = f"in-process ({loaded.name}, {loaded.weights})"
        self.special_token_texts = loaded.special_token_texts
        self.stops = StopChecker(STOP_STRINGS, loaded.eos_ids)  # built once, shared by every segment
        cfg = loaded.model.config.get_text_config()
        # a batch's rows at once where the scheduler batches them into one pass; else one after another
        self.parallel = loaded.scheduler.max_rows if loaded.scheduler.ragged else 1
        self.shares_prefix = loaded.scheduler.ragged  # cascade attention reads a shared prefix (app.ragged)
        self.context_limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)

    def turn_scope(self) -> AbstractContextManager[None]:
        return self.loaded.scheduler.turn()  # between a turn's passes, the next step waits for it a moment

    def prefill(self, cache: TokenCache) -> None:
        if cache.cached == 0 and len(cache) > 1:
            self.loaded.scheduler.forward(cache)

    def run_segment(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                    run: SegmentRun, generator: torch.Generator) -> Iterator[str]:
        if not settings.use_cache:
            cache.drop_kv()
        grammar = self.loaded.answer_grammar
        stops, detok = self.stops.start(), Detokenizer(self.tokenizer)
        line = AnswerLine(after_tool=grammar.follows_a_tool(cache.ids))
        lookup = PromptLookup(cache.ids) if settings.draft_tokens and settings.temperature <= 0 else None
        # Draft length adapts like transformers' assisted generation: +2 after a fully accepted draft, -1 after a
        # rejection, so a long verification pass (it costs more than a one-token pass) is spent where copying pays.
        draft_len = max(1, settings.draft_tokens // 2)
        fail = None
        try:
            while run.stop is None:
                if cancel is not None and cancel.is_set():
                    run.stop = Stop(StopReason.CANCELLED)
                    break
                base = len(cache)
                fail = Stop(StopReason.ERROR)  # if anything below raises, the tokens go back to `base`
                generated = run.generated_tokens
                room = min(settings.max_new_tokens - generated, settings.max_length - base) - 1
                share = max(1, DRAFTS_PER_STEP // max(1, self.loaded.scheduler.rows_in_turns()))
                drafts = lookup.propose(min(draft_len, room, share)) if lookup and generated else []
                cache.extend(drafts)
                # one step of the scheduler's batched pass, beside every other session's rows
                try:
                    logits, fed, hit = self.loaded.scheduler.forward(cache, keep=len(drafts) + 1, cancel=cancel)
                except Cancelled as stopped:  # Stop during a long prefill: it ends between two chunks
                    cache.truncate(base)
                    if generated == 0:
                        run.prefill_tokens, run.cached_tokens = stopped.fed, stopped.reused
                    run.stop, fail = Stop(StopReason.CANCELLED), None
                    break
                if generated == 0:
                    run.prefill_tokens, run.cached_tokens = fed, hit
                tokens = self._choose(logits, drafts, settings, generator, line)
                if drafts:
                    full = len(tokens) > len(drafts)
                    draft_len = min(settings.draft_tokens, draft_len + 2) if full else max(1, draft_len - 1)
                cache.truncate(base + len(tokens) - 1)  # rejected drafts leave the ids and the cache
                cache.extend(tokens[-1:])
                deltas = []
                with self.lock:  # the tokenizer
                    for i, token in enumerate(tokens):  # each new token is checked in order
                        run.generated_tokens += 1
                        deltas.append(detok.push(token))
                        line.push(deltas[-1])
                        run.stop = stops.check(token, deltas[-1], run.generated_tokens, settings.max_new_tokens,
                                               base + i + 1, settings.max_length)
                        if run.stop is not None:
                            cache.truncate(base + i + 1)  # nothing after the stop is kept
                            break
                fail = None
                if lookup:
                    lookup.sync()
                for delta in deltas:
                    if delta:
                        yield delta
        except Exception:
            if fail is not None:  # the model (or sampling) failed mid-step: undo that step, say so, re-raise
                cache.truncate(base)
                run.stop = fail
            raise
        finally:
            if not settings.use_cache:
                cache.drop_kv()

    def _choose(self, logits: torch.Tensor, drafts: list[int], settings: Settings, generator,
                line: AnswerLine) -> list[int]:
        """The new tokens: the drafts the model agrees with, then the model's own next token, each chosen from the
        logits as the answer line's grammar masks them (app.answer_line), so drafts never change what is chosen."""
        grammar = self.loaded.answer_grammar
        if not drafts:
            return [next_token(grammar.mask(logits[-1], line), settings.temperature, settings.top_p, generator)]
        ahead, tokens = line.copy(), []
        for i in range(len(drafts) + 1):
            tokens.append(greedy(grammar.mask(logits[i], ahead)))
            if i == len(drafts) or tokens[-1] != drafts[i]:
                break
            ahead.push(grammar.text(tokens[-1]))
        return tokens
