"""Registry: lookup, selection and turning every tool outcome into a ToolResult."""

from __future__ import annotations

import logging

import pytest

from app.tools import Tool, ToolError, ToolResult, default_tools, find_tool, get_tools, run_tool


def _raise_tool_error(query: str) -> str:
    raise ToolError(f"cannot handle {query!r}")


def _crash(query: str) -> str:
    raise KeyError("boom")


TOOLS = {
    "Echo": Tool("Echo", "repeats the query", lambda q: q),
    "Picky": Tool("Picky", "rejects everything", _raise_tool_error),
    "Broken": Tool("Broken", "always crashes", _crash),
}


def test_default_tools() -> None:
    tools = default_tools()
    assert list(tools) == ["Calculator", "Search"]
    for name, tool in tools.items():
        assert tool.name == name
        assert tool.description and "\n" not in tool.description and len(tool.description) < 100
        assert callable(tool.function)
    assert default_tools() is not tools  # a fresh dict each call


def test_run_calculator() -> None:
    assert run_tool(default_tools(), "Calculator", "12*(3+4)") == ToolResult("84", ok=True)
    assert run_tool(default_tools(), "calculator", "1/0") == ToolResult("error: division by zero", ok=False)


def test_unknown_tool() -> None:
    result = run_tool(default_tools(), "Weather", "Paris")
    assert result == ToolResult("unknown tool Weather (available: Calculator, Search)", ok=False)


def test_tool_error_becomes_error_result() -> None:
    assert run_tool(TOOLS, "Picky", "x") == ToolResult("error: cannot handle 'x'", ok=False)


def test_unexpected_exception_becomes_result_not_crash(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        result = run_tool(TOOLS, "broken", "x")
    assert result == ToolResult("error: Broken failed (KeyError: 'boom')", ok=False)
    assert any(record.exc_info for record in caplog.records)


def test_success_and_case_insensitive_run() -> None:
    assert run_tool(TOOLS, "ECHO", "hi") == ToolResult("hi", ok=True)


def test_find_tool() -> None:
    assert find_tool(TOOLS, "echo") is TOOLS["Echo"]
    assert find_tool(TOOLS, " Echo ") is TOOLS["Echo"]
    assert find_tool(TOOLS, "nope") is None


def test_get_tools() -> None:
    assert list(get_tools(None)) == ["Calculator", "Search"]
    assert list(get_tools()) == ["Calculator", "Search"]
    assert list(get_tools(["calculator"])) == ["Calculator"]
    assert list(get_tools(["SEARCH", "Calculator"])) == ["Search", "Calculator"]
    assert list(get_tools("search")) == ["Search"]
    assert get_tools([]) == {}


def test_get_tools_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"unknown tool 'Weather' \(available: Calculator, Search\)"):
        get_tools(["Calculator", "Weather"])


def test_tools_package_is_import_light() -> None:
    import subprocess
    import sys

    from app.paths import ROOT

    code = (
        "import sys, app.tools, app.tools.registry, app.tools.search, app.tools.calculator; "
        "bad = [m for m in ('torch', 'transformers', 'gradio', 'numpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_hint_names_a_tool_only_where_the_session_has_it():
    """Regression (a visitor with Search unchecked): the calculator's reply to a word still said "use Search",
    a tool that session does not have."""
    word = "error: 'kludge' is words, not arithmetic"
    assert run_tool(default_tools(), "Calculator", "kludge") == ToolResult(
        word + "; to look up what a word means, use Search", ok=False)  # (the text the model has always read)
    assert run_tool(get_tools(["Calculator"]), "Calculator", "kludge") == ToolResult(word, ok=False)


@pytest.mark.parametrize("query", ["2 + 2", "0 + 0", "(3*4)/2", "1,000 + 234", "41 * 23", "3 - 7", "1/0",
                                   "square root of 2", "12 squared", "3 - 7?"])
def test_a_sum_sent_to_search_is_an_error_naming_the_calculator(query):
    """Seen in Chromium: "What is 2 + 2?" went to Search, which found the Jargon File's "2: infix", and the model
    answered "Result = 2". Search then passed sums on to the Calculator, which credited the model with a call it
    did not make; now the model reads an error naming the Calculator (where the session has it) and chooses."""
    assert run_tool(default_tools(), "Search", query) == ToolResult(
        f'error: "{query}" is arithmetic, not a word; to calculate it, use Calculator', ok=False)
    assert run_tool(get_tools(["Search"]), "Search", query) == ToolResult(
        f'error: "{query}" is arithmetic, not a word', ok=False)


@pytest.mark.parametrize("query", ["0", "2", "404", "x + 2", "-1", "kludge"])
def test_numbers_alone_and_words_with_operators_are_still_looked_up(query):
    assert run_tool(default_tools(), "Search", query).ok
