"""Batch rewards: exact match of the submitted value."""

from __future__ import annotations

import pytest

from app.engine.rewards import builtin_questions, exact_match, submitted
from app.tools.calculator import calculate


@pytest.mark.parametrize("answer, expected, reward", [
    ("Result = 943", "943", 1.0),
    ("Result = 943.", "943", 1.0),
    ("\nResult =  5,030", "5030", 1.0),
    ("Result = 944", "943", 0.0),
    ("943", "943", 1.0),
    ("Result = 9430", "943", 0.0),
    ("", "943", 0.0),
    ("Result = 1 Result = 2", "2", 1.0),
])
def test_exact_match(answer, expected, reward):
    assert exact_match(answer, expected) == reward


def test_submitted_takes_the_last_result():
    assert submitted("Result = 1\nResult = 2") == "2"


def test_builtin_questions_have_correct_answers():
    questions = builtin_questions()
    assert len(questions) >= 8
    for question, answer in questions:
        expression = question.removeprefix("What is ").removesuffix("?").replace("2 to the power of 12", "2**12")
        assert calculate(expression) == answer
