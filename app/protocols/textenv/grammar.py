"""textenv's guide: a reply is the answer line (`Result = ...`, ended by `<submit>` or EOS) or one call
`<request><Tool>input<call>` of a session's tool, the input one line of at most the tool's `max_query` characters; after
a tool's output the answer begins with what the examples copy from it."""

from __future__ import annotations

from collections.abc import Mapping

from app.decoding.guide import ANSWER_PREFIX, NUMBER, TEXT_RULE, Guide, claimed_guide, literal, owed_text
from app.episode import Segment
from app.protocols.textenv.markers import CALL, REQUEST, RESPONSE, SUBMIT
from app.tools.base import Tool
from app.tools.registry import find_tool

_RULES = f"""{TEXT_RULE}
end ::= {literal(SUBMIT)}?"""


def build_guide(tools: Mapping[str, int], owed: str | None = None, calls: bool = True,
                after_tool: bool = False) -> Guide:
    """The guide of one model segment. `tools`: the session's tool names and the longest input each takes;
    `owed`: the tool output the answer line begins with (after a tool); `calls`: whether another call may run
    (max_turns); `after_tool`: the segment follows a tool's `<response>` (its reply may start on a new line)."""
    names = list(tools) if calls else []
    replies = ["answer"] + (["call"] if names else [])
    lines = [f"root ::= {literal(chr(10)) + '? ' if after_tool else ''}({' | '.join(replies)})"]
    if owed is None:
        lines.append(f"answer ::= {literal(ANSWER_PREFIX)} text end")
    elif NUMBER.fullmatch(owed):  # no more of the number after it ("943" is not "9431" or "943.5")
        lines.append(f"answer ::= {literal(f'{ANSWER_PREFIX} {owed}')} after")
        lines.append('after ::= end | [^0-9.,eE\\n<] text end | [.,] ([^0-9\\n<] text)? end')
    else:
        lines.append(f"answer ::= {literal(f'{ANSWER_PREFIX} {owed}')} text end")
    if names:  # (a newline the model writes in the input ends it: `<call>` follows)
        calls_ = " | ".join(f"{literal(REQUEST + '<' + name + '>')} input{i}" for i, name in enumerate(names))
        lines.append(f"call ::= ({calls_}) {literal(chr(10))}? {literal(CALL)}")
        lines += [f"input{i} ::= [^\\n<]{{1,{max(1, tools[name])}}}" for i, name in enumerate(names)]
    return Guide("\n".join(lines) + "\n" + _RULES + "\n")


def segment_guide(tools: Mapping[str, Tool], claimed: str | None, after: Segment | None, calls: bool) -> Guide:
    """A model segment's guide: the claimed call, else the grammar of a reply after the question or after `after`,
    a tool segment; `calls`: whether another call may run (max_turns)."""
    if claimed is not None:
        return claimed_guide(claimed)
    owed = None
    if after is not None:
        output = after.text.removeprefix(CALL)  # (the engine's own <call>, where it closed the request)
        output = output[: output.rfind(RESPONSE)] if RESPONSE in output else output
        tool = find_tool(tools, after.tool or "")
        owed = owed_text(output, after.ok, tool.answer if tool is not None else str)
    limits = {name: tool.max_query for name, tool in tools.items()}
    return build_guide(limits, owed, calls=calls, after_tool=after is not None)
