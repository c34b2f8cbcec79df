"""Server-side store of chat sessions, keyed by the web session id (e.g. Gradio's session hash).

No Gradio imports: the page hands in a key string. Each entry holds what serving owns: an engine Session (token
ids, history, KV cache), the key of the engine that owns it (its tool set), its prompt template, a StopSignal per
Stop button and when it was last used; the page keeps its own record beside it (components/page_state.py). Memory is
bounded by a byte budget over the KV caches: when the total goes over, the least recently used sessions lose their
KV (`cache.drop_kv()`, ids and history are kept; their next turn recomputes); KV held outside the sessions (the
shared prefilled prompts) counts too. Idle sessions are deleted after a timeout (by a sweeper thread and on every
access), and a session is freed when its page unloads.
"""

from __future__ import annotations

import logging
import itertools
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from app.engine.session import Session
from app.model.kvcache import TokenCache, room_for

log = logging.getLogger(__name__)

MB = 1024 * 1024


def budget_from_env(default_mb: float = 512) -> int:
    """KV byte budget from KV_BUDGET_MB."""
    return int(float(os.environ.get("KV_BUDGET_MB", default_mb)) * MB)


# Tokens a job is expected to add, for its reservation: a question, its tool call and result and the answer, on
# the bundled model (docs/concurrency.md). A job that adds more still runs: the reservation paces admission; a
# running session's cache is never dropped.
TURN_TOKENS = 64


def kv_after(session: Session, bytes_per_token: int, use_cache: bool = True, shares_prefix: bool = True) -> int:
    """The bytes a cache run from `session`'s point holds by the end of a job: room for TURN_TOKENS more tokens,
    less the shared prompt's part where the cache is on and shares it."""
    shared = session.prompt_tokens if use_cache and shares_prefix else 0
    return room_for(len(session.cache) - shared + TURN_TOKENS) * bytes_per_token


def kv_reserve(session: Session, bytes_per_token: int, use_cache: bool = True, shares_prefix: bool = True,
               rows: int = 1) -> int:
    """What a job whose caches the store does not hold (Compare's forks, a batch's rows, `/ask`) reserves while it
    runs: `rows` caches of kv_after, less what the session holds where the cache is on."""
    after = kv_after(session, bytes_per_token, use_cache, shares_prefix)
    return rows * max(0, after - (session.cache.nbytes if use_cache else 0))


def idle_timeout_from_env(default_s: float = 3600) -> float:
    """Seconds of inactivity after which a session is deleted, from SESSION_IDLE_TIMEOUT_S."""
    return float(os.environ.get("SESSION_IDLE_TIMEOUT_S", default_s))


@dataclass
class StopSignal:
    """One Stop button. The page takes a ticket when it submits work; a Stop pressed after that cancels the work
    between two tokens if it runs, or at once when it starts if it was still waiting in the queue.

    Each piece of work watches an Event of its own (`begin`), which a press sets, so work that starts after a
    Stop cannot clear the stop of work still running (docs/architecture.md)."""

    presses: int = 0
    _running: weakref.WeakSet = field(default_factory=weakref.WeakSet, repr=False)  # begun Events, until dropped
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def press(self) -> None:
        with self._lock:
            self.presses += 1
            running = list(self._running)
        for event in running:
            event.set()

    def ticket(self) -> int:
        return self.presses

    def begin(self, ticket: int | None) -> threading.Event:
        """Start work submitted with `ticket` (None: not from the page, e.g. the API); return the Event it
        watches: set by the next press, and already set when Stop was pressed since the ticket was taken."""
        event = threading.Event()
        with self._lock:
            if ticket is not None and self.presses > ticket:
                event.set()
            self._running.add(event)
        return event


@dataclass(eq=False)
class Entry:
    """One visitor's chat: the engine session (None until the first turn) and what serving needs with it. Compared
    and hashed by identity, so the page can key its own record by the entry (it goes when the entry goes)."""

    session: Session | None = None
    engine_key: tuple[str, ...] | None = None  # its engine's key: the protocol and the tool set its prompt lists
    prompt: str | None = None  # the prompt template the session started from (None: the engine's default)
    chat_stop: StopSignal = field(default_factory=StopSignal)  # the Chat tab's Stop: chat turns and Compare
    batch_stop: StopSignal = field(default_factory=StopSignal)  # the Batch tab's Stop
    last_used: float = field(default_factory=time.monotonic)

    def stop_everything(self) -> None:
        """The page is gone: whatever runs for it stops at its next token."""
        self.chat_stop.press()
        self.batch_stop.press()

    @property
    def kv_bytes(self) -> int:
        session = self.session  # read once: a new chat may clear it meanwhile
        return session.cache.nbytes if session is not None else 0


@dataclass(eq=False)
class _Reservation:
    """A model job's room under the budget (SessionStore.turn_slot): `bytes` more, or, with `fills`, what that cache
    will hold by the job's end, less what it holds (which the store counts with its session)."""

    bytes: int
    fills: TokenCache | None = None

    def outstanding(self, counted: set[int]) -> int:
        """The bytes reserved now; `counted`: the ids of the caches the store's sessions hold."""
        if self.fills is None:
            return self.bytes
        held = self.fills.nbytes
        if id(self.fills) not in counted:  # its session left the store (a new chat meanwhile): all of it
            return max(self.bytes, held)
        return max(0, self.bytes - held)


class SharedPrompts(Protocol):
    """KV held outside the sessions that the sessions read (app.serving.engines.Engines: prefilled prompts)."""

    def kv_bytes(self, read: Sequence[object]) -> int:
        """The bytes held, and of the caches in `read`, each counted once."""

    def release(self, read: Sequence[object]) -> int:
        """Let go of what none of `read` is; the bytes freed."""


@dataclass(frozen=True)
class StoreStats:
    sessions: int
    kv_bytes: int  # the sessions' caches
    budget_bytes: int
    shared_bytes: int = 0  # held outside the sessions (the shared prefilled prompts), counted in the budget


class SessionStore:
    """Thread-safe dict of Entry by key, in least-recently-used order, with a KV byte budget and idle timeout."""

    def __init__(self, budget_bytes: int | None = None, idle_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, prompts: SharedPrompts | None = None):
        self.budget_bytes = budget_from_env() if budget_bytes is None else budget_bytes
        self.idle_timeout_s = idle_timeout_from_env() if idle_timeout_s is None else idle_timeout_s
        self._clock = clock
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._lock = threading.Lock()  # guards the dict only; each engine Session has its own lock
        self._turns = threading.Condition()  # chat turns running (see turn_slot)
        self._running = 0
        self._reserved: list[_Reservation] = []  # the running jobs' (see turn_slot)
        self._tickets = itertools.count()  # jobs waiting for their place, in arrival order (see turn_slot)
        self._queue: list[int] = []
        self._prompts = prompts  # KV held outside the sessions, counted in the budget (None: nothing)

    # ---- access ---------------------------------------------------------------------------------------------
    def get(self, key: str) -> Entry:
        """The entry for a key, created when missing, marked as just used."""
        self.sweep()
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = Entry(last_used=self._clock())
            else:
                entry.last_used = self._clock()
                self._entries.move_to_end(key)
            return entry

    def peek(self, key: str) -> Entry | None:
        """The entry if present, without creating it or marking it used."""
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def cancel(self, key: str, lane: str = "chat") -> bool:
        """Press the key's Stop for its chat (turns, Compare) or its batch; False when there is no such session."""
        entry = self.peek(key)
        if entry is None:
            return False
        (entry.batch_stop if lane == "batch" else entry.chat_stop).press()
        return True

    def reset(self, key: str) -> Entry:
        """A new chat: the session's history and cache go, the entry (and its Stop signals) stay. A chat turn
        still running sees that its session was replaced and stops at its next token; a batch or compare the
        visitor runs meanwhile goes on (it does not use the chat)."""
        entry = self.get(key)
        entry.session, entry.engine_key, entry.prompt = None, None, None
        return entry

    def remove(self, key: str) -> bool:
        """Free a session (page closed). A turn still running stops at its next token."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None:
            return False
        entry.stop_everything()
        return True

    # ---- limits ---------------------------------------------------------------------------------------------
    def sweep(self) -> list[str]:
        """Delete sessions idle for longer than the timeout; return their keys."""
        now = self._clock()
        with self._lock:
            expired = [k for k, e in self._entries.items() if now - e.last_used > self.idle_timeout_s]
            for key in expired:
                self._entries.pop(key).stop_everything()
        if expired:
            log.info("deleted %d idle session(s)", len(expired))
        return expired

    def start_sweeper(self, every_s: float = 60.0) -> threading.Event:
        """Sweep idle sessions every `every_s` seconds in a daemon thread, so their memory is freed even when no
        visitor comes; set the returned Event to stop it."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(every_s):
                self.sweep()

        threading.Thread(target=loop, name="session-sweeper", daemon=True).start()
        return stop

    def enforce_budget(self) -> list[str]:
        """Drop idle sessions' KV, least recently used first, to fit the budget beside the shared prompts; their
        keys."""
        return self._drop_to_budget()[0]

    def shared_bytes(self) -> int:
        """KV of the shared prompts (SharedPrompts), each counted once."""
        return 0 if self._prompts is None else self._prompts.kv_bytes(self.prefixes())

    def _drop_to_budget(self, jobs: Sequence[_Reservation] = ()) -> tuple[list[str], int]:
        """enforce_budget's work, with `jobs`' reservations counted and the caches they fill kept (a job about to
        run would recompute its own at once): (the keys whose caches were dropped, the bytes held and reserved
        afterwards)."""
        dropped: list[str] = []
        with self._lock:
            entries = list(self._entries.items())  # oldest first
        counted = {id(e.session.cache) for _, e in entries if e.session is not None}
        keep = {id(job.fills) for job in jobs if job.fills is not None}
        total = (self.shared_bytes() + sum(e.kv_bytes for _, e in entries)
                 + sum(job.outstanding(counted) for job in jobs))
        if total > self.budget_bytes and self._prompts is not None:  # unread prompts go before any chat's cache
            total -= self._prompts.release(self.prefixes())
        for key, entry in entries:
            if total <= self.budget_bytes:
                break
            session = entry.session
            if session is None or session.cache.nbytes == 0 or id(session.cache) in keep:
                continue
            if not session.lock.acquire(blocking=False):
                continue
            try:
                freed = session.cache.nbytes
                session.cache.drop_kv()
            finally:
                session.lock.release()
            total -= freed
            dropped.append(key)
        if dropped:
            log.info("KV budget: dropped the cache of %d session(s)", len(dropped))
        return dropped, total

    def prefixes(self) -> list:
        """The shared prefixes (DynamicCaches) the sessions read: counted once each, by whoever sums them."""
        with self._lock:
            sessions = [e.session for e in self._entries.values() if e.session is not None]
        return [s.cache.prefix for s in sessions if s.cache.prefix is not None]

    @contextmanager
    def turn_slot(self, cancel: threading.Event | None = None, *, reserve: int = 0,
                  fills: TokenCache | None = None, poll_s: float = 0.1) -> Iterator[None]:
        """Hold a model job's place under the KV budget (a chat turn, Compare, a batch, an `/ask`), as a serving
        engine admits a request only while its KV fits: a job starts when the sessions' caches, the shared prompts
        and what the running jobs reserve fit the budget (idle sessions' caches are dropped first), or when no
        other job runs (one always may, whatever the budget); otherwise it waits for jobs to end. A running
        session's cache is never dropped, so this is what holds the budget under load. A job reserves `reserve`
        bytes for what it is about to add while it runs (kv_reserve): jobs that arrive together would otherwise
        all start against the same free room. Waiting jobs start in the order they came: a later one that fits does
        not pass one that needs more room (docs/concurrency.md). A job stopped while it waits starts at once (and
        stops at its first step).

        `fills`: the cache a job grows where the store counts it (a chat turn's or `/chat`'s session), and
        `reserve` then what that cache will hold by the job's end (kv_after): what it holds is counted with the
        sessions' caches and the rest is reserved, so a turn's growth counts once, and a cache dropped while its
        turn waited is reserved whole again. Making room drops no cache
        that a running job, or the job being let in, fills."""
        job = _Reservation(reserve, fills)
        with self._turns:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:  # in arrival order: the first waiting job starts when it fits, or when no job runs
                while not (cancel is not None and cancel.is_set()) and (
                        self._queue[0] != ticket or
                        self._running and self._over_budget(job)):
                    self._turns.wait(poll_s)  # (idle caches may also be freed meanwhile: look again)
            finally:
                self._queue.remove(ticket)
                self._turns.notify_all()  # (the next in line may fit now)
            self._running += 1
            self._reserved.append(job)
        try:
            yield
        finally:
            with self._turns:
                self._running -= 1
                self._reserved.remove(job)
                self._turns.notify_all()

    def waiting(self) -> int:
        """How many jobs wait in turn_slot's line (each has checked, under the line's lock, that it must wait)."""
        with self._turns:
            return len(self._queue)

    def running(self) -> int:
        """How many jobs hold their place (inside turn_slot) now."""
        with self._turns:
            return self._running

    def reserved_bytes(self) -> int:
        """What the running jobs' reservations count now, beyond what the sessions' caches hold."""
        with self._lock:
            counted = {id(e.session.cache) for e in self._entries.values() if e.session is not None}
        with self._turns:
            return sum(job.outstanding(counted) for job in self._reserved)

    def _over_budget(self, job: _Reservation) -> bool:
        return self._drop_to_budget([*self._reserved, job])[1] > self.budget_bytes

    def stats(self) -> StoreStats:
        with self._lock:
            entries = list(self._entries.values())
        return StoreStats(sessions=len(entries), kv_bytes=sum(e.kv_bytes for e in entries),
                          budget_bytes=self.budget_bytes, shared_bytes=self.shared_bytes())
