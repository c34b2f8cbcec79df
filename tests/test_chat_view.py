"""The chat's renderers (components/chat.py) and the status line's words (components/status.py): engine data
to Gradio values, on hand-built segments and episodes."""

from __future__ import annotations

import dataclasses

import gradio as gr
import pytest

from app.decoding.stops import Limit, Stop, StopReason
from app.episode import Episode, Provenance, Segment
from components.chat import (chat_messages, code, escape_text, episode_messages, model_message, pending_model_message,
                             stop_text, tool_message)
from tests.support.page import CALL_STOP, SUBMIT_STOP, calculator_episode


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


def test_a_turn_the_model_did_not_end_says_why_on_the_status_line():
    """Regression (Chromium, Calculator off): "What is 3 - 7?" looped to the repetition stop with no answer, and
    the status line said a plain "done"."""
    from app.decoding.stops import Limit
    from components.chat import ending_note
    from components.status import done_status

    def ended(stop: Stop, unrun: bool = False, answered: bool = False) -> str | None:
        episode = Episode("q", 0, 1, use_cache=True, unrun_call=unrun, answered=answered)
        episode.segments = [Segment("model", "x", 0, 1, stop=stop)]
        return ending_note(episode)

    assert ended(Stop(StopReason.REPETITION)) == "ended by repetition"
    assert ended(Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS)) == "ended by max_length (max_new_tokens)"
    assert ended(Stop(StopReason.STRING_MATCH, string="\nQ:")) == "ended by string match \\nQ:"
    assert ended(Stop(StopReason.STRING_MATCH, string="<call>"), unrun=True) == (
        "ended by max_turns: the last tool call was not run")
    for clean in (Stop(StopReason.STRING_MATCH, string="<submit>"), Stop(StopReason.EOS)):  # (the engine says so:
        assert ended(clean, answered=True) is None  # Protocol.ends_answer, tests/test_protocol.py)
    assert ended(Stop(StopReason.CANCELLED)) is None
    assert ending_note(None) is None
    assert done_status(1, ended="ended by repetition") == "done · ended by repetition · 1 more message to answer"
    assert done_status(0) == "done"
    assert done_status(0, protocol="chat") == "done · protocol chat"
    assert done_status(2, 1, ended="ended by EOS", protocol="textenv") == (
        "done · ended by EOS · protocol textenv · 2 more messages to answer · compare still running")
