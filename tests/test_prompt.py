"""The few-shot prompt: examples filled in by the tools themselves, examples of absent tools left out."""

from __future__ import annotations

import re

import pytest

from app.protocols.naming import PromptError
from app.protocols.textenv.prompt import default_prompt_template, fill_examples, render_prompt
from app.engine.engine import Engine
from app.protocols.textenv.markers import CALL, RESPONSE, SUBMIT
from app.settings import InputError
from app.tools.base import Tool
from app.tools.registry import default_tools, get_tools, run_tool

EXAMPLE = re.compile(rf"Q: (.*)\n<request><(\w+)>(.*){CALL}(.*){RESPONSE}\nResult = (.*){SUBMIT}")


def test_every_example_answer_is_the_tools_real_output():
    # Regression: the look-up examples answered with text the tool never returned ("A clumsy but working fix
    # for a nasty case."), which taught the model to invent definitions instead of copying them.
    tools = default_tools()
    rendered = render_prompt(default_prompt_template(), tools)
    examples = EXAMPLE.findall(rendered)
    assert {tool for _, tool, _, _, _ in examples} == {"Calculator", "Search"}
    assert sum(tool == "Search" for _, tool, _, _, _ in examples) >= 3
    for _, tool, query, output, answer in examples:
        assert output == run_tool(tools, tool, query).text
        assert answer == tools[tool].answer(output)
        assert tool != "Search" or answer == output.split("\n")[0]  # a look-up copies the entry's line
    assert not re.search(rf"{CALL}\s*$", rendered, re.MULTILINE)  # nothing left open
    assert "{tools}" not in rendered and "- Search: " in rendered


def test_examples_of_a_tool_not_in_the_session_are_left_out():
    rendered = render_prompt(default_prompt_template(), get_tools(["Calculator"]))
    assert "<Search>" not in rendered and "<Calculator>" in rendered
    assert "Q: Hello, who are you?" in rendered  # examples without a tool stay
    assert "\n\n\n" not in rendered


GREETINGS = re.compile(r"^Result = (.*(?:I am|thanks|afternoon).*)<submit>$", re.MULTILINE)


@pytest.mark.parametrize("names, named, unnamed", [
    (None, ["with a calculator and the Jargon File", "calculate or look up"], ["search", "two tools"]),
    (["Calculator"], ["with a calculator<", "me to calculate?"], ["Jargon", "look up", "two tools"]),
    (["Search"], ["with the Jargon File<", "me to look up?"], ["calculat", "two tools"]),
    ([], ["with no tools", "me to help with?"], ["calculat", "Jargon", "look up", "two tools"]),
])
def test_greetings_name_only_the_sessions_tools(names, named, unnamed):
    # Regression: with the Search tool unchecked, "How's it going?" was answered "Ask me to calculate something
    # or to look up a word of hacker slang": the greeting examples named both tools whatever the session had.
    rendered = render_prompt(default_prompt_template(), get_tools(names))
    greetings = "\n".join(f"{line}<" for line in GREETINGS.findall(rendered))
    assert len(GREETINGS.findall(rendered)) == 5 and "{" not in greetings  # (the template's greeting examples)
    assert all(words in greetings for words in named), greetings
    assert not any(words in greetings for words in unnamed), greetings


def test_a_tool_names_itself_in_a_custom_prompt():
    three = {name: Tool(name, "?", str, ability=f"a {name.lower()}", action=name.lower()) for name in "ABC"}
    template = "Q: Hi\nResult = I have {abilities}; I can {actions}.<submit>"
    assert render_prompt(template, three) == "Q: Hi\nResult = I have a a, a b and a c; I can a, b or c.<submit>\n\n"
    assert render_prompt(template, {}).startswith("Q: Hi\nResult = I have no tools; I can help with.")
    wordless = {"A": Tool("A", "?", str, action="ask A"), "B": Tool("B", "?", str, ability="a b")}
    assert render_prompt(template, wordless).startswith("Q: Hi\nResult = I have A and a b; I can ask A or use B.")


def test_a_custom_template_is_filled_by_its_own_tools():
    echo = Tool("Echo", "repeats in capitals", str.upper, answer=lambda out: out.lower() + "!")
    template = "Tools: {tools}\n\nQ: Say hi\n<request><Echo>hi there<call>\n\nQ: Hello\nResult = Hi.<submit>\n"
    rendered = render_prompt(template, {"Echo": echo})
    assert rendered == ("Tools: - Echo: repeats in capitals\n\nQ: Say hi\n<request><Echo>hi there<call>"
                        "HI THERE<response>\nResult = hi there!<submit>\n\nQ: Hello\nResult = Hi.<submit>\n\n")


def test_a_written_out_example_is_left_as_it_is():
    block = "Q: What is 2+2?\n<request><Calculator>2+2<call>4<response>\nResult = four<submit>"
    assert fill_examples(block, default_tools()) == block


def test_an_example_the_tool_rejects_is_a_clear_error(tiny_llama):
    template = "{tools}\n\nQ: What is 1/0?\n<request><Calculator>1/0<call>\n"
    with pytest.raises(PromptError, match=r"example <request><Calculator>1/0<call> failed: error: "):
        render_prompt(template, default_tools())
    with pytest.raises(InputError, match="failed"):  # a visitor's prompt: shown as a message, not a traceback
        Engine(tiny_llama).new_session(template)
