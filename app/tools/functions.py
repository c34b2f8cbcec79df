"""The tools as typed Python functions with Google-style docstrings, which `get_json_schema` reads into the JSON schema
the chat protocol lists, validates calls against and guides by. Each takes its tool's one argument and returns the
tool's text; their docstrings are the schema, so they are written for the model."""

from __future__ import annotations


def calculator(expression: str) -> str:
    """Evaluates arithmetic exactly.

    Args:
        expression: The arithmetic to evaluate, like 12*(3+4) or sqrt(2).
    """
    from app.tools.calculator import calculate

    return calculate(expression)


def search(term: str) -> str:
    """Searches the Jargon File (hacker slang) for a word or phrase and returns the opening of its entry.

    Args:
        term: The word or phrase to look up.
    """
    from app.tools.search import search_tool

    return search_tool(term)
