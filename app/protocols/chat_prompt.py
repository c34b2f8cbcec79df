"""The chat protocol's prompt: a system message and worked examples from an editable template (assets/chat_prompt.txt),
rendered as chat messages by the chat template.

The first paragraph is the system message (`{abilities}`, `{actions}` as in app.protocols.naming); each later one is an
example, `Q: question` then `A: answer` or `> tool: argument`, whose result the tool itself gives and whose answer is
copied from it, so the examples stay true when a tool changes. Examples of tools the session lacks are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import lru_cache

from app.paths import ASSETS
from app.decoding.guide import ANSWER_PREFIX
from app.protocols.naming import PromptError, name_tools
from app.tools.base import Tool
from app.tools.registry import run_tool


def default_chat_template() -> str:
    return (ASSETS / "chat_prompt.txt").read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def _schema(function: Callable) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(function)


def tool_schema(tool: Tool) -> dict:
    """The tool's JSON schema (the `function` part), read from its typed function's hints and docstring."""
    if tool.typed is None:
        raise ValueError(f"tool {tool.name} has no typed function (app.tools.functions)")
    return _schema(tool.typed)["function"]


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict]:
    """The tools as a chat template takes them (`tools=`)."""
    return [_schema(tool.typed) for tool in tools.values() if tool.typed is not None]


def _by_function_name(tools: Mapping[str, Tool], name: str) -> Tool | None:
    return next((t for t in tools.values() if t.typed is not None and tool_schema(t)["name"] == name.strip()), None)


def example_messages(block: str, tools: Mapping[str, Tool], neutralize: Callable[[str], str]) -> list[dict] | None:
    """One example paragraph as chat messages; None where it calls a tool not in `tools` or is not an example."""
    lines = block.strip().split("\n")
    if len(lines) != 2 or not lines[0].startswith("Q:"):
        return None
    question = neutralize(lines[0].removeprefix("Q:").strip())
    reply = lines[1].strip()
    if reply.startswith("A:"):
        return [{"role": "user", "content": question},
                {"role": "assistant", "content": neutralize(reply.removeprefix("A:").strip())}]
    if not reply.startswith(">") or ":" not in reply:
        raise PromptError(f"an example's reply is `A: answer` or `> tool: argument`, not {reply!r}")
    name, _, argument = reply.removeprefix(">").partition(":")
    tool = _by_function_name(tools, name)
    if tool is None:
        return None
    result = run_tool(tools, tool.name, argument.strip())
    if not result.ok:
        raise PromptError(f"the prompt's example {reply} failed: {result.text}")
    schema = tool_schema(tool)
    arguments = {next(iter(schema["parameters"]["properties"])): argument.strip()}
    output = neutralize(result.text)
    return [{"role": "user", "content": question},
            {"role": "assistant", "tool_calls": [{"type": "function",
                                                  "function": {"name": schema["name"], "arguments": arguments}}]},
            {"role": "tool", "name": schema["name"], "content": output},
            {"role": "assistant", "content": f"{ANSWER_PREFIX} {tool.answer(output)}"}]


def chat_messages(template: str, tools: Mapping[str, Tool], neutralize: Callable[[str], str]) -> list[dict]:
    """The prompt template as chat messages: the system message, then the examples."""
    blocks = [b for b in template.split("\n\n") if b.strip()]
    system = [b for b in blocks if not b.lstrip().startswith("Q:")]
    messages = [{"role": "system", "content": neutralize(name_tools("\n\n".join(system), tools).strip())}]
    for block in blocks:
        if block.lstrip().startswith("Q:"):
            messages += example_messages(name_tools(block, tools), tools, neutralize) or []
    return messages


def render_chat_prompt(tokenizer, chat_template: str | None, template: str, tools: Mapping[str, Tool],
                       neutralize: Callable[[str], str]) -> str:
    """The prompt the model reads: the chat template's rendering of the tools, the system message and the examples."""
    return tokenizer.apply_chat_template(chat_messages(template, tools, neutralize), tools=tool_schemas(tools) or None,
                                         chat_template=chat_template, tokenize=False)
