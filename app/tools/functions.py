"""The tools as typed Python functions with Google-style docstrings: what a chat template lists and a call names.

`transformers.utils.get_json_schema` reads each one's type hints and docstring into the JSON schema that the chat
protocol (app.protocols.chat) renders into the prompt, validates calls against and builds the guide's grammar from.
Each function takes the one argument its tool's query is, and returns the same text the tool does.
"""

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
