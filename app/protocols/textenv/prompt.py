"""textenv's few-shot system prompt: a template whose tool list and example answers come from the tools.

An example line that ends right after `<call>` is filled in with what the tool really returns and an answer copied from
it, so the examples stay true when a tool changes; examples of tools the session lacks are left out. `{tools}` becomes
one line per tool, and `{abilities}` / `{actions}` name only the session's tools (app.protocols.naming). Custom prompts
follow the same rules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from app.decoding.guide import ANSWER_PREFIX
from app.paths import ASSETS
from app.protocols.naming import PromptError, name_tools
from app.protocols.textenv.markers import CALL, REQUEST, RESPONSE, SUBMIT, neutralize
from app.tools.base import Tool
from app.tools.registry import find_tool, run_tool

# `<request><Tool>query<call>` closing its line: the output is to be filled in.
_OPEN_CALL = re.compile(rf"^{re.escape(REQUEST)}<([^<>\n]{{1,64}})>([^\n]*?){re.escape(CALL)}[ \t]*$", re.MULTILINE)


def default_prompt_template() -> str:
    return (ASSETS / "system_prompt.txt").read_text(encoding="utf-8")


def render_prompt(template: str, tools: Mapping[str, Tool]) -> str:
    """The prompt the model reads: `{abilities}` and `{actions}` named, examples filled in by their tools (or left
    out), `{tools}` listed."""
    listing = "\n".join(f"- {t.name}: {t.description}" for t in tools.values())
    text = "\n\n".join(filter(None, (fill_examples(name_tools(block, tools), tools)
                                      for block in template.split("\n\n"))))
    text = text.replace("{tools}", listing)
    return text.rstrip("\n") + "\n\n" if text.strip() else text  # the first question starts on its own line


def fill_examples(block: str, tools: Mapping[str, Tool]) -> str | None:
    """One paragraph of a template with its open tool calls answered; None when it calls a tool not in `tools`."""
    pieces, last = [], 0
    for call in _OPEN_CALL.finditer(block):
        tool = find_tool(tools, call[1])
        if tool is None:
            return None
        result = run_tool(tools, tool.name, call[2].strip())
        if not result.ok:
            raise PromptError(f"the prompt's example {call[0].strip()} failed: {result.text}")
        output = neutralize(result.text)  # as in a session: tool output cannot forge a marker
        answer = f"\n{ANSWER_PREFIX} {tool.answer(output)}{SUBMIT}"
        pieces += [block[last:call.end()].rstrip(" \t"), output, RESPONSE, answer]
        last = call.end()
    return "".join(pieces) + block[last:]
