"""The process's shared serving pieces, without the page: the model backend (loaded once, lazily), one Engine per
tool set, the server-side SessionStore and its memory budget. components/handlers.ChatService adds the page's events.
The page's Gradio session hash keys the store; no visitor's state lives in globals."""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from app.backends.base import Backend, BackendStats
from app.backends.select import load_backend
from app.engine.session import Session
from app.engine.engine import Engine
from app.model.kvcache import kv_nbytes
from app.serving.sessions import Entry, SessionStore, kv_after, kv_reserve
from app.protocols import resolve
from app.settings import InputError, Settings, default_protocol
from app.tools.registry import default_tools, get_tools

WARM_UP_QUESTION = "What is 1 + 1?"  # (warm_up: a turn that calls a tool, on a session nobody sees)


class ChatChange(enum.Enum):
    """What Service.prepare did to an entry's chat, for the page to say in words (components/page_state.py)."""

    KEPT = "kept"  # the entry's session was started with this tool set and prompt: the chat goes on
    STARTED = "started"  # a new session where there was none, or only one without a turn
    TOOLS_CHANGED = "tools changed"  # a new session in place of a chat with turns: another tool set
    PROMPT_CHANGED = "prompt changed"  # a new session in place of a chat with turns: the same tools, another prompt
    PROTOCOL_CHANGED = "protocol changed"  # a new session in place of a chat with turns: another protocol


class Service:
    """The model backend (in process, or a model server when MODEL_SERVER_URL is set), engines by tool set, the
    session store."""

    def __init__(self, loader: Callable[[], Backend] | None = None, store: SessionStore | None = None):
        self._loader = loader or load_backend
        self._backend: Backend | None = None
        self._engines: dict[tuple[str, ...], Engine] = {}  # by Engine.key: protocol and tool set
        self._lock = threading.Lock()
        self.store = store if store is not None else SessionStore()  # (an empty store is falsy: it has a len)
        self.store.release_shared = self.release_prompts

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
        """The engine for a tool subset (None: every tool) and protocol (None: the default, app.settings); engines
        share the model and are built once."""
        available = default_tools()
        try:
            chosen = get_tools(tools)  # case-insensitive, like the CLI's --tools
        except ValueError as error:
            raise InputError(str(error)) from None
        names = tuple(name for name in available if name in chosen)  # registry order: one engine per subset
        backend = self.backend
        try:
            with backend.lock:
                chosen_protocol = resolve(protocol or default_protocol(), backend.tokenizer)
        except ValueError as error:
            raise InputError(str(error)) from None
        key = (chosen_protocol, *names)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = Engine(backend, tools={n: available[n] for n in names}, protocol=chosen_protocol)
                self._engines[key] = engine
            return engine

    def decode(self, ids: list[int]) -> str:
        backend = self.backend
        with backend.lock:
            return backend.tokenizer.decode(ids, skip_special_tokens=False)

    def warm_up(self, defaults: Settings) -> None:
        """Load the model, prefill the default system prompt and run one short turn on a session of its own, so the
        first visitor does not wait for first-time work (the guide's tables, each kernel's and tool's first run)."""
        engine = self.engine_for(None, defaults.protocol)
        # (max_length None: the default for this backend, which fits its context; a server's slot may hold < 2,048)
        settings = dataclasses.replace(defaults, max_new_tokens=16, max_length=None)
        engine.ask(engine.new_session(), WARM_UP_QUESTION, settings)

    # ---- sessions -------------------------------------------------------------------------------------------
    def prepare(self, entry: Entry, engine: Engine, settings: Settings, prompt: str | None = None,
                message: str | None = None) -> tuple[Session, ChatChange]:
        """The entry's session for this engine and prompt template (None: the default one), and what happened to
        its chat: created when missing; a different tool set or prompt starts a new chat. A new session that cannot
        take `message` (a prompt too long for max_length) raises before it replaces the chat, so a rejected message
        leaves the old chat as it was."""
        prompt = engine.protocol.default_template() if prompt is None else prompt
        current = self.matching_session(entry, engine, prompt)
        if current is not None:
            return current, ChatChange.KEPT
        old = entry.session
        # the new session first: a prompt the engine rejects (e.g. too long) leaves the chat as it was
        session = engine.new_session(prompt=prompt, use_cache=settings.use_cache, seed=settings.seed)
        if message is not None:
            engine.query_ids(session, message, settings)  # (room for the message, before the chat is replaced)
        if old is None or not old.episodes:
            change = ChatChange.STARTED
        elif entry.engine_key is not None and entry.engine_key[0] != engine.key[0]:
            change = ChatChange.PROTOCOL_CHANGED
        else:
            change = ChatChange.TOOLS_CHANGED if entry.engine_key != engine.key else ChatChange.PROMPT_CHANGED
        entry.session, entry.engine_key, entry.prompt = session, engine.key, prompt
        return session, change

    def matching_session(self, entry: Entry, engine: Engine, prompt: str) -> Session | None:
        """The entry's session if it was started with this tool set and prompt (else None)."""
        session = entry.session
        if session is not None and entry.engine_key == engine.key and entry.prompt == prompt:
            return session
        return None

    def shared_kv_bytes(self) -> int:
        """KV of the shared prefilled prompts, each counted once in the sessions' budget: every engine's, and any
        an engine has let go of (a visitor's prompt, least recently used) that sessions still read."""
        with self._lock:
            engines = list(self._engines.values())
        held = {id(kv): kv for engine in engines for kv in engine.shared_kv()}
        held.update((id(kv), kv) for kv in self.store.prefixes())
        return sum(kv_nbytes(kv) for kv in held.values())

    def release_prompts(self) -> int:
        """The store's release_shared: every engine lets go of the prompts no session reads; the bytes freed."""
        before = self.shared_kv_bytes()
        read = {id(kv) for kv in self.store.prefixes()}
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            engine.release_prompts(read)
        return before - self.shared_kv_bytes()

    def chat_slot(self, session: Session, use_cache: bool,
                  cancel: threading.Event | None = None) -> AbstractContextManager[None]:
        """A chat turn's place under the KV budget (SessionStore.turn_slot), for a session the store holds: its
        cache's growth is counted as it fills (turn_room)."""
        return self.store.turn_slot(self.shared_kv_bytes, cancel, **self.turn_room(session, use_cache))

    def job_slot(self, session: Session, cancel: threading.Event | None = None, *, use_cache: bool = True,
                 rows: int = 1) -> AbstractContextManager[None]:
        """A model job's place under the KV budget, for `rows` sessions like `session` that the store does not hold
        (an `/ask`, a batch's rows, Compare's runs): their whole growth reserved (kv_reserve)."""
        return self.store.turn_slot(self.shared_kv_bytes, cancel, reserve=self.kv_reserve(session, use_cache, rows))

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
