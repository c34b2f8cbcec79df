"""The page's completion markers (#turn-marker, #batch-marker), without a browser: each finished chat turn (done,
error, stopped while queued, ended by New chat) and each Compare bumps the visitor's chat count once, in the same
update as its final status; each Batch run bumps the batch count the same way. The browser tests wait on them
(tests/ui/waits.py)."""

from __future__ import annotations

import dataclasses
import re

import gradio as gr
import pytest

from app.protocols.textenv.prompt import default_prompt_template
from app.serving.sessions import MB, SessionStore
from components.handlers import ChatService
from components.status import finished_marker
from tests.support.page import make_service, plain, request

TOOLS = ["Calculator", "Search"]
PAGE = (True, 4096, 3, 4, 0, TOOLS)  # use_cache, max_length, max_new_tokens, max_turns, temperature, tools


@pytest.fixture(autouse=True)
def one_token_per_pass(monkeypatch):
    """As in tests/support/page.py: one planned token per forward pass, the guide off."""
    from components import inputs

    monkeypatch.setattr(inputs, "DEFAULTS", dataclasses.replace(inputs.DEFAULTS, draft_tokens=0, guide=False))


def finished(value) -> int | None:
    """The count a marker update carries; None where the update leaves the marker as it is."""
    if value == gr.skip():
        return None
    match = re.fullmatch(r'<span data-finished="(\d+)"></span>', value)
    assert match, value
    return int(match[1])


def ends(outputs: list[tuple], status_at: int, marker_at: int) -> list[tuple[str, int]]:
    """(status, count) of every update of one piece of work that carries the marker."""
    return [(out[status_at], finished(out[marker_at])) for out in outputs if finished(out[marker_at]) is not None]


def page_turn(service: ChatService, submitted: dict, key: str = "page-1", **changes) -> list[tuple]:
    """Every update of a turn the page queued (chat_page: chat, box, status, tokens, stats, marker, 3 charts)."""
    values = dict(zip(("use_cache", "max_length", "max_new_tokens", "max_turns", "temperature", "tools"), PAGE))
    values.update(changes)
    return list(service.chat_page(submitted, *values.values(), default_prompt_template(), request(key)))


def sent(service: ChatService, message: str, key: str = "page-1") -> dict:
    return service.submit(message, [], request(key))[1]


def test_the_marker_is_an_empty_span_with_the_count():
    assert finished_marker(0) == '<span data-finished="0"></span>' and finished(finished_marker(12)) == 12


def test_every_finished_turn_bumps_the_marker_once_with_its_final_status(tiny_llama):
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    done = page_turn(service, sent(service, "hello"))
    assert ends(done, 2, 5) == [(done[-1][2], 1)] and plain(done[-1][2]) == "done"
    assert all(out[2] == "running" and finished(out[5]) is None for out in done[:-1])  # (the final update only)
    # errors: one found before the turn's first update, one after it
    assert ends(page_turn(service, sent(service, "   ")), 2, 5) == [("error: the message is empty", 2)]
    late = page_turn(service, sent(service, "x"), max_new_tokens=None)
    assert late[0][2] == "running" and ends(late, 2, 5) == [("error: max_new_tokens is empty; enter a number", 3)]
    # stopped while queued: each not-sent message ends too, one count each
    queued = [sent(service, text) for text in ("second", "third")]
    service.stop(request())
    stopped = [ends(page_turn(service, payload), 2, 5) for payload in queued]
    assert stopped == [[("stopped: the message was not sent", 4)], [("stopped: 2 messages were not sent", 5)]]
    # another visitor counts their own
    assert [count for _, count in ends(page_turn(service, sent(service, "hi", "page-2"), "page-2"), 2, 5)] == [1]
    assert service.page_state("page-1").chat_finished.count == 5


def test_a_turn_new_chat_ended_and_a_turn_stopped_while_running_count_once_each(tiny_llama):
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    running = service.chat_page(sent(service, "first"), True, 4096, 30, 4, 0, TOOLS, default_prompt_template(),
                                request())
    early = [next(running), next(running)]
    service.new_chat(request())  # (New chat's own update leaves the marker as it is: it is no piece of work)
    assert ends([*early, *running], 2, 5) == [("new chat", 1)]
    stopping = service.chat_page(sent(service, "go on"), True, 4096, 200, 0, 0, TOOLS, default_prompt_template(),
                                 request())
    early = [next(stopping), next(stopping)]
    service.stop(request())
    assert [(plain(status), count) for status, count in ends([*early, *stopping], 2, 5)] == [("done", 2)]


def test_compare_counts_with_the_chat_and_batch_counts_apart(tiny_llama):
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    page_turn(service, sent(service, "hello"))  # chat count 1
    compare = list(service.compare("", *PAGE, default_prompt_template(), request()))
    assert compare[0][1].startswith("running") and ends(compare, 1, 2) == [("done · protocol textenv", 2)]
    guide = list(service.compare_guide("again", *PAGE, default_prompt_template(), request()))
    assert ends(guide, 1, 2) == [("done · protocol textenv", 3)] and finished(guide[-1][2]) == 3
    ((status, count),) = ends(list(service.compare("x", *PAGE, "  ", request())), 1, 2)
    assert status.startswith("error: the system prompt is empty") and count == 4
    batch = list(service.batch("one\ntwo", *PAGE, default_prompt_template(), request()))
    assert ends(batch, 2, 4) == [("done · protocol textenv", 1)] and finished(batch[-1][4]) == 1
    ((status, count),) = ends(list(service.batch("", *PAGE, default_prompt_template(), request())), 2, 4)
    assert status.startswith("error: no questions") and count == 2
    assert service.page_state("page-1").chat_finished.count == 4  # (the batch lane's runs are not the chat's)
    assert ends(page_turn(service, sent(service, "more")), 2, 5)[0][1] == 5


def test_the_markers_are_in_the_page_and_in_step_with_the_handlers_updates(tiny_llama):
    """The page hands outputs by position: each handler's marker lands in its lane's marker, which the page keeps in
    the DOM (visible "hidden"; False would leave it out) starting at 0."""
    from components.layout import build_demo

    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    demo = build_demo(service)
    markers = {b.elem_id: b for b in demo.blocks.values() if getattr(b, "elem_id", None) in ("turn-marker",
                                                                                              "batch-marker")}
    assert set(markers) == {"turn-marker", "batch-marker"}
    for marker in markers.values():
        assert isinstance(marker, gr.HTML) and marker.visible == "hidden" and finished(marker.value) == 0
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    for name, position, elem_id in [("ui_turn", 5, "turn-marker"), ("ui_submit", 5, "turn-marker"),
                                    ("ui_compare", 2, "turn-marker"), ("ui_compare_guide", 2, "turn-marker"),
                                    ("ui_batch", 4, "batch-marker")]:
        outputs = by_name[name].outputs
        assert outputs[position] is markers[elem_id], name
        assert [getattr(o, "elem_id", None) for o in outputs].count(elem_id) == 1, name
