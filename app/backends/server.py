"""Model segments on a serving engine: llama.cpp's server (`/completion`) or vLLM (`/v1/completions`), each spoken
to in its own dialect (app.backends.server_dialects).

Each model segment is one streamed completion request whose prompt is the session's token ids (so the server's
prefix cache reuses the system prompt, earlier turns and segments); the generated ids are appended to the
session's ids, which stay the ground truth. The server applies the stop strings, EOS and `max_tokens`, and the stop,
prefill and reuse are recorded from what it reports, never guessed (None, "not reported", where it says nothing).

With the guide on (app.decoding.guide), the segment's GBNF grammar goes with the request, and the tokens that come
back are replayed through it here (app.decoding.guide_matcher.replay): their provenance, or a clear error where
the server did not keep to it. A server cannot say which tokens its grammar steered.

Environment: MODEL_SERVER_URL (base URL), MODEL_SERVER_KIND (`llama.cpp` or `vllm`; detected when unset),
MODEL_SERVER_MODEL (vLLM's served model name; default its first), MODEL_SERVER_API_KEY (sent as a bearer token),
MODEL_SERVER_TIMEOUT_S (default 60: connecting, and the longest wait for the next streamed event).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Generator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from app.backends.base import BackendError, BackendStats, SegmentRequest, SegmentStream
from app.backends.server_client import ModelServer, ServerHTTPError
from app.backends.server_dialects import KINDS, End, LlamaCpp, Piece, Vllm, detect_kind
from app.backends.tokens import SegmentTokens
from app.decoding.guide_matcher import GuideError, GuideVocab, replay
from app.decoding.stops import StopChecker
from app.episode import Limit, Provenance, Segment, Stop, StopReason
from app.model.kvcache import TokenCache
from app.model.loading import load_tokenizer, special_token_texts
from app.protocols.base import encode

if TYPE_CHECKING:
    import torch

    from app.settings import Settings

log = logging.getLogger(__name__)

# Text whose ids the server's tokenizer must give exactly as ours does (else ids would mean other tokens).
TOKENIZER_PROBE = "Q: What is 41 * 23?\n<request><Calculator>41 * 23<call>943<response>\nResult = 943<submit>"


class ServerBackend:
    """Runs segments on a model server; only the tokenizer is loaded here. Thread-safe: the lock guards the
    tokenizer only, so sessions generate on the server at the same time."""

    WARMED_PROMPTS = 16  # prompts remembered as sent (a bound: visitors can write their own)
    kv_in_process = False  # the server holds the keys/values
    kv_bytes_per_token = 0  # (none of them in this process's memory)

    def __init__(self, server: ModelServer, dialect: LlamaCpp | Vllm, tokenizer, context_limit: int,
                 adapter: str | None = None):
        self.server, self.dialect, self.tokenizer = server, dialect, tokenizer
        self.lock = threading.RLock()
        self._warmed: OrderedDict[int, None] = OrderedDict()  # hashes of the prompts prefill() sent
        self._warm_lock = threading.Lock()
        self.context_limit = context_limit
        self.parallel = server_parallel()
        self.shares_prefix = False  # the server holds the keys/values (and shares the prefix in its own cache)
        self.special_token_texts = special_token_texts(tokenizer)
        self.adapter = adapter  # the LoRA adapters the server said it applies at connect (None: none)
        self.tuned_for = None  # (a server does not say what its adapter was tuned for: PROTOCOL chooses)
        self.name = f"{dialect.kind} server {server.url}" + (f" + adapter {adapter}" if adapter else "")

    @classmethod
    def from_env(cls, url: str) -> "ServerBackend":
        timeout = os.environ.get("MODEL_SERVER_TIMEOUT_S", "60")
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise BackendError(f"MODEL_SERVER_TIMEOUT_S must be a number of seconds, not {timeout!r}") from None
        server = ModelServer(url, timeout_s, os.environ.get("MODEL_SERVER_API_KEY") or None)
        return cls.connect(server, os.environ.get("MODEL_SERVER_KIND") or None,
                           os.environ.get("MODEL_SERVER_MODEL") or None)

    @classmethod
    def connect(cls, server: ModelServer, kind: str | None = None, model: str | None = None,
                tokenizer=None) -> "ServerBackend":
        """Ask the server what it is and how long its context is, and check that it tokenizes as we do."""
        kind = kind or detect_kind(server)
        if kind not in KINDS:
            raise BackendError(f"MODEL_SERVER_KIND must be one of {', '.join(KINDS)}, not {kind!r}")
        dialect = LlamaCpp() if kind == "llama.cpp" else Vllm(model)
        context_limit = dialect.context_limit(server)
        tokenizer = load_tokenizer() if tokenizer is None else tokenizer
        theirs, ours = dialect.tokenize(server, TOKENIZER_PROBE), encode(tokenizer, TOKENIZER_PROBE)
        if theirs != ours:
            raise BackendError(f"model server {server.url} tokenizes differently from this app's tokenizer "
                               f"({theirs[:8]}… vs {ours[:8]}…): set MODEL_ID / GGUF_FILE to the served model")
        return cls(server, dialect, tokenizer, context_limit, dialect.adapters(server))

    def stats(self) -> BackendStats:
        return BackendStats(self.name, kv_in_process=False, runs=f"{self.dialect.kind} server", adapter=self.adapter)

    def turn_scope(self) -> AbstractContextManager[None]:
        return nullcontext()  # the server schedules its own batches

    def prefill(self, cache: TokenCache) -> None:
        """Send a shared system prompt once (nothing generated), so the server's prefix cache holds it before the
        first visitor, as the in-process backend prefills it once. llama.cpp keeps a prefix per slot: sessions
        that land on another slot prefill it there once (see docs/model-server.md)."""
        key = hash(tuple(cache.ids))
        with self._warm_lock:
            if key in self._warmed:
                self._warmed.move_to_end(key)
                return
            self.dialect.warm(self.server, cache.ids)
            self._warmed[key] = None
            while len(self._warmed) > self.WARMED_PROMPTS:
                self._warmed.popitem(last=False)

    def prefill_rest(self, cache: TokenCache) -> None:
        """Nothing: the server's prefix cache keeps a group's question after its first request."""

    def run_segment(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                    request: SegmentRequest, generator: torch.Generator) -> SegmentStream:
        stops = StopChecker(request.stop_strings, frozenset())  # (forced tokens': the server checks its own)
        tokens = SegmentTokens(self.tokenizer, self.lock, stops, cache, settings, request)
        return SegmentStream(self._deltas(cache, settings, cancel, request, tokens), tokens.record)

    def _deltas(self, cache: TokenCache, settings: Settings, cancel: threading.Event | None,
                request: SegmentRequest, tokens: SegmentTokens) -> Generator[str, None, None]:
        """The segment's text: the guide's opening, forced here (a claimed call, a whole reply, never reaches the
        server), then the completion as the server streams it; `tokens.record` (this backend's own) takes the
        tokens, counts and stop as they come."""
        record, start = tokens.record, len(cache)
        if request.forced:
            yield "".join(tokens.force(list(request.forced)))
            if record.stop is not None:
                return
        record.prefill_tokens = record.cached_tokens = None  # (until the server reports them)
        begin, room = len(cache), settings.max_length - len(cache)
        budget = settings.max_new_tokens - tokens.added
        max_tokens = min(budget, room)
        limit = Limit.MAX_LENGTH if room <= budget else Limit.MAX_NEW_TOKENS
        # a seed per position: reproducible, yet each segment samples differently
        body = self.dialect.request(cache.ids, settings, max_tokens, (settings.seed + begin) % 2**32, request.grammar,
                                    request.stop_strings)
        texts: list[str] = []
        exact = True  # every generated id came back (llama.cpp skips those of a character split across tokens)
        ended = False  # the segment ran to its end here (not closed by its reader, not failed)
        try:
            with self._stream(body, request.grammar) as stream:
                for event in stream.events(cancel):
                    piece = self.dialect.parse(event, self.server)
                    self._check_ids(piece, record.generated_tokens, max_tokens)
                    if piece.prefill is not None:
                        record.prefill_tokens, record.cached_tokens = piece.prefill, piece.cached
                    exact &= piece.predicted is None or piece.predicted == record.generated_tokens + len(piece.tokens)
                    cache.extend(piece.tokens)
                    record.generated_tokens += len(piece.tokens)
                    if piece.end is not None:
                        generated = max(record.generated_tokens, piece.predicted or 0)
                        record.stop = self._stop(piece.end, limit, generated, max_tokens, request.stop_strings)
                    texts.append(piece.text)
                    if piece.text:
                        yield piece.text
            if record.stop is None and not (cancel is not None and cancel.is_set()):
                raise BackendError(f"model server {self.server.url} ended the stream before the completion ended")
            ended = True
        except BackendError:
            _failed(cache, start, record)  # the failed segment leaves no tokens: the session is as before it
            raise
        finally:
            if record.stop is None or record.stop.reason is not StopReason.ERROR:
                if not exact:
                    self._retokenize(cache, begin, "".join(texts), max_tokens)
                if request.grammar is not None:  # (closed by its reader too: every token kept has its provenance)
                    self._replay(cache, start, begin, request.grammar, record, raise_error=ended)
                elif record.provenance is not None:  # an opening without a grammar: the rest is the model's
                    record.provenance += [Provenance.MODEL] * (len(cache) - begin)
        if record.stop is None:
            record.stop = Stop(StopReason.CANCELLED)

    def _stream(self, body: dict, grammar: str | None):
        """Open the completion stream; a grammar the server rejects is said to be the guide's."""
        try:
            return self.server.stream(self.dialect.path, body)
        except ServerHTTPError as error:
            said = str(error).split(f"HTTP {error.status}: ", 1)[-1]  # the server's own message
            if grammar is not None and "grammar" in said.lower():  # llama.cpp: "... failed to parse grammar"
                raise BackendError(f"model server {self.server.url} rejected the guide's grammar (HTTP "
                                   f"{error.status}: {said}): switch guided answers off (the page's Guided "
                                   f"answers, `guide: false` in the API, --no-guide in the CLI) to ask it "
                                   f"without one") from None
            raise

    @functools.cached_property
    def guide_vocab(self) -> GuideVocab:
        """The guide's view of the tokenizer (app.decoding.guide_matcher), built once when a guided segment first ends."""
        with self.lock:  # the tokenizer
            # (the tokenizer's own EOS ends a grammar's text, as a completion)
            return GuideVocab(self.tokenizer, lock=self.lock)

    def _replay(self, cache: TokenCache, start: int, begin: int, grammar: str, record: Segment,
                raise_error: bool) -> None:
        """Who chose each token the server added from `begin` on (record.provenance, after the opening's), by the
        segment's grammar: forced where it fixed the next text, else the model's; whether the grammar steered a
        token the server does not say. Tokens that break the grammar mean the server did not apply it: the segment
        (from `start`) fails, rolled back, with a BackendError where `raise_error` (not while its reader closes it)."""
        try:
            chosen_by = replay(self.guide_vocab, grammar, cache.ids[begin:])
        except GuideError as error:
            _failed(cache, start, record)
            message = (f"the model server {self.server.url} did not apply the guide's grammar ({error}): a server "
                       f"that ignores grammars cannot give guided answers; switch guided answers off to use it")
            if raise_error:
                raise BackendError(message) from None
            log.warning("%s", message)
            return
        record.provenance = record.provenance[:begin - start] + chosen_by
        record.steered_known = False
        record.generated_tokens = sum(p is not Provenance.FORCED for p in chosen_by)

    def _check_ids(self, piece: Piece, generated: int, max_tokens: int) -> None:
        vocab = len(self.tokenizer)
        if not all(isinstance(t, int) and 0 <= t < vocab for t in piece.tokens):
            raise BackendError(f"model server {self.server.url} returned token ids outside the vocabulary "
                               f"({piece.tokens[:8]})")
        if generated + len(piece.tokens) > max_tokens:
            raise BackendError(f"model server {self.server.url} generated more than the {max_tokens} tokens asked")

    def _stop(self, end: End, limit: Limit, generated: int, max_tokens: int, stops: tuple[str, ...]) -> Stop:
        """The server's end as a Stop. `limit`: which budget set max_tokens (the session's max_length when it
        left no more room than max_new_tokens, as the in-process path reports it)."""
        if end.kind == "string":
            if end.string not in stops:
                raise BackendError(f"model server {self.server.url} stopped at {end.string!r}, not a stop string")
            return Stop(StopReason.STRING_MATCH, string=end.string)
        if end.kind == "eos":
            return Stop(StopReason.EOS)
        if generated < max_tokens:
            raise BackendError(f"model server {self.server.url} stopped at its own length limit after {generated} "
                               f"of {max_tokens} tokens (its context size or --n-predict)")
        return Stop(StopReason.MAX_LENGTH, limit=limit)

    def _retokenize(self, cache: TokenCache, start: int, text: str, max_tokens: int) -> None:
        """llama.cpp streams no ids for tokens that end inside a UTF-8 character; then the segment's ids are its
        text tokenized (what the server's prefix cache will also see next time), within the budget."""
        with self.lock:
            ids = encode(self.tokenizer, text)[:max_tokens]
        log.warning("model server %s left out ids of a split character: the segment's text was re-tokenized",
                    self.server.url)
        cache.truncate(start)
        cache.extend(ids)


def _failed(cache: TokenCache, start: int, record: Segment) -> None:
    """A failed segment leaves no tokens (the session is as before it), and its record says so."""
    cache.truncate(start)
    record.stop, record.generated_tokens = Stop(StopReason.ERROR), 0
    for kept in (record.provenance, record.logprobs):
        if kept is not None:
            kept.clear()


def server_parallel() -> int:
    """MODEL_SERVER_PARALLEL (default 4, as many as `llama-server -np 4` has slots): segments sent at once."""
    value = os.environ.get("MODEL_SERVER_PARALLEL", "4")
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(f"MODEL_SERVER_PARALLEL must be a whole number from 1 to 64, not {value!r}")
    return int(value)
