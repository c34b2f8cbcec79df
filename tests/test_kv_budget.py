"""The page's model jobs under the KV budget (components/ on app/serving/service.py): the shared
prompts counted once and let go of first, what a job reserves, jobs that wait for room, and the warm-up."""

from __future__ import annotations

import threading

import pytest

from app.backends.local import LocalBackend
from app.engine.engine import Engine
from app.model.kvcache import GROW_TOKENS, kv_nbytes
from app.serving.sessions import MB, TURN_TOKENS
from tests.conftest import forced
from tests.support.page import make_page, new_page, page_settings, request, turn
from tests.support.page import one_token_per_pass  # noqa: F401  (an autouse fixture)


def test_shared_prompt_caches_show_in_stats_and_count_in_the_budget(tiny_llama):
    page, _ = make_page(tiny_llama)  # warm_up prefilled the default prompt for every tool
    service = page.service
    service.engine_for(["Calculator"]).new_session()  # a second engine, its own shared prompt
    shared = service.store.shared_bytes()
    assert shared == service.engine_for(None).shared_kv_bytes + service.engine_for(["Calculator"]).shared_kv_bytes
    assert f"+ {shared / MB:.1f} MB of shared prompts" in page.chat.stats(None)
    turn(page, "hi", max_new_tokens=2, max_turns=0)
    session = service.store.peek("page-1").session
    mine = session.cache.nbytes
    service.store.budget_bytes = mine + shared // 2  # the session alone fits; with the shared prompts it does not
    turn(page, "again", max_new_tokens=2, max_turns=0)
    assert session.cache.nbytes == 0  # so the session's KV went


def test_a_prompt_the_engine_let_go_of_counts_while_sessions_read_it(tiny_llama):
    """Sessions read the prefilled prompt in place (app.model.kvcache); when a visitor's prompt pushes it out of the
    engine's few, the sessions still hold it: it stays in the budget, once."""
    page = new_page(lambda: tiny_llama)
    service = page.service
    turn(page, "hi", max_new_tokens=2, max_turns=0)
    turn(page, "hello", key="page-2", max_new_tokens=2, max_turns=0)
    engine = service.engine_for(["Calculator", "Search"])
    prefix = service.store.peek("page-1").session.cache.prefix
    assert prefix is not None and prefix is service.store.peek("page-2").session.cache.prefix
    assert service.store.shared_bytes() == engine.shared_kv_bytes == kv_nbytes(prefix)  # two readers, one copy
    session = service.store.peek("page-1").session
    assert f"MB of KV of its own, {session.prompt_tokens} read from the shared prompt)" in page.chat.stats(session)
    for n in range(Engine.PROMPT_CACHE_SIZE):  # visitors' own prompts (not prefilled) push it out
        engine.new_session(prompt=f"Visitor {n}'s prompt.\n{{tools}}\n", use_cache=False)
    assert engine.prompt not in engine.held_prompts
    assert engine.shared_kv_bytes == 0 and service.store.shared_bytes() == kv_nbytes(prefix)


def test_visitors_prompts_no_session_reads_give_way_before_any_chats_cache(tiny_llama):
    """Regression (review): every tool set's engine kept its last 4 prompts prefilled, counted in KV_BUDGET_MB and
    never let go of: a few visitors' prompts held the shared KV over the budget for good, so every job ran alone
    and every idle chat lost its cache after each turn. Now the prompts no session reads give way first."""
    page = new_page(lambda: tiny_llama)
    service = page.service
    turn(page, "hi", max_new_tokens=2, max_turns=0)  # page-1 reads the default prompt
    custom = "Be brief.\n{tools}\n" + "Answer well. " * 30
    turn(page, "hey", key="page-2", max_new_tokens=2, max_turns=0, prompt=custom)  # page-2 a visitor's prompt
    for tools in ([], ["Calculator"], ["Search"], ["Calculator", "Search"]):
        for n in range(4):  # visitors' prompts on every tool set, that no session reads any more
            service.engine_for(tools).new_session(prompt=f"Visitor {n}.\n{{tools}}\n" + "The quick fox. " * 40)
    chats = [service.store.peek(key).session for key in ("page-1", "page-2")]
    read = sum(kv_nbytes(kv) for kv in {id(kv): kv for kv in service.store.prefixes()}.values())
    assert service.store.shared_bytes() > 3 * read  # the unread prompts
    service.store.budget_bytes = sum(chat.cache.nbytes for chat in chats) + read  # what is in use, exactly
    assert service.store.enforce_budget() == []  # no chat lost its cache
    assert all(chat.cache.nbytes > 0 for chat in chats)
    assert service.store.shared_bytes() == read  # the prompts the chats read stay, and count


def test_a_prompt_let_go_of_while_a_batch_row_reads_it_counts_until_nothing_does(tiny_llama):
    import gc

    engine = Engine(tiny_llama)
    row = engine.new_session(prompt="A batch's own prompt.\n{tools}\n")  # (a batch row: in no store)
    kv = row.cache.prefix
    engine.release_prompts(read=set())
    assert [id(k) for k in engine.shared_kv()] == [id(kv)]  # let go of, still read: still counted
    del row, kv
    gc.collect()
    assert engine.shared_kv() == []


def test_a_model_job_reserves_what_its_caches_will_hold_after_a_turn(tiny_llama):
    """SessionStore.turn_slot's reservation (app.serving.sessions.kv_reserve): the room its cache will have after
    TURN_TOKENS more tokens, less what the session holds; the whole cache again when it was dropped; with the
    cache off, the whole session (the shared prompt too) in a cache of its own; per row."""
    page = new_page(lambda: tiny_llama)
    service = page.service
    turn(page, "hi", max_new_tokens=2, max_turns=0)
    session = service.store.peek("page-1").session
    per_token, own = tiny_llama.kv_bytes_per_token, len(session.cache) - session.prompt_tokens
    assert 0 < own < GROW_TOKENS  # its own tokens ...
    assert session.cache.nbytes == GROW_TOKENS * per_token  # ... in one step of room
    after = ((own + TURN_TOKENS) // GROW_TOKENS + 1) * GROW_TOKENS * per_token
    assert service.kv_reserve(session) == after - GROW_TOKENS * per_token
    off = ((len(session.cache) + TURN_TOKENS) // GROW_TOKENS + 1) * GROW_TOKENS * per_token
    assert service.kv_reserve(session, use_cache=False) == off and service.kv_reserve(session, False, rows=3) == 3 * off
    session.cache.drop_kv()
    assert service.kv_reserve(session) == after


@pytest.mark.parametrize("job", ["ask", "compare", "batch"])
def test_compare_batch_and_ask_wait_while_running_jobs_hold_the_kv_budget(tiny_llama, job):
    """Regression: Compare, the Batch tab and /ask ran outside the KV budget (a batch's cache-off run holds the
    whole session once per row). They now take a slot as chat turns do."""
    page = new_page(lambda: tiny_llama, budget_bytes=MB)
    settings = page_settings(max_new_tokens=2, max_turns=0)
    run = {"ask": lambda: page.api.ask("What is 2 + 2?", {"max_new_tokens": 2, "max_turns": 0}),
           "compare": lambda: list(page.chat.compare("What is 2 + 2?", settings, request())),
           "batch": lambda: list(page.batch.run("What is 2 + 2? = 4", settings, request()))}[job]
    done, out = threading.Event(), []
    thread = threading.Thread(target=lambda: (out.append(run()), done.set()))
    with page.service.store.turn_slot(reserve=2 * MB):  # another job holds more than the budget
        thread.start()
        assert not done.wait(1.0), out
    assert done.wait(120)
    thread.join()


def test_warm_up_runs_a_turn_before_the_first_visitor(tiny_llama):
    """Regression (load test on a new server): the first visitor's turn built the guide's view of the tokenizer
    (then 49,152 decodes) and ran the kernels and tools for the first time (first text 0.47 s, later turns 0.06 s).
    warm_up runs a turn of its own, on a session the store never sees."""
    loaded = forced(tiny_llama)
    service = new_page(lambda: loaded).service
    assert "guide_vocab" not in loaded.__dict__
    service.warm_up()
    assert "guide_vocab" in loaded.__dict__ and len(service.store) == 0


def test_warm_up_fits_a_context_shorter_than_the_pages_default_max_length(short_llama):
    """Regression (review): the warm-up turn used the page's max_length, 2,048, and a model (or a server's slot:
    `-c 4096 -np 4` holds 1,024) with a shorter context failed its check, so app.py exited before launching."""
    short = LocalBackend(short_llama.loaded)  # (no guide vocabulary yet: another test's would pass this one)
    service = new_page(lambda: short).service
    service.warm_up()  # (raised InputError: max_length must be between 1 and 1024)
    assert "guide_vocab" in short.__dict__
