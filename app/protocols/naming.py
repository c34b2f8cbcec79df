"""What both protocols' prompts share: `{abilities}` and `{actions}` naming the session's tools in a greeting, and
the error of an example a tool rejects."""

from __future__ import annotations

from collections.abc import Mapping

from app.tools.base import Tool


class PromptError(ValueError):
    """A template's example cannot be filled in (its tool rejected the query)."""


def name_tools(block: str, tools: Mapping[str, Tool]) -> str:
    """A paragraph with `{abilities}` and `{actions}` naming the session's tools (a tool without its own words by
    its name: a greeting that leaves out a tool `{tools}` lists would contradict the listing)."""
    abilities = [t.ability or t.name for t in tools.values()]
    actions = [t.action or f"use {t.name}" for t in tools.values()]
    return (block.replace("{abilities}", listed(abilities, "and", "no tools"))
            .replace("{actions}", listed(actions, "or", "help with")))


def listed(words: list[str], joint: str, none: str) -> str:
    """`a, b and c` (joint "and"); `none` for no words."""
    if len(words) < 2:
        return words[0] if words else none
    return f"{', '.join(words[:-1])} {joint} {words[-1]}"
