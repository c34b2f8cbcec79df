"""textenv's markers (from TRL's TextEnvironment), its call parser, and keeping untrusted text out of it. The model
writes `<request><ToolName>query<call>`; generation stops at `<call>`, the tool's output plus `<response>` is appended,
and generation resumes until `<submit>`, EOS or the length budget."""

from __future__ import annotations

import re

from app.protocols.base import ToolCall, ToolCallError

REQUEST, CALL, RESPONSE, SUBMIT = "<request>", "<call>", "<response>", "<submit>"
QUESTION_PREFIX = "Q: "  # opens a question's line, in the prompt's examples and in each turn
NEXT_QUESTION = "\nQ:"  # the model writing the few-shot format's next example: its answer is over
# RESPONSE is the tools' marker: a model that writes it stops there rather than invent the tool's output.
STOP_STRINGS = (CALL, SUBMIT, NEXT_QUESTION, RESPONSE)
# Stop strings dropped with the blank space before them (CALL and SUBMIT are kept: the parser reads them).
CUT_STOPS = frozenset({NEXT_QUESTION, RESPONSE})

# Markers in any spacing or case: `< call >`, `</submit>`, `<CALL>`.
_MARKER = re.compile(r"<\s*/?\s*(request|call|response|submit)\s*>", re.IGNORECASE)
_TOOL_CALL = re.compile(r"\s*<([^<>\n]{1,64})>(.*)\Z", re.DOTALL)


def parse_tool_call(segment_text: str) -> ToolCall:
    """Find the request in one segment's generated text (never in earlier text, so tool output cannot forge one)."""
    end = segment_text.rfind(CALL)
    body = segment_text[:end] if end >= 0 else segment_text
    start = body.rfind(REQUEST)
    if start < 0:
        raise ToolCallError(f"no {REQUEST} before {CALL}; write {REQUEST}<ToolName>query{CALL}")
    match = _TOOL_CALL.match(body[start + len(REQUEST):])
    if not match:
        raise ToolCallError(f"expected {REQUEST}<ToolName>query{CALL}")
    return ToolCall(name=match[1].strip(), query=match[2].strip())


def calls_tool(stop_string: str | None, segment_text: str) -> bool:
    """Whether a segment that stopped at `stop_string` asks for a tool: it ended with `<call>`, or wrote `<response>`
    right after a request on its last line (the engine then adds the `<call>`)."""
    if stop_string == CALL:
        return True
    if stop_string != RESPONSE:
        return False
    start = segment_text.rfind(REQUEST)
    request = segment_text[start + len(REQUEST):]
    return start >= 0 and "\n" not in request and _TOOL_CALL.match(request) is not None


def neutralize(text: str, special_tokens: list[str] | tuple[str, ...] = ()) -> str:
    """Make untrusted text (user messages, tool output) unable to end a segment or forge a marker: marker and
    special-token angle brackets become the look-alikes ‹ ›."""
    text = _MARKER.sub(lambda m: f"‹{m[1]}›", text)
    for special in special_tokens:
        if special in text:
            text = text.replace(special, special.replace("<", "‹").replace(">", "›"))
    return text
