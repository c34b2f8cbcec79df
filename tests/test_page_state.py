"""The page's own record of a visitor (components/page_state.py): its messages' lanes, the notes' words for what
Service.prepare did, and its life beside the serving entry (freed with it by unload and the idle sweep)."""

from __future__ import annotations

import gc
import types

import pytest

from app.serving import ChatChange, Service, SessionStore
from app.serving.sessions import MB
from components.page import Page
from components.page_state import PageState, PageStates, new_chat_notes


def request(key: str = "page-1"):
    return types.SimpleNamespace(session_hash=key)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_sent_message_waits_until_its_turn_starts_and_is_unanswered_until_it_ends():
    state = PageState()
    first, blank, second = state.send("first"), state.send("   "), state.send("second")
    assert len({first, blank, second}) == 3  # every send a number of its own
    assert state.waiting_messages() == ["first", "second"] and state.unanswered == {first, second}  # (blank: neither)
    state.started(first)
    assert state.waiting_messages() == ["second"] and state.unanswered_besides() == 2
    assert state.unanswered_besides(second) == 1
    state.answered(first)
    assert state.unanswered == {second}


def test_messages_a_stop_kept_go_back_together_until_the_next_send():
    state = PageState()
    a, b = state.send("a"), state.send("b")
    assert state.not_sent(a, "a") == ["a"] and state.not_sent(b, "b") == ["a", "b"]
    assert not state.waiting and not state.unanswered
    state.send("c")  # the box is the visitor's again
    assert state.unsent == []


def test_the_state_refuses_a_waiting_message_that_is_not_unanswered():
    state = PageState()
    state.waiting[7] = "forged"  # (only the methods change it; this is what they keep from happening)
    with pytest.raises(RuntimeError, match=r"messages \[7\] wait for a turn but are not unanswered"):
        state.send("next")


def test_compare_runs_are_counted_until_each_ends_once():
    state = PageState()
    one, two = state.compare_started(), state.compare_started()
    assert len(state.comparing) == 2
    state.compare_ended(one)
    state.compare_ended(one)  # (a run's end and its `finally` both say so)
    assert state.comparing == {two}


@pytest.mark.parametrize("change, tools, notes", [
    (ChatChange.KEPT, ("Calculator",), None),
    (ChatChange.STARTED, ("Calculator",), []),
    (ChatChange.TOOLS_CHANGED, ("Calculator",),
     ["Tools changed (now: Calculator), so the system prompt changed: started a new chat."]),
    (ChatChange.TOOLS_CHANGED, (), ["Tools changed (now: none), so the system prompt changed: started a new chat."]),
    (ChatChange.PROMPT_CHANGED, ("Calculator", "Search"), ["System prompt changed: started a new chat."]),
])
def test_the_page_words_what_prepare_did_to_the_chat(change, tools, notes):
    assert new_chat_notes(change, tools) == notes
    state = PageState(notes=["before"])
    state.chat_changed(change, tools)
    assert state.notes == (["before"] if notes is None else notes)
    state.new_chat()
    assert state.notes == []


def test_a_page_state_lives_as_long_as_its_entry():
    store, pages = SessionStore(budget_bytes=MB, idle_timeout_s=60), PageStates()
    state = pages.of(store.get("a"))
    assert pages.of(store.get("a")) is state and pages.peek(store.peek("a")) is state and len(pages) == 1
    assert pages.peek(store.get("b")) is None and pages.peek(None) is None  # (peek creates nothing)
    store.reset("a")  # a new chat keeps the entry, and so the page's record
    assert pages.peek(store.peek("a")) is state
    del state
    store.remove("a")
    gc.collect()
    assert len(pages) == 0


@pytest.mark.parametrize("how", ["closed", "swept"])
def test_a_page_closed_or_swept_frees_its_page_state(how):
    """The page's record goes with the serving entry, by the same unload or idle sweep: no per-visitor state is
    left behind in components/."""
    clock = Clock()
    page = Page(Service(loader=lambda: None, budget_bytes=MB, idle_timeout_s=60, clock=clock))
    page.chat.submit("hello", [], request("gone"))
    page.chat.submit("hi", [], request("stays"))
    assert page.page_state("gone").waiting_messages() == ["hello"] and len(page.pages) == 2
    if how == "closed":
        page.chat.unload(request("gone"))
    else:
        clock.now += 40
        page.service.store.get("stays")  # used again
        clock.now += 30
        assert page.service.store.sweep() == ["gone"]  # idle for 70 s, past the 60 s timeout
    gc.collect()
    assert len(page.pages) == 1 and page.page_state("stays").waiting_messages() == ["hi"]
    assert page.page_state("gone") is None
