"""The chat protocol's guide: a reply is an answer (one line, ended by EOS, never opening with a call's JSON) or one
call of a session's tool whose JSON follows the tool's schema, between the template's call tags; after a tool's result
the answer begins with what the examples copy from it. GBNF, with the call's JSON written from the schema here, since
llguidance's `%json` exists only in its Lark syntax."""

from __future__ import annotations

import json
from collections.abc import Mapping

from app.decoding.guide import ANSWER_PREFIX, NUMBER, TEXT_RULE, Guide, literal, owed_text
from app.episode import Segment
from app.protocols.chat_prompt import tool_schema
from app.protocols.chat_template import CallSyntax
from app.tools.base import Tool
from app.tools.registry import find_tool



def call_rule(index: int, tool: Tool) -> list[str]:
    """The JSON of one call of `tool`: `{"name": ..., "arguments": {"<argument>": "<string>"}}`, as json.dumps
    writes it (the template's own spacing)."""
    schema = tool_schema(tool)
    argument = next(iter(schema["parameters"]["properties"]))
    head = json.dumps({"name": schema["name"], "arguments": {argument: ""}})[:-4]  # up to the value's opening quote
    return [f"tool{index} ::= {literal(head)} {literal(chr(34))} value{index} {literal(chr(34) + '}}')}",
            f"value{index} ::= [^\"\\\\\\n<]{{1,{max(1, tool.max_query)}}}"]


def chat_guide(tools: Mapping[str, Tool], syntax: CallSyntax, after: Segment | None, calls: bool) -> Guide:
    """One model segment's guide; `calls`: whether another call may run (max_turns)."""
    typed = [tool for tool in tools.values() if tool.typed is not None] if calls else []
    lines = [f"root ::= {'answer | call' if typed else 'answer'}"]
    owed = None
    if after is not None and after.result is not None:
        tool = find_tool(tools, after.tool or "")
        owed = owed_text(after.result, after.ok, tool.answer if tool is not None else str)
    if owed is None:
        lines.append('answer ::= [^\\n< {[] text')  # (not `{` or `[`: a call's JSON outside its tags)
    elif NUMBER.fullmatch(owed):  # no more of the number after it ("943" is not "9431" or "943.5")
        lines.append(f"answer ::= {literal(f'{ANSWER_PREFIX} {owed}')} ([^0-9.,eE\\n<] text | [.,] ([^0-9\\n<] text)?)?")
    else:
        lines.append(f"answer ::= {literal(f'{ANSWER_PREFIX} {owed}')} text")
    if typed:
        alternatives = " | ".join(f"tool{i}" for i in range(len(typed)))
        lines.append(f"call ::= {literal(syntax.opening)} ({alternatives}) {literal(syntax.between + syntax.tag)}")
        for i, tool in enumerate(typed):
            lines += call_rule(i, tool)
    return Guide("\n".join(lines) + "\n" + TEXT_RULE + "\n")
