"""Guided answers: one declared grammar per model segment, plus the text the engine writes itself.

The guide of a segment says what the model may write there, in GBNF (the format llama.cpp's server, vLLM's
structured outputs and llguidance all accept), built from the protocol's markers, the session's tools and the
last tool output:
- a reply is the answer line (`Result = ...`, one line, ended by `<submit>` or EOS) or one tool call
  (`<request><Tool>input<call>`, the tool one of the session's, the input one line of at most the tool's
  `max_query` characters: where the model ends that line, or reaches the bound, `<call>` follows);
- after a tool's output the answer line begins with what the prompt's examples copy from it (the Calculator's
  number, with no more digits after it; a look-up's first entry; a failed call's error);
- a question a tool claims (`Tool.claims`) opens with that call, written by the engine (`opening`).
Every token the guide decides is recorded as such (app.episode.Provenance) and shown.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from app.episode import Segment
from app.protocol import ANSWER_PREFIX, CALL, REQUEST, RESPONSE, SUBMIT
from app.tools.base import Tool
from app.tools.registry import find_tool

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")  # the Calculator's output (app.tools.numbers.format_number)


@dataclass(frozen=True)
class Guide:
    """One segment's guide: `grammar` (GBNF) of what the model may write after `opening`, the text the engine
    writes first; an opening that ends with `<call>` is the whole segment."""

    grammar: str
    opening: str = ""


def literal(text: str) -> str:
    """`text` as a GBNF string literal: quotes, backslashes and control characters escaped; other characters,
    non-ASCII included, as they are (UTF-8)."""
    out = []
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif char == "\n":
            out.append("\\n")
        elif char == "\r":
            out.append("\\r")
        elif char == "\t":
            out.append("\\t")
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\x{ord(char):02X}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


# Free text on a line: no newline and no tag (a `<` only before a space, a digit or `=`: "3 < 5", "x <= 2").
# Named rules of character classes, which grammar engines compile into fast lexemes.
_RULES = f"""text ::= ([^\\n<] | "<" [ 0-9=])*
end ::= {literal(SUBMIT)}?"""


def build_guide(tools: Mapping[str, int], owed: str | None = None, calls: bool = True,
                after_tool: bool = False, opening: str = "") -> Guide:
    """The guide of one model segment. `tools`: the session's tool names and the longest input each takes;
    `owed`: the tool output the answer line begins with (after a tool); `calls`: whether another call may run
    (max_turns); `after_tool`: the segment follows a tool's `<response>` (its reply may start on a new line)."""
    names = list(tools) if calls else []
    replies = ["answer"] + (["call"] if names else [])
    lines = [f"root ::= {literal(chr(10)) + '? ' if after_tool else ''}({' | '.join(replies)})"]
    if owed is None:
        lines.append(f"answer ::= {literal(ANSWER_PREFIX)} text end")
    elif NUMBER.fullmatch(owed):  # no more of the number after it ("943" is not "9431" or "943.5")
        lines.append(f"answer ::= {literal(ANSWER_PREFIX + ' ' + owed)} after")
        lines.append('after ::= end | [^0-9.,eE\\n<] text end | [.,] ([^0-9\\n<] text)? end')
    else:
        lines.append(f"answer ::= {literal(ANSWER_PREFIX + ' ' + owed)} text end")
    if names:  # (a newline the model writes in the input ends it: `<call>` follows)
        calls_ = " | ".join(f"{literal(REQUEST + '<' + name + '>')} input{i}" for i, name in enumerate(names))
        lines.append(f"call ::= ({calls_}) {literal(chr(10))}? {literal(CALL)}")
        lines += [f"input{i} ::= [^\\n<]{{1,{max(1, tools[name])}}}" for i, name in enumerate(names)]
    return Guide("\n".join(lines) + "\n" + _RULES + "\n", opening)


def claimed_guide(call: str) -> Guide:
    """The guide of a reply whose call a tool claims: the engine writes the whole call."""
    return Guide("root ::= " + literal(""), call)


def owed_text(output: str, ok: bool, answer) -> str | None:
    """What the answer line begins with after a tool's `output`: the tool's `answer` of a result, an error's first
    line; None where there is nothing to copy."""
    line = (answer(output) if ok else output).split("\n", 1)[0].strip()
    return line or None


def segment_guide(tools: Mapping[str, Tool], claimed: str | None, after: Segment | None, calls: bool) -> Guide:
    """A model segment's guide: the claimed call, else the grammar of a reply after the question or after `after`,
    a tool segment; `calls`: whether another call may run (max_turns)."""
    if claimed is not None:
        return claimed_guide(claimed)
    owed = None
    if after is not None:
        output = after.text.removeprefix(CALL)  # (the engine's own <call>, where it closed the request)
        output = output[: output.rfind(RESPONSE)] if RESPONSE in output else output
        tool = find_tool(tools, after.ran or after.tool or "")
        owed = owed_text(output, after.ok, tool.answer if tool is not None else str)
    limits = {name: tool.max_query for name, tool in tools.items()}
    return build_guide(limits, owed, calls=calls, after_tool=after is not None)
