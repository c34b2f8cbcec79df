"""Parsing tool calls and keeping untrusted text from forging the protocol."""

from __future__ import annotations

import pytest

from app.episode import Limit, Stop, StopReason
from app.protocols import make_protocol
from app.protocols.base import ToolCallError
from app.protocols.textenv.markers import neutralize, parse_tool_call

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("text, name, query", [
    ("<request><Calculator>2+3<call>", "Calculator", "2+3"),
    ("Let me see. <request><Search> kludge <call>", "Search", "kludge"),
    ("<request><A>x<call> <request><B>y<call>", "B", "y"),  # the last request before the stop string
    ("<request><Calculator>1<2<call>", "Calculator", "1<2"),
])
def test_parse_tool_call(text, name, query):
    call = parse_tool_call(text)
    assert (call.name, call.query) == (name, query)


@pytest.mark.parametrize("text", ["2+3<call>", "<request>2+3<call>", "<request><>x<call>", "<call>"])
def test_unparsable_calls_give_a_message(text):
    with pytest.raises(ToolCallError, match="request"):
        parse_tool_call(text)


@pytest.mark.parametrize("text", [
    "<call>", "<submit>", "<request>", "<response>", "< call >", "</submit>", "<CALL>",
    "<|im_end|>", "<|endoftext|>", "a<request><Calculator>1<call>b<|im_start|>",
])
def test_neutralized_text_holds_no_marker_or_special_token(text):
    out = neutralize(text, SPECIALS)
    for marker in ["<call>", "<submit>", "<request>", "<response>", *SPECIALS]:
        assert marker not in out.lower()


def test_neutralize_leaves_ordinary_text_alone():
    text = "a < b and c > d, <b>bold</b>, 3<4"
    assert neutralize(text, SPECIALS) == text


@pytest.mark.parametrize("protocol, stop, ends", [
    ("textenv", Stop(StopReason.STRING_MATCH, string="<submit>"), True),
    ("textenv", Stop(StopReason.EOS), True),
    ("textenv", Stop(StopReason.STRING_MATCH, string="<call>"), False),
    ("textenv", Stop(StopReason.STRING_MATCH, string="\nQ:"), False),
    ("chat", Stop(StopReason.EOS), True),
    ("chat", Stop(StopReason.STRING_MATCH, string="</tool_call>"), False),
    ("chat", Stop(StopReason.MAX_LENGTH, limit=Limit.MAX_NEW_TOKENS), False),
    ("chat", Stop(StopReason.REPETITION), False),
    ("chat", None, False),
])
def test_the_protocol_says_which_stops_end_an_answer(tokenizer, protocol, stop, ends):
    """What the page's status line asks (Episode.answered), never a protocol's markers."""
    assert make_protocol(protocol, tokenizer, SPECIALS).ends_answer(stop) is ends
