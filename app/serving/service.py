"""Serving, without the page: the model backend (loaded once, lazily), its engines, the server-side SessionStore with
its memory budget, and every model job the page and the API run (a chat turn, an `/ask`, a batch, a Compare), each
admitted under that budget here. Visitors are told apart by a key (the page's Gradio session hash); no visitor's
state lives in globals."""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from app.backends.base import Backend, BackendStats
from app.backends.select import load_backend
from app.engine.comparisons import Comparison, GuideComparison, compare, compare_guide
from app.engine.engine import Engine
from app.engine.session import Session
from app.episode import Episode, Event
from app.serving.choice import Job, TurnSettings, prompt_for_protocol
from app.serving.engines import Engines
from app.serving.sessions import Entry, SessionStore, kv_after, kv_reserve
from app.serving.streaming import in_batches
from app.settings import PROTOCOLS, InputError, Settings, clean_question

WARM_UP_QUESTION = "What is 1 + 1?"  # (warm_up: a turn that calls a tool, on a session nobody sees)
# the page's and the API's settings; max_length is their default where the backend's context holds it
DEFAULTS = Settings(max_new_tokens=64, max_length=2048, max_turns=4, temperature=0.0, use_cache=True, draft_tokens=8)


class ChatChange(enum.Enum):
    """What Service.prepare did to an entry's chat, for the page to say in words (components/page_state.py)."""

    KEPT = "kept"  # the entry's session was started with this tool set and prompt: the chat goes on
    STARTED = "started"  # a new session where there was none, or only one without a turn
    TOOLS_CHANGED = "tools changed"  # a new session in place of a chat with turns: another tool set
    PROMPT_CHANGED = "prompt changed"  # a new session in place of a chat with turns: the same tools, another prompt
    PROTOCOL_CHANGED = "protocol changed"  # a new session in place of a chat with turns: another protocol


@dataclass(frozen=True)
class TurnOpened:
    """stream_turn's first item: the chat the turn runs in, what preparing it did, and the job it runs."""

    session: Session
    change: ChatChange
    job: Job


@dataclass(frozen=True)
class Admitted:
    """stream_batch's first item: the batch has its place under the KV budget and starts now."""


class Service:
    """The model backend (in process, or a model server when MODEL_SERVER_URL is set), engines by tool set, the
    session store, and the model jobs run on them."""

    def __init__(self, loader: Callable[[], Backend] | None = None, *, defaults: Settings = DEFAULTS,
                 budget_bytes: int | None = None, idle_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._loader = loader or load_backend
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self.defaults = defaults
        self.engines = Engines()
        self.store = SessionStore(budget_bytes, idle_timeout_s, clock, prompts=self.engines)

    # ---- shared model and engines ---------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        """Loaded on first use; a model server that is down raises a BackendError and is asked again next time."""
        with self._lock:
            if self._backend is None:
                self._backend = self._loader()
            return self._backend

    def loaded_backend(self) -> Backend | None:
        """The backend if it is loaded, else None (never loading it: the page draws itself before the first turn)."""
        return self._backend

    def backend_stats(self) -> BackendStats | None:
        """The backend's figures, or None before it is loaded."""
        backend = self._backend
        return None if backend is None else backend.stats()

    def engine_for(self, tools: Sequence[str] | None, protocol: str | None = None) -> Engine:
        """The engine for a tool subset (None: every tool) and protocol (None: the default, app.settings)."""
        return self.engines.get(self.backend, tools, protocol)

    def default_templates(self) -> list[str]:
        """Every protocol's default prompt template (Protocol.default_template) that this model can run."""
        templates = []
        for name in PROTOCOLS:
            if name == "auto":
                continue
            try:
                templates.append(self.engine_for(None, name).protocol.default_template())
            except InputError:  # (a protocol this model's tokenizer cannot follow)
                continue
        return templates

    def choose(self, asked: TurnSettings) -> Job:
        """The engine, the settings checked against its model and the prompt template for `asked`, or a clear
        InputError. A prompt that is another protocol's default, unedited, is this protocol's default
        (prompt_for_protocol)."""
        engine = self.engine_for(asked.tools, asked.settings.protocol)
        settings = asked.settings.validated(engine.context_limit, self.defaults.max_length)
        default = engine.protocol.default_template()
        prompt = default if asked.prompt is None else prompt_for_protocol(asked.prompt, default,
                                                                          self.default_templates())
        return Job(engine, settings, prompt)

    def decode(self, ids: list[int]) -> str:
        backend = self.backend
        with backend.lock:
            return backend.tokenizer.decode(ids, skip_special_tokens=False)

    def warm_up(self) -> None:
        """Load the model, prefill the default system prompt and run one short turn on a session of its own, so the
        first visitor does not wait for first-time work (the guide's tables, each kernel's and tool's first run):
        guided, so that switching the guide on costs no first-time work either."""
        engine = self.engine_for(None, self.defaults.protocol)
        # (max_length None: the default for this backend, which fits its context; a server's slot may hold < 2,048)
        settings = dataclasses.replace(self.defaults, max_new_tokens=16, max_length=None, guide=True)
        engine.ask(engine.new_session(), WARM_UP_QUESTION, settings)

    # ---- model jobs -----------------------------------------------------------------------------------------
    def stream_turn(self, key: str, message: str, asked: TurnSettings,
                    cancel: threading.Event) -> Iterator[TurnOpened | list[Event]]:
        """One chat turn of the visitor `key` (the page's Chat tab, the API's `/chat`): the settings checked, the
        visitor's chat prepared (TurnOpened says what that did), then the turn's events in lists of those that
        arrived since the last, once it has its place under the KV budget; the idle caches are trimmed to the
        budget afterwards. A new chat started meanwhile ends the turn (the visitor's session is no longer its)."""
        job = self.choose(asked)
        question = clean_question(message)  # before prepare: a rejected message must not start a new chat
        entry = self.store.get(key)
        session, change = self.prepare(entry, job, question)
        yield TurnOpened(session, change, job)
        with self.chat_slot(session, job.settings.use_cache, cancel):  # (it waits while running jobs fill it)
            # (the turn runs at the model's pace on a thread of its own; each list holds what arrived meanwhile)
            for events in in_batches(job.engine.turn(session, message, job.settings, cancel=cancel), cancel):
                if entry.session is not session:  # a new chat (or the page closed) while this turn ran
                    break
                yield events
        self.store.enforce_budget()

    def ask(self, question: str, asked: TurnSettings) -> Episode:
        """One question in a fresh session that no visitor keeps (`/ask`)."""
        job = self.choose(asked)
        session = job.engine.new_session(job.prompt, use_cache=job.settings.use_cache, seed=job.settings.seed)
        with self.job_slot(session, use_cache=job.settings.use_cache):
            return job.engine.ask(session, question, job.settings)

    def stream_batch(self, job: Job, questions: list[str], cancel: threading.Event) -> Iterator[Admitted | Event]:
        """The questions as one batch (Engine.stream_batch): Admitted once their rows have their place under the KV
        budget, then the rows' events as they come."""
        session = job.engine.new_session(job.prompt)
        with self.job_slot(session, cancel, use_cache=job.settings.use_cache, rows=len(questions)):
            yield Admitted()
            yield from job.engine.stream_batch(questions, job.settings, job.prompt, cancel=cancel)

    def compare(self, key: str, what: str, message: str, asked: TurnSettings,
                cancel: threading.Event) -> tuple[Comparison | GuideComparison, Job]:
        """The question with the cache (`what` "cache") or the guide ("guide") on and off, on forks of the visitor's
        chat, which stays as it was; an empty `message`: the chat's last turn again, from where it was asked."""
        entry = self.store.get(key)
        question, rerun = message.strip(), not message.strip()
        if rerun:
            last = entry.session.episodes[-1].question if entry.session and entry.session.episodes else ""
            if not last:
                raise InputError("nothing to compare: type a question (or ask one in the chat first)")
            question = last
        job = self.choose(asked)
        session, turns = self.matching_session(entry, job), None
        if session is None:  # no chat yet (or it used other tools or another prompt): a fresh session
            session = job.engine.new_session(prompt=job.prompt, use_cache=True, seed=job.settings.seed)
        elif rerun:
            turns = len(session.episodes) - 1  # from where the last turn was asked
        run = compare if what == "cache" else compare_guide
        # (room for a run that holds the whole session in a cache of its own: the cache-off run needs more than the
        # cached one; the guide's runs copy the session's cache)
        with self.job_slot(session, cancel, use_cache=False):
            return run(job.engine, session, question, job.settings, cancel=cancel, turns=turns), job

    # ---- sessions -------------------------------------------------------------------------------------------
    def prepare(self, entry: Entry, job: Job, message: str | None = None) -> tuple[Session, ChatChange]:
        """The entry's session for this job's engine and prompt, and what happened to its chat: created when
        missing; a different tool set or prompt starts a new chat. A new session that cannot take `message` (a
        prompt too long for max_length) raises before it replaces the chat, so a rejected message leaves the old
        chat as it was."""
        current = self.matching_session(entry, job)
        if current is not None:
            return current, ChatChange.KEPT
        old, engine = entry.session, job.engine
        # the new session first: a prompt the engine rejects (e.g. too long) leaves the chat as it was
        session = engine.new_session(prompt=job.prompt, use_cache=job.settings.use_cache, seed=job.settings.seed)
        if message is not None:
            engine.query_ids(session, message, job.settings)  # (room for the message, before the chat is replaced)
        if old is None or not old.episodes:
            change = ChatChange.STARTED
        elif entry.engine_key is not None and entry.engine_key[0] != engine.key[0]:
            change = ChatChange.PROTOCOL_CHANGED
        else:
            change = ChatChange.TOOLS_CHANGED if entry.engine_key != engine.key else ChatChange.PROMPT_CHANGED
        entry.session, entry.engine_key, entry.prompt = session, engine.key, job.prompt
        return session, change

    @staticmethod
    def matching_session(entry: Entry, job: Job) -> Session | None:
        """The entry's session if it was started with this job's tool set and prompt (else None)."""
        session = entry.session
        if session is not None and entry.engine_key == job.engine.key and entry.prompt == job.prompt:
            return session
        return None

    def chat_slot(self, session: Session, use_cache: bool,
                  cancel: threading.Event | None = None) -> AbstractContextManager[None]:
        """A chat turn's place under the KV budget (SessionStore.turn_slot), for a session the store holds: its
        cache's growth is counted as it fills (turn_room)."""
        return self.store.turn_slot(cancel, **self.turn_room(session, use_cache))

    def job_slot(self, session: Session, cancel: threading.Event | None = None, *, use_cache: bool = True,
                 rows: int = 1) -> AbstractContextManager[None]:
        """A model job's place under the KV budget, for `rows` sessions like `session` that the store does not hold
        (an `/ask`, a batch's rows, Compare's runs): their whole growth reserved (kv_reserve)."""
        return self.store.turn_slot(cancel, reserve=self.kv_reserve(session, use_cache, rows))

    def turn_room(self, session: Session, use_cache: bool) -> dict:
        """SessionStore.turn_slot's room for a turn of a session the store holds: with the cache on, what its cache
        will hold by the turn's end, filled by that cache (nothing where the keys/values live on a model server)."""
        if not use_cache:  # (every segment recomputes in a cache of its own, which the store does not hold)
            return dict(reserve=self.kv_reserve(session, use_cache=False))
        backend = self.backend
        if not backend.kv_in_process:
            return {}
        return dict(reserve=kv_after(session, backend.kv_bytes_per_token, shares_prefix=backend.shares_prefix),
                    fills=session.cache)

    def kv_reserve(self, session: Session, use_cache: bool = True, rows: int = 1) -> int:
        """app.serving.sessions.kv_reserve for this backend: nothing where the keys/values live on a model server."""
        backend = self.backend
        if not backend.kv_in_process:
            return 0
        return kv_reserve(session, backend.kv_bytes_per_token, use_cache, backend.shares_prefix, rows)
