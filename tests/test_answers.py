"""Answers a demo is judged by, on the real bundled model (the shipped adapter merged) with textenv's default prompt
and the page's settings with the guide on: the guide's regressions. (Unguided, the model's own: test_shipped_adapter.)

Regressions from trying the app as a new user would: look-ups answered with invented text and went on writing
the next few-shot example ("Q: What is a kludge?") until max_turns; greetings called the calculator.
(The full measurement, with a reported question set, is benchmarks/answer_quality.py.)
"""

from __future__ import annotations

import dataclasses

import pytest

from app.decoding.stops import StopReason
from app.engine.engine import Engine
from app.protocols.textenv.markers import RESPONSE, SUBMIT
from components.inputs import DEFAULTS

PAGE = dataclasses.replace(DEFAULTS, guide=True)  # the page's settings, the guide switched on


@pytest.fixture(scope="module")
def engine(real) -> Engine:
    return Engine(real)


@pytest.mark.parametrize("question, key", [
    ("What does daemon mean?", "dormant"),
    ("What does hairy mean?", "complicated"),  # a short definition: once ended by a new line and a new "Q:"
])
def test_a_look_up_answers_from_the_definition_after_one_search(engine, question, key):
    episode = engine.ask(engine.new_session(), question, PAGE)
    assert [s.tool for s in episode.segments if s.kind == "tool"] == ["Search"]
    assert episode.stop.reason is StopReason.STRING_MATCH and episode.stop.string == SUBMIT, episode.stop
    assert key in episode.answer and "Q:" not in episode.answer


@pytest.mark.parametrize("question", ["Hello! What can you do?", "Good morning!"])
def test_a_greeting_needs_no_tool(engine, question):
    """A greeting is answered in one model segment that ends at an end marker, not with a tool call or a new
    few-shot example. (Which marker is the model's choice: in int8 "Good morning!" ends with a `<response>`,
    which is cut; the benchmark's target counts only `<submit>` and EOS.)"""
    episode = engine.ask(engine.new_session(), question, PAGE)
    assert [s.kind for s in episode.segments] == ["model"]
    assert episode.stop.reason is StopReason.EOS or episode.stop.string in (SUBMIT, RESPONSE), episode.stop
    assert episode.answer.startswith("Result = ") and "Q:" not in episode.answer


@pytest.mark.parametrize("question, number", [
    ("What is 5 - 29?", "-24"),  # regressions: "Result = 24" (the sign dropped; 3 of 4 negative results) ...
    ("What is 100 - 250?", "-150"),  # ... "Result = (-150)" (only a number the line began was held to the output)
    ("What is 4,096 / 64?", "64"),  # ... and "Result = 100" where the Calculator said 64
    ("What is 41 * 23?", "943"),
    ("square root of 2", "1.41421356237"),  # sent to Search (and passed on) until the greetings named the tools
    # regressions: a sum written in symbols is the Calculator's query (Tool.claims): the model sent "2 * 3" and
    # "7 * 8 * 5", and answered "Result = 4 - 6" and "Result = 101" with no call; 3 - 7, 10 - 25, 8 - 9 and 1 - 1
    # went to Search, which passed them on to the Calculator (it no longer does: the model reads an error)
    ("What is 2 + 2 * 3?", "8"), ("What is 7 * 8 - 5?", "51"), ("What is 4 - 6?", "-2"), ("Whats 99 + 1", "100"),
    ("What is 3 - 7?", "-4"), ("What is 10 - 25?", "-15"), ("What is 8 - 9?", "-1"), ("What is 1 - 1?", "0"),
])
def test_an_arithmetic_answer_writes_the_calculators_number(engine, question, number):
    answers = [engine.ask(engine.new_session(), question, dataclasses.replace(PAGE, use_cache=cached))
               for cached in (True, False)]
    for episode in answers:
        assert [s.tool for s in episode.segments if s.kind == "tool"] == ["Calculator"]
        assert episode.segments[1].text == number + RESPONSE
        assert episode.answer == f"Result = {number}"
    assert answers[0].token_ids == answers[1].token_ids  # cache on and off: the same tokens




@pytest.mark.parametrize("question, entry", [("What is barn?", "barn: "), ("What is a magic cookie?", "magic cookie: "),
                                             ("Define toaster.", "toaster: ")])
def test_a_question_about_a_headword_answers_from_its_entry(engine, question, entry):
    """Regression (answer_quality.py --set dev / wide): "Result = Barn" and "A magic cookie is a small language
    model with a calculator and the Jargon File" with no look-up; "Define toaster." sent to the Calculator."""
    episode = engine.ask(engine.new_session(), question, PAGE)
    [tool] = [s for s in episode.segments if s.kind == "tool"]
    assert tool.tool == "Search" and tool.text.startswith(entry)
    assert episode.answer.lower().startswith("result = " + entry.lower())


@pytest.mark.parametrize("question, query", [("Explain what a daemon is.", "daemon"), ("What is a newbie?", "newbie"),
                                             ("What does foobar mean?", "foobar"), ("What is a kernel?", "kernel")])
def test_a_look_up_answers_with_the_best_entry_it_found(engine, question, query):
    """Regressions: the model searched and got the entry, then answered "Result = what a daemon is", "Result = A
    newbie." (the entry: "A Usenet neophyte") and copied "metasyntactic" as "metasytactic" (foobar); from three
    entries none of which is kernel's it made one up ("kernel: A fictional society that Linux bigots ...")."""
    answers = [engine.ask(engine.new_session(), question, dataclasses.replace(PAGE, use_cache=cached))
               for cached in (True, False)]
    for episode in answers:
        assert episode.segments[0].text == f"<request><Search>{query}<call>"
        [tool] = [s for s in episode.segments if s.kind == "tool"]
        entry = tool.text.removesuffix(RESPONSE).split("\n")[0]  # (the first of several: the best)
        assert tool.tool == "Search"
        assert episode.answer.startswith(f"Result = {entry}"), (episode.answer, entry)
        # the quoted entry is the guide's, not the model's: each of its tokens forced or steered, but the last, where
        # the grammar lets the line go on (")" or ")<" of ")<submit>": the model picks which)
        answer = episode.segments[-1]
        quoted = answer.text.index(entry)
        ends = [len(engine.backend.tokenizer.decode(episode.token_ids[answer.start - episode.query_start:][:n]))
                for n in range(1, answer.end - answer.start + 1)]
        inside = [p for p, end in zip(answer.token_provenance(), ends) if quoted + len(entry) > end > quoted + 1]
        assert inside and all(p.value in ("forced", "steered") for p in inside), inside
    assert answers[0].token_ids == answers[1].token_ids  # cache on and off: the same tokens and provenance
    assert answers[0].provenance == answers[1].provenance


def test_with_the_guide_off_every_token_of_the_reply_is_the_models(engine):
    episode = engine.ask(engine.new_session(), "Explain what a daemon is.", dataclasses.replace(PAGE, guide=False))
    assert set(episode.provenance) <= {"user", "tool", "model"} and "model" in episode.provenance
    assert episode.mask == [int(p == "model") for p in episode.provenance]


@pytest.mark.parametrize("question, error", [
    ("What is 10 / 0?", "error: division by zero"),  # regressions: "Result = 10", "Result = 5.0" ...
    ("What is 5 / 0?", "error: division by zero"),
    ("What is the square root of -9?", "error: sqrt of a negative number is not a real number"),  # ... "sqrt(-9): 9"
    ("What is log(0)?", "error: log is only defined for positive numbers"),  # ... "A function that returns 1."
])
def test_a_tools_error_is_the_answer_not_an_invented_result(engine, question, error):
    episode = engine.ask(engine.new_session(), question, PAGE)
    [tool] = [s for s in episode.segments if s.kind == "tool"]
    assert tool.tool == "Calculator" and not tool.ok and tool.text == error + RESPONSE
    assert episode.answer == f"Result = {error}"


@pytest.mark.parametrize("question", ["Tell me a joke.", "What is the Jargon File?"])
def test_a_call_the_model_would_loop_in_ends_and_the_turn_answers(engine, question):
    """Regressions: the query looped ("laughs at a joke.\nLaughs at a joke.\n...", "jargon_file_jargon_file_...")
    until the repetition stop, the unfinished call was the turn's answer, and the next question in the chat copied
    it. Now the call ends, its tool runs, and the turn answers (what it answers is the model's and the index's)."""
    episode = engine.ask(engine.new_session(), question, PAGE)
    assert [s.kind for s in episode.segments] == ["model", "tool", "model"]
    call, tool = episode.segments[:2]  # (ended by `<call>`: the guide writes it where the line or its bound ends)
    assert call.stop.string == "<call>" and "\n" not in tool.query
    assert "\n" not in call.text.removesuffix("<call>").rstrip("\n")
    assert episode.stop.string == SUBMIT and episode.answer.startswith("Result = ")


@pytest.mark.parametrize("question", ["Who are you?", "Are you an AI?"])
def test_a_question_about_the_assistant_is_answered_by_it_about_itself(engine, question):
    """Regression: "You're a small language model with a calculator and the Jargon File" (the visitor described).
    (With the shipped adapter, "Tell me about yourself." searches the Jargon File instead: docs/training.md.)"""
    episode = engine.ask(engine.new_session(), question, PAGE)
    assert [s.kind for s in episode.segments] == ["model"] and episode.answer.startswith("Result = I am ")
