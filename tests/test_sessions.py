"""The server-side session store: LRU KV eviction by byte budget, idle timeout, unload, reset, cancel."""

from __future__ import annotations

import threading

import time
from collections.abc import Callable

import pytest

from app.engine.engine import Engine
from app.serving.sessions import MB, SessionStore, StopSignal, budget_from_env, idle_timeout_from_env
from app.settings import Settings
from tests.conftest import forced


class FakeCache:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.ids = [1] * 10
        self.prefix = None  # (no shared prompt read)
        self.dropped = 0

    def drop_kv(self):
        self.nbytes = 0
        self.dropped += 1


class SharedBytes:
    """SharedPrompts (app/serving/sessions.py) holding `nbytes` of prompts, none of which it can let go of."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def kv_bytes(self, read) -> int:
        return self.nbytes

    def release(self, read) -> int:
        return 0


class FakeSession:
    def __init__(self, nbytes: int):
        self.cache = FakeCache(nbytes)
        self.lock = threading.Lock()
        self.episodes = []


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def filled(store: SessionStore, sizes: dict[str, int]) -> dict[str, FakeSession]:
    sessions = {}
    for key, size in sizes.items():
        sessions[key] = store.get(key).session = FakeSession(size)
    return sessions


def test_budget_drops_least_recently_used_kv_and_keeps_ids():
    store = SessionStore(budget_bytes=250, idle_timeout_s=3600)
    s = filled(store, {"a": 100, "b": 100, "c": 100})
    store.get("a")  # a is now the most recent: b is the oldest
    assert store.stats().kv_bytes == 300
    assert store.enforce_budget() == ["b"]
    assert s["b"].cache.nbytes == 0 and s["b"].cache.dropped == 1
    assert s["b"].cache.ids == [1] * 10  # text/ids kept: the next turn recomputes
    assert store.get("b").session is s["b"]  # the session itself is kept
    assert s["a"].cache.nbytes == s["c"].cache.nbytes == 100
    assert store.stats().kv_bytes == 200
    assert store.enforce_budget() == []


def test_budget_drops_several_and_skips_a_running_session():
    store = SessionStore(budget_bytes=100, idle_timeout_s=3600)
    s = filled(store, {"a": 100, "b": 100, "c": 100})
    s["a"].lock.acquire()  # a turn is running in a: its cache is in use
    try:
        assert store.enforce_budget() == ["b", "c"]
    finally:
        s["a"].lock.release()
    assert s["a"].cache.nbytes == 100
    assert store.stats() .kv_bytes == 100


def test_shared_prompt_bytes_count_in_the_budget():
    shared = SharedBytes(0)
    store = SessionStore(budget_bytes=250, idle_timeout_s=3600, prompts=shared)
    s = filled(store, {"a": 100, "b": 100})
    assert store.enforce_budget() == []
    shared.nbytes = 100
    assert store.enforce_budget() == ["a"]  # 100 shared + 200 sessions > 250
    assert s["b"].cache.nbytes == 100 and store.stats().shared_bytes == 100


def test_a_turn_waits_while_running_turns_spend_the_budget():
    """Regression (load test, 20 chats at once): running sessions' caches are never dropped, so without a wait
    the KV peak was 240 MB under a 24 MB budget."""
    store = SessionStore(budget_bytes=150, idle_timeout_s=3600)
    s = filled(store, {"a": 100, "b": 100})
    started, events = threading.Event(), []

    def second():
        with store.turn_slot():
            events.append("b started")
            started.set()

    with store.turn_slot():  # a's turn runs: its cache is in use
        s["a"].lock.acquire()
        s["b"].lock.acquire()  # b's turn is about to run too: its cache cannot be dropped either
        thread = threading.Thread(target=second)
        thread.start()
        assert not started.wait(0.3)  # 200 > 150 and a turn runs: b waits
        events.append("a done")
        s["a"].cache.drop_kv()  # (as if a's turn ended and its cache were dropped)
        s["a"].lock.release()
    assert started.wait(5)
    thread.join()
    s["b"].lock.release()
    assert events == ["a done", "b started"]


def test_running_turns_reserve_room_for_what_they_add():
    """Regression (load test, 20 chats at once under a 64 MB budget, peak 259 MB): turns arriving together all
    saw the same free room and all started; each running turn now holds its reservation until it ends."""
    store = SessionStore(budget_bytes=100, idle_timeout_s=3600, prompts=SharedBytes(50))
    started = threading.Event()

    def second():
        with store.turn_slot(reserve=30):
            started.set()

    with store.turn_slot(reserve=30):  # fits: 50 shared + 30 reserved
        thread = threading.Thread(target=second)
        thread.start()
        assert not started.wait(0.3)  # the sessions hold nothing, but 50 + 30 + 30 > 100: it waits
    assert started.wait(5)  # the first turn ended and gave its reservation back
    thread.join()


def test_what_a_running_turn_takes_on_counts_once_held_no_longer_reserved():
    """Regression (load test, 20 chats under 64 MB): a turn's reservation stayed whole while its session's cache
    filled it, so what it took on counted twice and turns waited with the budget's room unused (peak 50-52 MB
    of 64). With `fills`, `reserve` is what that cache will hold by the job's end: held counts as held, the rest
    as reserved; a job without one reserves its bytes whole (an `/ask`'s session, Compare's forks)."""
    store = SessionStore(budget_bytes=100, idle_timeout_s=3600, prompts=SharedBytes(40))
    running = filled(store, {"a": 10})["a"]
    started = threading.Event()

    def second():
        with store.turn_slot(reserve=20):
            started.set()

    with running.lock, store.turn_slot(reserve=40, fills=running.cache):  # 40 + 10 held + 30
        assert store.reserved_bytes() == 30
        running.cache.nbytes = 40  # it took on its 30: 40 + 40 held + 0 reserved (counted twice: 110)
        assert store.reserved_bytes() == 0
        thread = threading.Thread(target=second)
        thread.start()
        assert started.wait(5)  # 40 + 40 + 20 = 100 fits
        thread.join()
        running.cache.nbytes = 60  # past it: all held, none reserved
        assert store.reserved_bytes() == 0
    with store.turn_slot(reserve=30):  # (no cache given: the reservation stays whole)
        assert store.reserved_bytes() == 30


def test_two_jobs_filling_one_cache_each_count_what_they_will_add():
    """Review: with each reservation less the growth since it started, two jobs on one cache (two `/chat` calls
    of one client at once) took the same growth off twice and the budget could be overshot; each now counts its
    end size less what the cache holds, so together they count more, never less."""
    store = SessionStore(budget_bytes=1000, idle_timeout_s=3600)
    cache = filled(store, {"a": 10})["a"].cache
    with store.turn_slot(reserve=40, fills=cache), store.turn_slot(reserve=40, fills=cache):
        assert store.reserved_bytes() == 60  # 30 + 30
        cache.nbytes = 30
        assert store.reserved_bytes() == 20  # 10 + 10 (and 30 held)


def test_a_waiting_turns_cache_is_not_dropped_and_a_dropped_one_is_reserved_whole():
    """Review: the reservation was worked out before the wait, and making room could drop the waiting turn's own
    cache (its lock is taken only once it runs): it then needed that much more than it had reserved. Caches
    that running or waiting jobs fill are kept; one dropped before (or a session that left the store) counts
    its whole end size."""
    store = SessionStore(budget_bytes=100, idle_timeout_s=3600)
    sessions = filled(store, {"mine": 30, "idle": 30})
    started = threading.Event()

    def waiting():
        with store.turn_slot(reserve=40, fills=sessions["mine"].cache):
            started.set()

    with store.turn_slot(reserve=50):  # running: 60 held + 50 reserved
        thread = threading.Thread(target=waiting)
        thread.start()  # 60 + 50 + 10 > 100: the least recently used cache is its own ("mine"), kept; "idle" goes
        assert started.wait(5)
        thread.join()
    assert sessions["mine"].cache.dropped == 0 and sessions["idle"].cache.dropped == 1
    sessions["mine"].cache.drop_kv()  # dropped before its turn: all 40 again
    with store.turn_slot(reserve=40, fills=sessions["mine"].cache):
        assert store.reserved_bytes() == 40
        store.get("mine").session = None  # a new chat: the cache left the store; it counts whole
        sessions["mine"].cache.nbytes = 50
        assert store.reserved_bytes() == 50


def until(predicate) -> None:
    """Wait (no deadline: pytest-timeout ends a hang) until `predicate` holds; it reads the store's records."""
    while not predicate():
        time.sleep(0.001)


def test_jobs_waiting_for_room_start_in_the_order_they_came():
    """Regression (load test, 20 chats under a 64 MB budget, p95 first text 8.9-10.9 s): a waiting job was
    overtaken by every later one that happened to fit, so a turn that needed more room waited longest (an API
    client's first turn waited 67 s while another finished two). Now the first in line starts first."""
    store = SessionStore(budget_bytes=100, idle_timeout_s=3600)
    order: list[str] = []

    def job(name: str, reserve: int, ahead: int) -> threading.Thread:
        def run() -> None:
            with store.turn_slot(reserve=reserve):
                order.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        until(lambda: store.waiting() == ahead + 1 or order)  # it has come and waits (or, wrongly, has run)
        return thread

    with store.turn_slot(reserve=60):  # running
        big = job("big", 50, ahead=0)  # 60 + 50 > 100: waits
        assert order == []
        small = job("small", 10, ahead=1)  # 60 + 10 fits, but the big one came first
        assert order == []
    big.join(), small.join()
    assert order == ["big", "small"]


def started_at_once(store: SessionStore, **slot) -> Callable[[], None]:
    """Start a job (turn_slot(**slot)) in a thread; fail if it waits in the store's line instead (read
    from the line itself, no timing: a job counted there has checked that it must wait). Returns its end."""
    started, leave = threading.Event(), threading.Event()

    def run() -> None:
        with store.turn_slot(**slot):
            started.set()
            leave.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    until(lambda: started.is_set() or store.waiting())
    assert started.is_set(), "a job waited for room"
    return lambda: (leave.set(), thread.join())


def test_one_turn_always_runs_and_a_stopped_one_does_not_wait():
    store = SessionStore(budget_bytes=10, idle_timeout_s=3600, prompts=SharedBytes(50))
    s = filled(store, {"a": 100})
    s["a"].lock.acquire()  # a turn runs in "a": its cache cannot be dropped to make room
    end_alone = started_at_once(store, reserve=5)  # over the budget on its own: it runs, being the only one
    stop = threading.Event()
    stop.set()
    end_stopped = started_at_once(store, reserve=5, cancel=stop)  # stopped: starts at once, to stop at its first step
    assert store.running() == 2 and store.reserved_bytes() == 10
    end_stopped(), end_alone()
    s["a"].lock.release()
    assert s["a"].cache.dropped == 0
    assert store.waiting() == 0 and store.running() == 0 and store.reserved_bytes() == 0  # both left its records


def test_the_sweeper_deletes_idle_sessions_without_any_visitor():
    store = SessionStore(budget_bytes=MB, idle_timeout_s=0.05)
    cancel = store.get("idle").chat_stop.begin(None)  # work running for it
    stop = store.start_sweeper(every_s=0.02)
    try:
        deadline = time.monotonic() + 5
        while "idle" in store and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
    assert "idle" not in store and cancel.is_set()


def test_a_stop_cancels_work_submitted_before_it_running_or_queued():
    signal = StopSignal()
    first, second = signal.ticket(), signal.ticket()  # two messages submitted
    running = signal.begin(first)  # the first starts
    assert not running.is_set()
    signal.press()  # Stop while it runs (the second still waits in the queue)
    assert running.is_set()
    assert signal.begin(second).is_set()  # the second starts already cancelled
    assert not signal.begin(signal.ticket()).is_set()  # work submitted after the Stop runs
    signal.press()
    assert not signal.begin(None).is_set()  # work that took no ticket (API) starts clear


def test_work_starting_after_a_stop_leaves_the_stopped_work_stopped():
    """Regression: one Event per button, cleared by the next start: a message sent right after Stop, while the
    stopped turn was still in a long prefill (no token check yet), made that turn run on to its end."""
    signal = StopSignal()
    running = signal.begin(signal.ticket())
    signal.press()
    later = signal.begin(signal.ticket())  # sent after the Stop: it runs
    assert running.is_set() and not later.is_set()
    signal.press()
    assert later.is_set()


def test_idle_sessions_are_deleted_and_cancelled():
    clock = Clock()
    store = SessionStore(budget_bytes=MB, idle_timeout_s=60, clock=clock)
    filled(store, {"old": 1, "new": 1})
    old_cancel = store.peek("old").batch_stop.begin(None)
    clock.now += 40
    store.get("new")
    clock.now += 30  # old idle 70 s, new idle 30 s
    assert store.sweep() == ["old"]
    assert "old" not in store and "new" in store
    assert old_cancel.is_set()
    clock.now += 61
    store.get("other")  # every access sweeps
    assert "new" not in store and len(store) == 1


def test_unload_removes_and_cancels():
    store = SessionStore(budget_bytes=MB, idle_timeout_s=60)
    filled(store, {"a": 10})
    cancel = store.peek("a").chat_stop.begin(None)
    assert store.remove("a") is True
    assert cancel.is_set() and "a" not in store
    assert store.remove("a") is False
    assert store.stats().sessions == 0


def test_reset_clears_the_chat_but_keeps_the_entry():
    store = SessionStore(budget_bytes=MB, idle_timeout_s=60)
    filled(store, {"a": 10})
    entry = store.peek("a")
    batch = entry.batch_stop.begin(None)
    entry.engine_key = ("Calculator",)
    assert store.reset("a") is entry
    assert entry.session is None and entry.engine_key is None
    assert not batch.is_set()  # a batch running for this visitor goes on


def test_cancel_sets_the_event_of_that_session_only():
    store = SessionStore(budget_bytes=MB, idle_timeout_s=60)
    a, b = store.get("a"), store.get("b")
    work = {(key, lane): getattr(entry, f"{lane}_stop").begin(None) for key, entry in (("a", a), ("b", b))
            for lane in ("chat", "batch")}
    assert store.cancel("a") is True
    assert work["a", "chat"].is_set() and not work["b", "chat"].is_set()
    assert not work["a", "batch"].is_set()  # each Stop button has its own signal
    assert store.cancel("b", "batch") is True and work["b", "batch"].is_set() and not work["b", "chat"].is_set()
    assert store.cancel("missing") is False and "missing" not in store


def test_env_defaults(monkeypatch):
    monkeypatch.setenv("KV_BUDGET_MB", "2")
    monkeypatch.setenv("SESSION_IDLE_TIMEOUT_S", "5")
    assert budget_from_env() == 2 * MB
    assert idle_timeout_from_env() == 5.0
    store = SessionStore()
    assert store.budget_bytes == 2 * MB and store.idle_timeout_s == 5.0
    monkeypatch.delenv("KV_BUDGET_MB")
    monkeypatch.delenv("SESSION_IDLE_TIMEOUT_S")
    assert budget_from_env() == 512 * MB and idle_timeout_from_env() == 3600


def test_real_sessions_over_budget_continue_with_identical_tokens(tiny_llama):
    """Evicting a real session's KV keeps its ids; its next turn recomputes its own tokens (the system prompt's
    come from the shared prefilled prompt) and generates the same tokens."""
    settings = Settings(max_new_tokens=6, max_turns=0)
    results = []
    for budget in (10**12, 1):
        engine = Engine(forced(tiny_llama), tools={})
        store = SessionStore(budget_bytes=budget, idle_timeout_s=3600)
        entry = store.get("a")
        entry.session = engine.new_session()
        engine.ask(entry.session, "first", settings)
        assert entry.session.cache.nbytes > 0
        store.enforce_budget()
        if budget == 1:
            assert entry.session.cache.nbytes == 0 and entry.session.cache.cached == 0
        ids_before = list(entry.session.cache.ids)
        episode = engine.ask(entry.session, "second", settings)
        assert entry.session.cache.ids[: len(ids_before)] == ids_before
        if budget == 1:
            assert episode.segments[0].cached_tokens == entry.session.prompt_tokens  # the rest recomputed
        results.append(entry.session.cache.ids)
    assert results[0] == results[1]


@pytest.mark.parametrize("size", [0, 5])
def test_stats_totals(size):
    store = SessionStore(budget_bytes=3 * MB, idle_timeout_s=60)
    filled(store, {"a": size, "b": 7})
    store.get("c")  # no session yet
    stats = store.stats()
    assert (stats.sessions, stats.kv_bytes, stats.budget_bytes) == (3, size + 7, 3 * MB)
