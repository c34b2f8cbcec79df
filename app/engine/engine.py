"""The segment engine: one chat turn is an episode of model segments with tool calls between them.

UI-agnostic: it yields typed events (text deltas, segment and episode records, app.episode) that a CLI, an API
or a page renders. Each session keeps its token ids and KV cache (app.model.kvcache.TokenCache); the system prompt is
prefilled once per process and forked into every new session. A backend (app.backends.base) runs each model segment:
the model in this process, or a model server; the engine keeps the turn loop, the tools and the events.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, closing
from dataclasses import replace
from itertools import count

from transformers import DynamicCache

from app.backends.base import Backend, SegmentRequest
from app.decoding.guide import Guide
from app.decoding.stops import Holdback, segment_text, tokens_before
from app.engine.rows import Row, stream_rows
from app.engine.session import Session
from app.episode import (Episode, EpisodeFinished, Event, Limit, Segment, SegmentFinished, SegmentStarted, Stop,
                         StopReason, TextDelta)
from app.model.kvcache import TokenCache, kv_nbytes
from app.protocols import PromptError, Protocol, ToolCall, ToolCallError, make_protocol
from app.protocols.base import encode
from app.settings import InputError, Settings, clean_question, require_utf8
from app.tools.base import Tool
from app.tools.registry import default_tools, run_tool


class Engine:
    """Runs episodes for sessions of one model backend; thread-safe (the backend's lock, one lock per session)."""

    PROMPT_CACHE_SIZE = 4

    def __init__(self, backend: Backend, tools: Mapping[str, Tool] | None = None,
                 prompt: str | None = None, protocol: str | Protocol = "textenv"):
        self.backend = backend
        self.tools = dict(default_tools() if tools is None else tools)
        with backend.lock:  # (the tokenizer)
            self.protocol = protocol if isinstance(protocol, Protocol) else make_protocol(
                protocol, backend.tokenizer, backend.special_token_texts, backend.tuned_for)
            self.prompt = self.protocol.render_prompt(
                self.protocol.default_template() if prompt is None else prompt, self.tools)
        self._prompt_caches: OrderedDict[str, TokenCache] = OrderedDict()
        self._released: weakref.WeakSet[DynamicCache] = weakref.WeakSet()  # let go of, while anything reads them
        self._prompt_lock = threading.Lock()
        self.context_limit = self.backend.context_limit

    @property
    def key(self) -> tuple[str, ...]:
        """What a session started by this engine depends on: its protocol and tool set."""
        return (self.protocol.name, *self.tools)

    def _prompt_ids(self, prompt: str) -> list[int]:
        with self.backend.lock:
            return self.protocol.prompt_ids(prompt)

    def _decode(self, ids: list[int]) -> str:
        with self.backend.lock:
            return self.backend.tokenizer.decode(ids)

    def _segment_text(self, ids: list[int]) -> str:
        """A model segment's text (app.decoding.stops.segment_text): the protocol's markers shown, other special
        tokens left out."""
        with self.backend.lock:
            return segment_text(self.backend.tokenizer, ids, self.protocol.marker_ids)

    def prompt_cache(self, prompt: str | None = None) -> TokenCache | None:
        """The shared cache of a rendered prompt (the engine's own by default), where the engine holds it."""
        with self._prompt_lock:
            return self._prompt_caches.get(self.prompt if prompt is None else prompt)

    @property
    def held_prompts(self) -> list[str]:
        """The rendered prompts whose caches the engine holds, least recently used first (PROMPT_CACHE_SIZE)."""
        with self._prompt_lock:
            return list(self._prompt_caches)

    @property
    def shared_kv_bytes(self) -> int:
        """KV bytes of the shared prefilled prompts (held once per process, outside every session)."""
        return sum(kv_nbytes(kv) for kv in self.shared_kv())

    def shared_kv(self) -> list[DynamicCache]:
        """The prefilled prompts' caches, which sessions read as their prefix (app.model.kvcache): those held, and those
        let go of (release_prompts) that something still reads (a batch's rows, a session)."""
        with self._prompt_lock:
            held = [cache.own_kv for cache in self._prompt_caches.values() if cache.own_kv is not None]
            return held + [kv for kv in self._released if all(kv is not h for h in held)]

    def release_prompts(self, read: set[int]) -> None:
        """Let go of the prefilled prompts other than the engine's own that no cache in `read` (ids of the
        prefixes sessions read) is: they are a cache, prefilled again when needed, and held they would keep the
        shared KV over KV_BUDGET_MB for good (docs/architecture.md)."""
        with self._prompt_lock:
            for prompt, base in list(self._prompt_caches.items()):
                if prompt != self.prompt and base.own_kv is not None and id(base.own_kv) not in read:
                    del self._prompt_caches[prompt]
                    self._released.add(base.own_kv)  # (counted for as long as a batch row may still read it)

    # ---- sessions -------------------------------------------------------------------------------------------
    def new_session(self, prompt: str | None = None, use_cache: bool = True, seed: int = 0) -> Session:
        """A session starting from the (rendered) prompt, forked from its shared prefilled cache."""
        try:
            with self.backend.lock:
                prompt = self.prompt if prompt is None else self.protocol.render_prompt(prompt, self.tools)
        except PromptError as error:  # a visitor's prompt whose example the tool rejects
            raise InputError(str(error)) from None
        base = self._prompt_cache(prompt, prefill=use_cache)
        cache = base.fork(share=self.backend.shares_prefix) if use_cache else TokenCache(base.ids)
        return Session(cache, prompt_tokens=len(base), seed=seed)

    def _prompt_cache(self, prompt: str, prefill: bool) -> TokenCache:
        """The prompt's ids and (when asked) keys/values, computed once per process and never mutated after."""
        with self._prompt_lock:
            base = self._prompt_caches.get(prompt)
            if base is None:
                require_utf8(prompt, "the system prompt")
                base = TokenCache(self._prompt_ids(prompt))
                if not base.ids:
                    raise InputError("the system prompt is empty")
                if len(base) >= self.context_limit:
                    raise InputError(f"the system prompt has {len(base)} tokens; the model reads at most "
                                     f"{self.context_limit}")
                self._prompt_caches[prompt] = base
                while len(self._prompt_caches) > self.PROMPT_CACHE_SIZE:
                    self._prompt_caches.popitem(last=False)
            self._prompt_caches.move_to_end(prompt)
            if prefill:
                self.backend.prefill(base)
            return base

    # ---- one turn -------------------------------------------------------------------------------------------
    def turn(self, session: Session, question: str, settings: Settings | None = None,
             cancel: threading.Event | None = None, scope: AbstractContextManager[None] | None = None,
             asked: int = 0) -> Iterator[Event]:
        """Answer one question in a session, yielding events; the last one is EpisodeFinished. `scope`: the
        backend's turn scope, when the caller entered it ahead of the turn (many rows: app.engine.rows); `asked`:
        how many of the session's last ids are this question's already (a group's fork: app.engine.groups)."""
        settings = (settings or Settings()).validated(self.context_limit)
        question = clean_question(question)
        # (a turn waiting for its session's lock is not in scope)
        with session.lock, scope if scope is not None else self.backend.turn_scope():
            yield from self._turn(session, question, settings, cancel, asked)

    def query_ids(self, session: Session, question: str, settings: Settings) -> list[int]:
        """The tokens a turn adds for its (clean) question; InputError when they leave no room under max_length
        (checked by a caller too, before it replaces a chat with a new session for this question)."""
        with self.backend.lock:
            query_ids = self.protocol.query_ids(question, session.cache.ids[-8:], first=not session.episodes)
        used = len(session.cache)
        if used + len(query_ids) >= settings.max_length:
            advice = ("start a new chat or raise max_length" if session.episodes else
                      "shorten the system prompt or raise max_length")  # (a new chat would not help)
            raise InputError(f"the context is full: {used} tokens so far + {len(query_ids)} for this message leave "
                             f"no room under max_length={settings.max_length}; {advice}")
        return query_ids

    def _turn(self, session, question, settings, cancel, asked) -> Iterator[Event]:
        cache = session.cache
        query_ids = [] if asked else self.query_ids(session, question, settings)
        episode = Episode(question, len(cache) - asked, len(cache) + len(query_ids), settings.use_cache,
                          self.backend.name, guide=settings.guide)
        cache.extend(query_ids)
        if settings.use_cache and cache.cached == 0:  # evicted: the shared prompt's part need not be recomputed
            self._reuse_prompt(cache)
        episode.protocol = self.protocol.name
        session.episodes.append(episode)
        started = time.perf_counter()
        try:
            claimed = self._claimed(question, settings, room=settings.max_length - len(cache))
            after: Segment | None = None  # the tool segment this model segment follows
            for calls in count():  # (model segments that called tools: max_turns bounds them)
                guide = self.guide(settings, claimed if calls == 0 else None, after, calls < settings.max_turns)
                segment = yield from self._model_segment(session, episode, settings, cancel, guide)
                requested = self.protocol.calls(segment, cache.ids[segment.start:segment.end], self.tools)
                if not requested:
                    break
                if calls >= settings.max_turns:
                    episode.unrun_call = True  # (recorded here, where the call is left unrun)
                    break
                if cancel is None or not cancel.is_set():  # Stop during the step that wrote the call: no tool
                    for index, call in enumerate(requested):  # (several calls in one segment: in order)
                        yield from self._tool_segment(session, episode, segment, call, index, len(requested),
                                                      settings)
                    after = episode.segments[-1]
                # (when cancelled, the next model segment records the stop with zero tokens and the turn ends)
        finally:
            episode.ms = (time.perf_counter() - started) * 1000
            episode.total_tokens = len(cache)
            episode.token_ids = cache.ids[episode.query_start:]
            episode.answered = self.protocol.ends_answer(episode.stop)
            episode.finished = True
        yield EpisodeFinished(episode)

    def _reuse_prompt(self, cache: TokenCache) -> None:
        with self._prompt_lock:
            bases = list(self._prompt_caches.values())
        any(cache.reuse(base, share=self.backend.shares_prefix) for base in bases)

    def guide(self, settings: Settings, claimed: ToolCall | None, after: Segment | None,
              calls: bool) -> Guide | None:
        """A model segment's guide (the protocol's), None with the guide off."""
        return self.protocol.guide(self.tools, claimed, after, calls) if settings.guide else None

    def claimed_call(self, question: str, settings: Settings | None = None, room: int | None = None) -> str | None:
        """The text of the call a question's reply is (`_claimed`), as the protocol writes it; else None."""
        call = self._claimed(question, settings, room)
        return None if call is None else self.protocol.call_text(call, self.tools)

    def _claimed(self, question: str, settings: Settings | None = None, room: int | None = None) -> ToolCall | None:
        """The call a question's reply is, forced by the guide, where one of the session's tools claims it
        (Tool.claims) and the guide is on; else None: the model chooses. None too where it could not run
        (max_turns 0) or be written whole (max_new_tokens, `room` left in max_length)."""
        if settings is not None and (settings.max_turns <= 0 or not settings.guide):
            return None
        for tool in self.tools.values():
            if tool.claims is not None and (query := tool.claims(question)):
                call = ToolCall(tool.name, query)
                if settings is None:
                    return call
                limit = settings.max_new_tokens if room is None else min(settings.max_new_tokens, room)
                return call if len(self._opening_ids(self.protocol.call_text(call, self.tools))) < limit else None
        return None

    def _opening_ids(self, text: str) -> list[int]:
        """The ids of a guide's opening (a claimed call), tokenized as untrusted text: the backend forces them."""
        with self.backend.lock:
            return encode(self.backend.tokenizer, text)

    def _model_segment(self, session: Session, episode: Episode, settings: Settings,
                       cancel: threading.Event | None, guide: Guide | None = None) -> Generator[Event, None, Segment]:
        cache = session.cache
        start, began = len(cache), time.perf_counter()
        opening = tuple(self._opening_ids(guide.opening)) if guide is not None and guide.opening else ()
        request = SegmentRequest(self.protocol.stop_strings, self.protocol.marker_ids,
                                 guide.grammar if guide else None, settings.logprobs, opening)
        segment = request.blank()  # what the segment did (the backend's result where one runs), placed at the end
        yield SegmentStarted("model")
        try:
            if len(cache) >= settings.max_length:
                segment.stop = Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_LENGTH)
            else:
                stream = Holdback(self.protocol.cut_stops)  # text that may start a cut stop waits for the next token
                running = self.backend.run_segment(cache, settings, cancel, request, session.generator)
                try:  # closing: a closed turn (Stop in the page) closes the backend's segment at once (its stream)
                    with closing(running.deltas) as deltas:
                        yield from _shown(stream, deltas)
                finally:
                    segment = running.result()
                end = None
                if segment.stop is not None and segment.stop.string in self.protocol.cut_stops:
                    end = self._cut(cache, start, segment.stop.string)  # not part of the answer
                if rest := stream.close(end):
                    yield TextDelta(rest)
        finally:
            segment.place(self._segment_text(cache.ids[start:]), start, len(cache), (time.perf_counter() - began) * 1000)
            segment.stop = segment.stop or Stop(StopReason.CANCELLED)  # (closed before anything said why it ended)
            episode.segments.append(segment)
        yield SegmentFinished(segment)
        return segment

    def _cut(self, cache: TokenCache, start: int, string: str) -> int:
        """Drop a cut stop string, which the backend kept like every stop string, and the blank space before it
        from the segment's tokens (whole tokens: one that also holds answer text stays); return how many
        characters of the segment's text remain."""
        ids = cache.ids[start:]
        ends = [len(self._segment_text(ids[:n])) for n in range(1, len(ids) + 1)]
        text = self._segment_text(ids)
        at = text.rfind(string)  # where the recorded stop string begins: generation ended right after it
        kept = len((text[:at] if at >= 0 else text).rstrip())  # (-1: a server left the string's tokens out)
        cache.truncate(start + tokens_before(ends, kept))
        return kept

    def _tool_segment(self, session: Session, episode: Episode, call_segment: Segment, call: ToolCall | ToolCallError,
                      index: int, count: int, settings: Settings) -> Iterator[Event]:
        """Run call `index` of the `count` that `call_segment` asks for (or say what is wrong with it) and append
        its result as the protocol writes it."""
        began = time.perf_counter()
        yield SegmentStarted("tool")
        cache = session.cache
        with self.backend.lock:
            if isinstance(call, ToolCallError):
                name, query, text, ok = None, None, f"error: {call}", False
            else:
                result = run_tool(self.tools, call.name, call.query)
                name, query, ok, text = call.name, call.query, result.ok, result.text
            # a protocol's error names its markers, and a tool's output may hold them: both in look-alikes, so that
            # an answer copying them (the guide's owed text) never writes a marker or a special token
            text = self.protocol.neutralize(text)
            if len(text) > settings.max_tool_response:
                text = text[: settings.max_tool_response - 1] + "…"
            whole = self.protocol.result_ids(call_segment, cache.ids[-8:], text, index, count)
        ids = whole[: max(0, settings.max_length - len(cache))]  # never past the session's budget
        start = len(cache)
        cache.extend(ids)
        inserted = self._decode(ids)
        cut = Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_LENGTH) if len(ids) < len(whole) else None  # (shown)
        segment = Segment("tool", inserted, start, len(cache), stop=cut, tool=name, query=query, ok=ok,
                          result=text, ms=(time.perf_counter() - began) * 1000)
        episode.segments.append(segment)
        yield SegmentFinished(segment)

    # ---- convenience ----------------------------------------------------------------------------------------
    def ask(self, session: Session, question: str, settings: Settings | None = None,
            cancel: threading.Event | None = None) -> Episode:
        """Run one turn to the end (or to `cancel`) and return its episode."""
        return _last_episode(self.turn(session, question, settings, cancel))

    def stream_batch(self, questions: list[str], settings: Settings | None = None, prompt: str | None = None,
                     cancel: threading.Event | None = None) -> Iterator[Event]:
        """Several questions, each in its own new session from the shared prompt cache, all at once
        (app.engine.rows): their segments share the backend's batched steps. Events carry the row and arrive
        interleaved (in_row_order sorts them). A row whose model fails ends with its episode's `error` set; the
        other rows go on."""
        settings = (settings or Settings()).validated(self.context_limit)
        for question in questions:
            clean_question(question)

        def row(i: int, question: str) -> Row:
            return Row(lambda: self.new_session(prompt, use_cache=settings.use_cache, seed=settings.seed + i),
                       question, settings)

        return stream_rows(self, [row(i, q) for i, q in enumerate(questions)], cancel)

    def run(self, questions: list[str], settings: Settings | None = None, prompt: str | None = None,
            reward_fn: Callable[[int, Episode], float] | None = None, guide: bool | None = None) -> list[Episode]:
        """Batch episodes like TRL's TextEnvironment.run(queries), all rows at once; reward_fn(row, episode)
        scores each. `guide`: guided answers on or off (default: the settings', on)."""
        if guide is not None:
            settings = replace(settings or Settings(), guide=guide)
        finished = {e.row: e.episode for e in self.stream_batch(questions, settings, prompt)
                    if isinstance(e, EpisodeFinished)}
        episodes = [finished[row] for row in sorted(finished)]
        if reward_fn is not None:
            for row, episode in enumerate(episodes):
                episode.reward = reward_fn(row, episode)
        return episodes


def _shown(stream: Holdback, deltas: Iterable[str]) -> Iterator[TextDelta]:
    """The deltas' text as the stream lets it be shown (a cut stop's possible start waits for the next delta)."""
    for delta in deltas:
        if shown := stream.push(delta):
            yield TextDelta(shown)


def _last_episode(events: Iterator[Event]) -> Episode:
    episode = None
    for event in events:
        if isinstance(event, EpisodeFinished):
            episode = event.episode
    assert episode is not None
    return episode
