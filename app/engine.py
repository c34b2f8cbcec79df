"""The segment engine: one chat turn is an episode of model segments with tool calls between them.

UI-agnostic: it yields typed events (text deltas, segment and episode records) that a CLI, an API or a page
renders. Each session keeps its token ids and KV cache (app.kvcache.TokenCache); the system prompt is
prefilled once per process and forked into every new session.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generator, Literal

import torch

from app.decoding import (Detokenizer, Holdback, Limit, PromptLookup, Stop, StopChecker, StopReason, next_token,
                           tokens_before)
from app.kvcache import TokenCache
from app.model import LoadedModel
from app.prompt import PromptError, default_prompt_template, render_prompt
from app.protocol import (CALL, CUT_STOPS, RESPONSE, STOP_STRINGS, ToolCallError, encode, neutralize,
                          parse_tool_call)
from app.tools.registry import Tool, default_tools, run_tool

MAX_QUESTION_CHARS = 4000
MIN_TEMPERATURE = 0.01  # below it sampling is greedy in all but name, and tiny values overflow logits / temperature


class InputError(ValueError):
    """A user mistake (empty message, full context, bad setting): shown as a message, never a traceback."""


@dataclass(frozen=True)
class Settings:
    """Generation parameters of one turn. Frozen: a change is a new value, never a mutation of shared config."""

    max_new_tokens: int = 64  # per model segment
    max_length: int = 4096  # token budget of the whole session: prompt + history + this turn
    max_turns: int = 4  # tool calls per answer
    max_tool_response: int = 400  # characters of tool output the model reads
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    use_cache: bool = True
    seed: int = 0
    draft_tokens: int = 0  # greedy only: tokens proposed by prompt lookup and verified in one pass (0 = off)

    def validated(self, context_limit: int) -> "Settings":
        checks = [
            (1 <= self.max_new_tokens <= 4096, "max_new_tokens must be between 1 and 4096"),
            (1 <= self.max_length <= context_limit, f"max_length must be between 1 and {context_limit}"),
            (0 <= self.max_turns <= 32, "max_turns must be between 0 and 32"),
            (1 <= self.max_tool_response <= 20000, "max_tool_response must be between 1 and 20000"),
            (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 5,
             f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and 5"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.draft_tokens <= 32, "draft_tokens must be between 0 and 32"),
            (0 <= self.seed < 2**63, "seed must be between 0 and 2**63 - 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise InputError(message)
        return self


@dataclass
class Segment:
    """One model segment (generated) or tool segment (inserted), with its span in the session's ids."""

    kind: Literal["model", "tool"]
    text: str
    start: int
    end: int
    stop: Stop | None = None  # model segments only
    tool: str | None = None  # tool segments only
    query: str | None = None
    ok: bool = True
    prefill_tokens: int = 0  # tokens fed through the model as new input at the segment's start
    cached_tokens: int = 0  # tokens whose keys/values came from the cache
    generated_tokens: int = 0
    ms: float = 0.0

    def to_json(self) -> dict:
        stop = self.stop
        return {
            "kind": self.kind,
            "text": self.text,
            "stop_reason": stop.reason.value if stop else None,
            "stop_string": stop.string if stop else None,
            "limit": stop.limit.value if stop and stop.limit else None,
            "tool": self.tool,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "generated_tokens": self.generated_tokens,
            "ms": round(self.ms, 3),
        }


@dataclass
class Episode:
    """One question and everything that answered it."""

    question: str
    query_start: int
    query_end: int
    use_cache: bool
    segments: list[Segment] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # this turn's tokens: query + segments
    total_tokens: int = 0  # every token of the session when the episode ended
    ms: float = 0.0
    reward: float | None = None
    finished: bool = False

    @property
    def model_segments(self) -> list[Segment]:
        return [s for s in self.segments if s.kind == "model"]

    @property
    def last_model_segment(self) -> Segment | None:
        return next((s for s in reversed(self.segments) if s.kind == "model"), None)

    @property
    def answer(self) -> str:
        """The last model segment's text, cut at the stop string that ended it."""
        last = self.last_model_segment
        if last is None:
            return ""
        text = last.text
        if last.stop and last.stop.string and last.stop.string in text:
            text = text[: text.rfind(last.stop.string)]
        return text.strip()

    @property
    def stop(self) -> Stop | None:
        last = self.last_model_segment
        return last.stop if last else None

    @property
    def prefill_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.segments)

    @property
    def reused_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.segments)

    @property
    def mask(self) -> list[int]:
        """1 for tokens the model generated, 0 for inserted ones (query, tool output), over token_ids."""
        mask = [0] * len(self.token_ids)
        for s in self.model_segments:
            mask[s.start - self.query_start : s.end - self.query_start] = [1] * (s.end - s.start)
        return mask

    def to_json(self) -> dict:
        return {
            "question": self.question,
            "answer": self.answer,
            "total_tokens": self.total_tokens,
            "cache": {"enabled": self.use_cache, "prefill_tokens": self.prefill_tokens,
                      "reused_tokens": self.reused_tokens},
            "segments": [s.to_json() for s in self.segments],
        }


# Events, in the order a turn yields them.
@dataclass(frozen=True)
class SegmentStarted:
    row: int
    kind: Literal["model", "tool"]


@dataclass(frozen=True)
class TextDelta:
    row: int
    text: str


@dataclass(frozen=True)
class SegmentFinished:
    row: int
    segment: Segment


@dataclass(frozen=True)
class EpisodeFinished:
    row: int
    episode: Episode


Event = SegmentStarted | TextDelta | SegmentFinished | EpisodeFinished


@dataclass(frozen=True)
class Span:
    role: Literal["system", "user", "model", "tool"]
    start: int
    end: int


class Session:
    """One conversation: its tokens and KV cache, its episodes, its sampling generator, its lock."""

    def __init__(self, cache: TokenCache, prompt_tokens: int, seed: int = 0):
        self.cache = cache
        self.prompt_tokens = prompt_tokens
        self.episodes: list[Episode] = []
        self.generator = torch.Generator().manual_seed(seed)
        self.lock = threading.Lock()

    def fork(self, kv: bool = True) -> "Session":
        """An independent copy (tokens, history so far, and the cache unless kv=False), e.g. to run one question
        two ways side by side."""
        with self.lock:
            other = Session(self.cache.fork() if kv else TokenCache(self.cache.ids), self.prompt_tokens)
            other.episodes = list(self.episodes)
            other.generator.set_state(self.generator.get_state())
            return other

    def spans(self) -> list[Span]:
        """Who wrote each part of the session's tokens: system prompt, user, model, tool."""
        spans = [Span("system", 0, self.prompt_tokens)]
        for episode in self.episodes:
            spans.append(Span("user", episode.query_start, episode.query_end))
            spans.extend(Span(s.kind, s.start, s.end) for s in episode.segments)
        return [s for s in spans if s.end > s.start]


def require_utf8(text: str, what: str) -> str:
    """Text the tokenizer can take. Lone surrogates (bytes a terminal could not decode, or a JSON "\\ud800")
    make it raise a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{what} is not valid UTF-8 text") from None
    return text


def clean_question(question: str) -> str:
    """The question as the engine takes it, or a clear InputError."""
    if not isinstance(question, str):
        raise InputError("the message must be text")
    question = require_utf8(question, "the message").strip()
    if not question:
        raise InputError("the message is empty")
    if len(question) > MAX_QUESTION_CHARS:
        raise InputError(f"the message is too long ({len(question)} characters, at most {MAX_QUESTION_CHARS})")
    return question


class Engine:
    """Runs episodes for sessions of one model; thread-safe (one model lock, one lock per session)."""

    PROMPT_CACHE_SIZE = 4

    def __init__(self, loaded: LoadedModel, tools: Mapping[str, Tool] | None = None, prompt: str | None = None):
        self.loaded = loaded
        self.tools = dict(default_tools() if tools is None else tools)
        self.prompt = render_prompt(default_prompt_template() if prompt is None else prompt, self.tools)
        self.stops = StopChecker(STOP_STRINGS, loaded.eos_ids)  # built once, shared by every segment
        self._specials = loaded.special_token_texts
        self._prompt_caches: OrderedDict[str, TokenCache] = OrderedDict()
        self._prompt_lock = threading.Lock()
        cfg = loaded.model.config.get_text_config()
        self.context_limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048)

    @property
    def shared_kv_bytes(self) -> int:
        """KV bytes of the shared prefilled prompts (held once per process, outside every session)."""
        with self._prompt_lock:
            return sum(cache.nbytes for cache in self._prompt_caches.values())

    # ---- sessions -------------------------------------------------------------------------------------------
    def new_session(self, prompt: str | None = None, use_cache: bool = True, seed: int = 0) -> Session:
        """A session starting from the (rendered) prompt, forked from its shared prefilled cache."""
        try:
            prompt = self.prompt if prompt is None else render_prompt(prompt, self.tools)
        except PromptError as error:  # a visitor's prompt whose example the tool rejects
            raise InputError(str(error)) from None
        base = self._prompt_cache(prompt, prefill=use_cache)
        cache = base.fork() if use_cache else TokenCache(base.ids)
        return Session(cache, prompt_tokens=len(base), seed=seed)

    def _prompt_cache(self, prompt: str, prefill: bool) -> TokenCache:
        """The prompt's ids and (when asked) keys/values, computed once per process and never mutated after."""
        with self._prompt_lock:
            base = self._prompt_caches.get(prompt)
            if base is None:
                require_utf8(prompt, "the system prompt")
                with self.loaded.lock:
                    base = TokenCache(encode(self.loaded.tokenizer, prompt))
                if not base.ids:
                    raise InputError("the system prompt is empty")
                if len(base) >= self.context_limit:
                    raise InputError(f"the system prompt has {len(base)} tokens; the model reads at most "
                                     f"{self.context_limit}")
                self._prompt_caches[prompt] = base
                while len(self._prompt_caches) > self.PROMPT_CACHE_SIZE:
                    self._prompt_caches.popitem(last=False)
            self._prompt_caches.move_to_end(prompt)
            if prefill and base.cached == 0 and len(base) > 1:
                with self.loaded.lock:
                    base.forward(self.loaded.model)
            return base

    # ---- one turn -------------------------------------------------------------------------------------------
    def turn(self, session: Session, question: str, settings: Settings | None = None,
             cancel: threading.Event | None = None, row: int = 0) -> Iterator[Event]:
        """Answer one question in a session, yielding events; the last one is EpisodeFinished."""
        settings = (settings or Settings()).validated(self.context_limit)
        question = clean_question(question)
        with session.lock:
            yield from self._turn(session, question, settings, cancel, row)

    def _turn(self, session, question, settings, cancel, row) -> Iterator[Event]:
        cache = session.cache
        separator = "\n\n" if session.episodes else ""
        with self.loaded.lock:
            query_ids = encode(self.loaded.tokenizer, f"{separator}Q: {neutralize(question, self._specials)}\n")
        if len(cache) + len(query_ids) >= settings.max_length:
            raise InputError(
                f"the context is full: {len(cache)} tokens so far + {len(query_ids)} for this message leave no "
                f"room under max_length={settings.max_length}; start a new chat or raise max_length"
            )
        episode = Episode(question, len(cache), len(cache) + len(query_ids), settings.use_cache)
        cache.extend(query_ids)
        session.episodes.append(episode)
        started = time.perf_counter()
        try:
            for calls in itertools.count():
                segment = yield from self._model_segment(session, episode, settings, cancel, row)
                if segment.stop.string != CALL or calls >= settings.max_turns:
                    break
                if cancel is None or not cancel.is_set():  # Stop during the step that wrote <call>: no tool
                    yield from self._tool_segment(session, episode, segment, settings, row)
                # (when cancelled, the next model segment records the stop with zero tokens and the turn ends)
        finally:
            episode.ms = (time.perf_counter() - started) * 1000
            episode.total_tokens = len(cache)
            episode.token_ids = cache.ids[episode.query_start:]
            episode.finished = True
        yield EpisodeFinished(row, episode)

    def _model_segment(self, session: Session, episode: Episode, settings: Settings,
                       cancel: threading.Event | None, row: int) -> Generator[Event, None, Segment]:
        cache, model, tokenizer = session.cache, self.loaded.model, self.loaded.tokenizer
        if not settings.use_cache:
            cache.drop_kv()
        start, began = len(cache), time.perf_counter()
        stops, detok = self.stops.start(), Detokenizer(tokenizer)
        pieces: list[str] = []  # each generated token's text
        stream = Holdback(CUT_STOPS)
        lookup = PromptLookup(cache.ids) if settings.draft_tokens and settings.temperature <= 0 else None
        fail = None
        # Draft length adapts like transformers' assisted generation: +2 after a fully accepted draft, -1 after a
        # rejection, so a long verification pass (it costs more than a one-token pass) is spent where copying pays.
        draft_len = max(1, settings.draft_tokens // 2)
        stop: Stop | None = None
        prefill = reused = generated = 0
        yield SegmentStarted(row, "model")
        try:
            if len(cache) >= settings.max_length:
                stop = Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_LENGTH)
            while stop is None:
                if cancel is not None and cancel.is_set():
                    stop = Stop(StopReason.CANCELLED)
                    break
                with self.loaded.lock:
                    base = len(cache)
                    fail = Stop(StopReason.ERROR)  # if anything below raises, the tokens go back to `base`
                    room = min(settings.max_new_tokens - generated, settings.max_length - base) - 1
                    drafts = lookup.propose(min(draft_len, room)) if lookup and generated else []
                    cache.extend(drafts)
                    logits, fed, hit = cache.forward(model, keep=len(drafts) + 1)
                    if generated == 0:
                        prefill, reused = fed, hit
                    tokens = self._choose(logits, drafts, settings, session.generator)
                    if drafts:
                        full = len(tokens) > len(drafts)
                        draft_len = min(settings.draft_tokens, draft_len + 2) if full else max(1, draft_len - 1)
                    cache.truncate(base + len(tokens) - 1)  # rejected drafts leave the ids and the cache
                    cache.extend(tokens[-1:])
                    deltas = []
                    for i, token in enumerate(tokens):  # each new token is checked in order
                        generated += 1
                        pieces.append(detok.push(token))
                        stop = stops.check(token, pieces[-1], generated, settings.max_new_tokens, base + i + 1,
                                           settings.max_length)
                        if stop is None:
                            deltas.append(stream.push(pieces[-1]))
                            continue
                        cache.truncate(base + i + 1)  # nothing after the stop is kept
                        end = None
                        if stop.string in CUT_STOPS:  # nor the stop string itself
                            end = self._cut(cache, start, pieces, stops.overshoot)
                        deltas.append(stream.close(pieces[-1], end))
                        break
                    fail = None
                    if lookup:
                        lookup.sync()
                for delta in deltas:
                    if delta:
                        yield TextDelta(row, delta)
        except Exception:
            if fail is not None:  # the model (or sampling) failed mid-step: undo that step, say so, re-raise
                cache.truncate(base)
                stop = fail
            raise
        finally:
            if not settings.use_cache:
                cache.drop_kv()
            with self.loaded.lock:
                text = tokenizer.decode(cache.ids[start:], skip_special_tokens=True)
            segment = Segment("model", text, start, len(cache), stop=stop or Stop(StopReason.CANCELLED),
                              prefill_tokens=prefill, cached_tokens=reused, generated_tokens=generated,
                              ms=(time.perf_counter() - began) * 1000)
            episode.segments.append(segment)
        yield SegmentFinished(row, segment)
        return segment

    @staticmethod
    def _cut(cache: TokenCache, start: int, pieces: list[str], overshoot: int) -> int:
        """Drop a cut stop string and the blank space before it from the segment's tokens (whole tokens: one
        that also holds answer text stays); return how many characters of the segment's text are kept.
        `pieces`: each generated token's text, `overshoot`: characters from the stop string's start to the end."""
        text = "".join(pieces)
        kept = len(text[: len(text) - overshoot].rstrip())
        cache.truncate(start + tokens_before(list(itertools.accumulate(map(len, pieces))), kept))
        return kept

    @staticmethod
    def _choose(logits: torch.Tensor, drafts: list[int], settings: Settings, generator) -> list[int]:
        """The new tokens: the drafts the model agrees with, then the model's own next token."""
        if not drafts:
            return [next_token(logits[-1], settings.temperature, settings.top_p, generator)]
        greedy = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and greedy[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted] + [greedy[accepted]]

    def _tool_segment(self, session: Session, episode: Episode, call_segment: Segment, settings: Settings,
                      row: int) -> Iterator[Event]:
        began = time.perf_counter()
        yield SegmentStarted(row, "tool")
        try:
            call = parse_tool_call(call_segment.text)
            name, query = call.name, call.query
            result = run_tool(self.tools, name, query)
            text, ok = result.text, result.ok
        except ToolCallError as error:
            name, query, text, ok = None, None, f"error: {error}", False
        text = neutralize(text, self._specials)
        if len(text) > settings.max_tool_response:
            text = text[: settings.max_tool_response - 1] + "…"
        cache = session.cache
        with self.loaded.lock:
            ids = encode(self.loaded.tokenizer, text + RESPONSE)
        ids = ids[: max(0, settings.max_length - len(cache))]  # never past the session's budget
        start = len(cache)
        cache.extend(ids)
        with self.loaded.lock:
            inserted = self.loaded.tokenizer.decode(ids)
        segment = Segment("tool", inserted, start, len(cache), tool=name, query=query, ok=ok,
                          ms=(time.perf_counter() - began) * 1000)
        episode.segments.append(segment)
        yield SegmentFinished(row, segment)

    # ---- convenience ----------------------------------------------------------------------------------------
    def ask(self, session: Session, question: str, settings: Settings | None = None,
            cancel: threading.Event | None = None) -> Episode:
        """Run one turn to the end (or to `cancel`) and return its episode."""
        return _last_episode(self.turn(session, question, settings, cancel))

    def stream_batch(self, questions: list[str], settings: Settings | None = None, prompt: str | None = None,
                     cancel: threading.Event | None = None) -> Iterator[Event]:
        """Several questions, each in its own new session from the shared prompt cache; events carry the row."""
        settings = settings or Settings()
        for row, question in enumerate(questions):
            if cancel is not None and cancel.is_set():
                return
            session = self.new_session(prompt, use_cache=settings.use_cache, seed=settings.seed + row)
            yield from self.turn(session, question, settings, cancel, row)

    def run(self, questions: list[str], settings: Settings | None = None, prompt: str | None = None,
            reward_fn: Callable[[int, Episode], float] | None = None) -> list[Episode]:
        """Batch episodes like TRL's TextEnvironment.run(queries); reward_fn(row, episode) scores each."""
        episodes = [e.episode for e in self.stream_batch(questions, settings, prompt) if isinstance(e, EpisodeFinished)]
        if reward_fn is not None:
            for row, episode in enumerate(episodes):
                episode.reward = reward_fn(row, episode)
        return episodes


def _last_episode(events: Iterator[Event]) -> Episode:
    episode = None
    for event in events:
        if isinstance(event, EpisodeFinished):
            episode = event.episode
    assert episode is not None
    return episode
