"""The programmatic API's handlers (components/api.py: /ask, /chat) on a tiny forced model, without a server."""

from __future__ import annotations

import gradio as gr
import pytest

from tests.support.page import ALONE, CLAIMED, make_page, request, writing_page
from tests.support.page import calculator_plan, one_token_per_pass  # noqa: F401  (fixtures; the second autouse)


def test_api_ask_returns_the_episode_json(tiny_llama, calculator_plan):
    page, _ = make_page(tiny_llama, calculator_plan)
    result = page.api.ask("What is 41 * 23?", {"max_new_tokens": 16})
    assert set(result) == {"question", "answer", "backend", "protocol", "total_tokens", "cache", "guide", "segments"}
    assert result["protocol"] == "textenv"  # (auto: the bundled tokenizer's own template renders no tools)
    assert result["answer"] == "Result = 943"
    assert [s["kind"] for s in result["segments"]] == ["model", "tool", "model"]
    assert result["segments"][0]["stop_string"] == "<call>" and result["segments"][1]["tool"] == "Calculator"
    with pytest.raises(gr.Error, match="unknown setting"):
        page.api.ask("x", {"nope": 1})
    with pytest.raises(gr.Error, match="empty"):
        page.api.ask("", None)
    with pytest.raises(gr.Error, match="unknown tool"):
        page.api.ask("x", {"tools": ["Shell"]})
    with pytest.raises(gr.Error, match="settings must be a JSON object"):
        page.api.ask("x", [1, 2])
    with pytest.raises(gr.Error, match="must be text"):
        page.api.ask(None, None)
    assert page.service.engine_for(["calculator"]) is page.service.engine_for(["Calculator"])  # names as the CLI takes them


def test_api_chat_streams_growing_text(tiny_llama, calculator_plan):
    page, _ = make_page(tiny_llama, calculator_plan)
    chunks = list(page.api.chat("What is 41 * 23?", None, request("client")))
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1] == "<request><Calculator>41 * 23<call>943<response>Result = 943<submit>"
    assert len(page.service.store.peek("client").session.episodes) == 1


def test_api_chat_rejects_an_empty_message_before_switching_tools(tiny_llama, calculator_plan):
    """Regression: an empty /chat message with another tool list started a new chat, then failed: history lost."""
    page, _ = make_page(tiny_llama, calculator_plan)
    list(page.api.chat("What is 41 * 23?", None, request("client")))
    session = page.service.store.peek("client").session
    with pytest.raises(gr.Error, match="empty"):
        list(page.api.chat("   ", {"tools": ["Calculator"]}, request("client")))
    entry = page.service.store.peek("client")
    assert entry.session is session and len(session.episodes) == 1 and page.page_state("client").notes == []


@pytest.mark.parametrize("temperature", [1e-300, 0.001, float("nan"), float("inf"), -0.5])
def test_temperatures_that_would_break_sampling_are_input_errors(tiny_llama, temperature):
    """Regression: 1e-300 passed the range check, then logits / temperature overflowed into NaN probabilities."""
    page, _ = make_page(tiny_llama)
    with pytest.raises(gr.Error, match="temperature must be 0"):
        page.api.ask("hi", {"temperature": temperature, "max_new_tokens": 4})


def test_api_failures_that_are_not_user_mistakes_are_named(tiny_llama):
    page, loaded = make_page(tiny_llama)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    loaded.model.forward = broken
    for call in (lambda: page.api.ask("hi"), lambda: list(page.api.chat("hi", None, request("client")))):
        with pytest.raises(gr.Error, match=r"internal error \(RuntimeError: out of memory\)"):
            call()


def test_api_takes_a_custom_system_prompt(tiny_llama):
    page, _ = make_page(tiny_llama)
    custom = "You are Custom Bot.\n{tools}\n"
    values = {"max_new_tokens": 2, "max_turns": 0}
    default = page.api.ask("hi", values)
    mine = page.api.ask("hi", {**values, "prompt": custom})
    engine = page.service.engine_for(None)
    difference = engine.new_session(custom).prompt_tokens - engine.new_session().prompt_tokens
    assert mine["total_tokens"] - default["total_tokens"] == difference < 0
    list(page.api.chat("hi", {**values, "prompt": custom}, request("client")))
    entry = page.service.store.peek("client")
    assert page.service.decode(entry.session.cache.ids).startswith("You are Custom Bot.\n- Calculator:")
    list(page.api.chat("again", values, request("client")))  # back to the default prompt: a new chat
    assert page.page_state("client").notes == ["System prompt changed: started a new chat."]
    assert len(entry.session.episodes) == 1


def test_api_user_mistakes_leave_no_traceback_in_the_log(tiny_llama, caplog):
    """Regression: every bad API value printed Gradio's full traceback, burying the real failures."""
    page, _ = make_page(tiny_llama)
    with pytest.raises(gr.Error) as caught:
        page.api.ask("hi", {"tools": ["Nope"]})
    assert caught.value.print_exception is False and "unknown tool" in str(caught.value)
    assert not [r for r in caplog.records if r.exc_info]


def test_the_apis_guide_setting_decides_the_episode(tiny_llama):
    results = {guide: writing_page(tiny_llama, ALONE).api.ask(CLAIMED, {"guide": guide, "max_new_tokens": 24})
               for guide in (True, False)}
    on, off = results[True], results[False]
    assert on["guide"] is True and off["guide"] is False
    assert on["segments"][0]["guided"]["forced_tokens"] > 0 and on["answer"].startswith("Result = 8")
    assert off["answer"] == "Result = 7" and all(s["guided"]["forced_tokens"] == 0 for s in off["segments"]
                                                      if s["kind"] == "model")
    with pytest.raises(gr.Error, match="setting guide must be true or false, got 'off'"):
        writing_page(tiny_llama, ALONE).api.ask(CLAIMED, {"guide": "off"})
