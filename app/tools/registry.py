"""Tool registry: what a tool is, how it is looked up and how a call becomes a result. A tool maps the query the model
wrote to a short text; a failure never crashes an episode, since `run_tool` returns it as `ToolResult(ok=False)`. To add
one, write `def my_tool(query: str) -> str` (raising `ToolError` for a bad query) and add a `Tool(...)` line to
`default_tools()`. Standard library only; the tools are imported lazily."""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

from app.tools.base import Tool, ToolError, ToolResult

log = logging.getLogger(__name__)


def default_tools() -> dict[str, Tool]:
    """All built-in tools by name, as a fresh dict on every call."""
    from app.tools import functions
    from app.tools.calculator import calculate, sum_in
    from app.tools.search import GUIDED_QUERY_CHARS, first_entry, search_tool, term_in

    tools = [
        Tool("Calculator", "evaluates arithmetic like 12*(3+4) or sqrt(2)", calculate,
             ability="a calculator", action="calculate", claims=sum_in, typed=functions.calculator),
        Tool("Search", "searches the Jargon File (hacker slang) for a word or phrase", search_tool, first_entry,
             ability="the Jargon File", action="look up", claims=term_in, max_query=GUIDED_QUERY_CHARS,
             typed=functions.search),
    ]
    return {tool.name: tool for tool in tools}


def find_tool(tools: Mapping[str, Tool], name: str) -> Tool | None:
    """Case-insensitive lookup by name; None when there is no such tool."""
    if not isinstance(name, str):
        return None
    wanted = name.strip().lower()
    for key, tool in tools.items():
        if key.lower() == wanted:
            return tool
    return None


def get_tools(names: Iterable[str] | None = None) -> dict[str, Tool]:
    """Select built-in tools by name, case-insensitively (None: all); ValueError names an unknown one and the available
    ones."""
    available = default_tools()
    if names is None:
        return available
    if isinstance(names, str):
        names = [names]
    selected: dict[str, Tool] = {}
    for name in names:
        tool = find_tool(available, name)
        if tool is None:
            raise ValueError(f"unknown tool {name!r} (available: {', '.join(available)})")
        selected[tool.name] = tool
    return selected


def run_tool(tools: Mapping[str, Tool], name: str, query: str) -> ToolResult:
    """Run one tool call; every outcome, including a crash inside the tool, is a ToolResult. A query that belongs
    to another tool is an error naming it (ToolError.hint), never passed on: the model reads it and chooses."""
    tool = find_tool(tools, name)
    if tool is None:
        return ToolResult(f"unknown tool {name} (available: {', '.join(tools)})", ok=False)
    try:
        text = tool.function(query)
    except ToolError as exc:
        hint = f"; {exc.hint[1]}" if exc.hint and find_tool(tools, exc.hint[0]) else ""
        return ToolResult(f"error: {exc}{hint}", ok=False)
    except Exception as exc:  # a tool failure is a result the model reads, never a crash
        log.exception("tool %s failed on %r", tool.name, query)
        return ToolResult(f"error: {tool.name} failed ({type(exc).__name__}: {exc})", ok=False)
    return ToolResult(text if isinstance(text, str) else str(text), ok=True)
