"""The page's completion markers (#turn-marker, #batch-marker), without a browser: each finished chat turn (done,
error, stopped while queued, ended by New chat) and each Compare bumps the visitor's chat count once, in the same
update as its final status; each Batch run bumps the batch count the same way. The browser tests wait on them
(tests/ui/waits.py)."""

from __future__ import annotations

import dataclasses
import re
import types

import gradio as gr
import pytest

from app.serving import MB, Service
from components.batch_tab import BatchView
from components.chat_tab import ChatView, CompareView
from components.page import Page
from components.status import finished_marker
from tests.support.page import make_page, page_settings, plain, request

PAGE = dict(max_new_tokens=3, max_turns=4)  # (page_settings: the cache on, max_length 4096, temperature 0, both tools)


@pytest.fixture(autouse=True)
def one_token_per_pass(monkeypatch):
    """As in tests/support/page.py: one planned token per forward pass, the guide off."""
    from components import inputs

    monkeypatch.setattr(inputs, "DEFAULTS", dataclasses.replace(inputs.DEFAULTS, draft_tokens=0, guide=False))


def finished(value) -> int | None:
    """The count a marker update carries; None where the update leaves the marker as it is."""
    if value is None:
        return None
    match = re.fullmatch(r'<span data-finished="(\d+)"></span>', value)
    assert match, value
    return int(match[1])


def ends(updates: list, status: str = "status", marker: str = "turn_marker") -> list[tuple[str, int]]:
    """(status, count) of every update of one piece of work that carries the marker (the fields of the chat's and
    Compare's updates unless named: the Batch's are batch_status and batch_marker)."""
    return [(getattr(update, status), finished(getattr(update, marker))) for update in updates
            if finished(getattr(update, marker)) is not None]


def batch_ends(updates: list) -> list[tuple[str, int]]:
    return ends(updates, "batch_status", "batch_marker")


def page_turn(page: Page, submitted: dict, key: str = "page-1", **changes) -> list[ChatView]:
    """Every update of a turn the page queued (ChatTab.turn on what submit() handed over)."""
    return list(page.chat.turn(submitted, page_settings(**{**PAGE, **changes}), request(key)))


def sent(page: Page, message: str, key: str = "page-1") -> dict:
    _, submitted, _ = page.chat.submit(message, [], request(key))
    return submitted


def test_the_marker_is_an_empty_span_with_the_count():
    assert finished_marker(0) == '<span data-finished="0"></span>' and finished(finished_marker(12)) == 12


def test_every_finished_turn_bumps_the_marker_once_with_its_final_status(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    done = page_turn(page, sent(page, "hello"))
    assert ends(done) == [(done[-1].status, 1)] and plain(done[-1].status) == "done"
    assert all(out.status == "running" and finished(out.turn_marker) is None for out in done[:-1])  # (the final only)
    # errors: one found before the turn's first update, one after it
    assert ends(page_turn(page, sent(page, "   "))) == [("error: the message is empty", 2)]
    late = page_turn(page, sent(page, "x"), max_new_tokens=None)
    assert late[0].status == "running" and ends(late) == [("error: max_new_tokens is empty; enter a number", 3)]
    # stopped while queued: each not-sent message ends too, one count each
    queued = [sent(page, text) for text in ("second", "third")]
    page.chat.stop(request())
    stopped = [ends(page_turn(page, payload)) for payload in queued]
    assert stopped == [[("stopped: the message was not sent", 4)], [("stopped: 2 messages were not sent", 5)]]
    # another visitor counts their own
    assert [count for _, count in ends(page_turn(page, sent(page, "hi", "page-2"), "page-2"))] == [1]
    assert page.page_state("page-1").chat_finished.count == 5


def test_a_turn_new_chat_ended_and_a_turn_stopped_while_running_count_once_each(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    running = page.chat.turn(sent(page, "first"), page_settings(max_new_tokens=30), request())
    early = [next(running), next(running)]
    new = page.chat.new_chat(request())  # (New chat's own update leaves the marker as it is: it is no piece of work)
    assert new.turn_marker is None
    assert ends([*early, *running]) == [("new chat", 1)]
    stopping = page.chat.turn(sent(page, "go on"), page_settings(max_new_tokens=200, max_turns=0), request())
    early = [next(stopping), next(stopping)]
    page.chat.stop(request())
    assert [(plain(status), count) for status, count in ends([*early, *stopping])] == [("done", 2)]


def test_compare_counts_with_the_chat_and_batch_counts_apart(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    page_turn(page, sent(page, "hello"))  # chat count 1
    compare = list(page.chat.compare("", page_settings(**PAGE), request()))
    assert compare[0].status.startswith("running") and ends(compare) == [("done · protocol textenv", 2)]
    guide = list(page.chat.compare_guide("again", page_settings(**PAGE), request()))
    assert ends(guide) == [("done · protocol textenv", 3)] and finished(guide[-1].turn_marker) == 3
    ((status, count),) = ends(list(page.chat.compare("x", page_settings(prompt="  ", **PAGE), request())))
    assert status.startswith("error: the system prompt is empty") and count == 4
    batch = list(page.batch.run("one\ntwo", page_settings(**PAGE), request()))
    assert batch_ends(batch) == [("done · protocol textenv", 1)] and finished(batch[-1].batch_marker) == 1
    ((status, count),) = batch_ends(list(page.batch.run("", page_settings(**PAGE), request())))
    assert status.startswith("error: no questions") and count == 2
    assert page.page_state("page-1").chat_finished.count == 4  # (the batch lane's runs are not the chat's)
    assert ends(page_turn(page, sent(page, "more")))[0][1] == 5


def test_the_markers_are_in_the_page_and_in_step_with_the_handlers_updates(tiny_llama):
    """The page takes each update's fields by name: each handler's marker lands in its lane's marker, which the
    page keeps in the DOM (visible "hidden"; False would leave it out) starting at 0."""
    from components.layout import build_demo

    page = Page(Service(loader=lambda: tiny_llama, budget_bytes=512 * MB, idle_timeout_s=3600))

    def marking(view):
        """A stand-in handler whose one update sets the marker field of `view` (ChatView, CompareView, BatchView)
        alone."""
        field = "batch_marker" if view is BatchView else "turn_marker"

        def handler(settings, request, **inputs):
            yield view(**{field: finished_marker(9)})
        return handler

    page.chat.turn = marking(ChatView)
    page.chat.compare, page.chat.compare_guide = marking(CompareView), marking(CompareView)
    page.batch.run = marking(BatchView)
    demo = build_demo(page)
    markers = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None) in ("turn-marker",
                                                                                              "batch-marker")}
    assert set(markers) == {"turn-marker", "batch-marker"}
    for marker in markers.values():
        assert isinstance(marker, gr.HTML) and marker.visible == "hidden" and finished(marker.value) == 0
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    visitor = types.SimpleNamespace(session_hash="page-1")
    for name, elem_id in [("ui_turn", "turn-marker"), ("ui_submit", "turn-marker"), ("ui_compare", "turn-marker"),
                          ("ui_compare_guide", "turn-marker"), ("ui_batch", "batch-marker")]:
        outputs = by_name[name].outputs
        assert [getattr(o, "elem_id", None) for o in outputs].count(elem_id) == 1, name
        values = {c: getattr(c, "value", None) for c in by_name[name].inputs}
        assert list(by_name[name].fn(values, visitor)) == [{markers[elem_id]: finished_marker(9)}], name
