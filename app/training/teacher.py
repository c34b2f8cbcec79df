"""Stage 1's teacher: the engine's own guide, told the call each generated question needs. The guide alone claims
only the calls it can read off a question ("What is 41 * 23?"); a word problem, a power or a square root it leaves
to the model, which gets most of them wrong, so a graded set of its episodes would hardly teach them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from app.tools.base import Tool
from app.training.questions import Question


def teacher_tools(tools: Mapping[str, Tool], questions: Iterable[Question]) -> dict[str, Tool]:
    """`tools`, each claiming exactly the generated questions whose call it is, with the query the generator wrote
    (and nothing else: a question without a call is left to the model)."""
    queries: dict[str, dict[str, str]] = {name: {} for name in tools}
    for question in questions:
        if question.call is not None:
            tool, query = question.call
            if tool not in queries:
                raise ValueError(f"a question calls {tool!r}, which is not among the tools {sorted(tools)}")
            queries[tool][question.text.strip()] = query
    return {name: replace(tool, claims=queries[name].get) for name, tool in tools.items()}
