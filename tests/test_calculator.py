"""Calculator: exact answers for what small models write, and fast rejection of every attack."""

from __future__ import annotations

import subprocess
import sys

import pytest

from app.paths import ROOT
from app.tools.base import ToolError
from app.tools.calculator import calculate, sum_in

CASES = [
    ("1+2", "3"),
    ("12*(3+4)", "84"),
    ("2**100", "1267650600228229401496703205376"),
    ("123456789*987654321", "121932631112635269"),
    ("10/2", "5"),
    ("7/2", "3.5"),
    ("1/3", "0.333333333333"),
    ("1/3*3", "1"),
    ("100/7", "14.2857142857"),
    ("10//3", "3"),
    ("-7%3", "2"),
    ("0.1+0.2", "0.3"),
    ("0.1*3", "0.3"),
    ("2.5*4", "10"),
    ("1.5e3+1", "1501"),
    ("3×4", "12"),
    ("8÷2", "4"),
    ("−5+3", "-2"),
    ("2^10", "1024"),
    ("3^2^2", "81"),
    ("1,000+1", "1001"),
    ("12,345,678*2", "24691356"),
    ("1,234.5*2", "2469"),
    ("7*6 =", "42"),
    ("25% of 640", "160"),  # what the model wrote for "How much is 25% of 640?" (was a parse error)
    ("12.5 % OF 80 + 1", "11"),
    ("  2+2  ", "4"),
    ("(1+2)*(3+4)", "21"),
    ("-(3+4)*2", "-14"),
    ("-2**2", "-4"),
    ("(-2)**2", "4"),
    ("2*-3", "-6"),
    ("+5", "5"),
    ("2**-3", "0.125"),
    ("sqrt(2)", "1.41421356237"),
    ("sqrt(16)", "4"),
    ("sqrt(2**200)", "1267650600228229401496703205376"),
    ("sqrt(1/4)", "0.5"),
    # Regression: "What is the square root of 2025?" wrote sqrt(2025 and got a parse error; closed as a calculator does
    ("sqrt(2025", "45"),
    ("(12 + 8) * (5", "100"),
    ("log(e)", "1"),
    ("log(8,2)", "3"),
    ("log(100, 10)", "2"),
    ("log(1000,10)", "3"),
    ("log(100,100)", "1"),
    ("log(1,000,000)", "13.815510558"),
    ("sqrt(1,000,000)", "1000"),
    ("exp(1)", "2.71828182846"),
    ("exp(0)", "1"),
    ("pi", "3.14159265359"),
    ("2*pi", "6.28318530718"),
    ("e", "2.71828182846"),
    ("sin(pi)", "0"),
    ("cos(0)", "1"),
    ("tan(0)", "0"),
    ("abs(-5)", "5"),
    ("abs(-2.5)", "2.5"),
    ("round(2.5)", "3"),
    ("round(-2.5)", "-3"),
    ("round(2.4)", "2"),
    ("floor(2.7)", "2"),
    ("floor(-7/2)", "-4"),
    ("ceil(2.1)", "3"),
    ("factorial(20)", "2432902008176640000"),
    ("factorial(0)", "1"),
    ("Sqrt(16)", "4"),
    ("1e20", "1e20"),
    ("10**400/3", "3.33333333333e399"),
    ("4**0.5", "2"),
    ("-0.0", "0"),
]


@pytest.mark.parametrize(("expression", "expected"), CASES)
def test_calculates(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


# Each would run for seconds, exhaust memory or escape the sandbox if it were computed; being
# rejected (with a message naming the problem) is the proof that it was not.
ATTACKS = [
    ("__import__('os').system('x')", "not allowed"),
    ("__import__('os')", "'__import__' is not allowed"),
    ("().__class__.__bases__", "attribute access"),
    ("open('x')", "'open' is not allowed"),
    ("lambda: 1", "lambda"),
    ("[1]*9", "lists"),
    ('"a"*9', "strings"),
    ("[x for x in (1,)]", "not allowed"),
    ("(1)[0]", "indexing"),
    ("x", "'x' is not allowed"),
    ("round(5, ndigits=2)", "argument"),
    ("round(5, -10**7)", "round takes 1 argument"),
    ("9**9**9**9", "too large"),
    ("(10**9999)**9999", "too large"),
    ("10**4000 * 10**4000", "too large"),
    ("2**4000 * 2**4000", "product too large"),
    ("3999999**3999999 % 7", "too large"),
    ("2**4096", "too large"),
    ("factorial(10**6)", "0..170"),
    ("factorial(171)", "0..170"),
    ("factorial(-1)", "0..170"),
    ("factorial(2.5)", "whole number"),
    ("1+" * 10**5 + "1", "too long"),
    ("(" * 300 + "1" + ")" * 300, "too long"),
    ("1" * 500, "too long"),
    ("-" * 150 + "1", "too long"),
    ("1/0", "division by zero"),
    ("5//0", "division by zero"),
    ("5%0", "by zero"),
    ("0**-1", "division by zero"),
    ("exp(1000)", "too large"),
    ("1e308*10", "too large"),
    ("1e400", "too large"),
    ("sqrt(-1)", "not a real number"),
    ("(-8)**(1/3)", "not a real number"),
    ("log(0)", "positive"),
    ("log(5, 1)", "base"),
    ("1j", "only numbers"),
    ("True", "only numbers"),
    ("1 < 2", "comparisons"),
    ("1, 2", "comma"),
    ("2(3+4)", "use * for multiplication"),
    ("1 & 2", "operator & is not allowed"),
    ("", "empty"),
    ("=", "empty"),
    ("1 +", "could not parse"),
    ("(1+2))", "unmatched ')'"),  # only parentheses left open at the end are closed
    (")1+2(", "unmatched ')'"),
    ("1\x00", "could not parse"),
    # Regression: "Define heisenbug." sent the word to the Calculator, whose parse error did not say what to do
    # (the advice to use Search is added by run_tool where the session has Search: tests/test_registry.py)
    ("heisenbug", "'heisenbug' is words, not arithmetic"),
    ("yak shaving", "is words, not arithmetic"),
]


@pytest.mark.parametrize(("expression", "message"), ATTACKS, ids=[a[0][:40] for a in ATTACKS])
def test_rejects(expression: str, message: str) -> None:
    with pytest.raises(ToolError) as info:
        calculate(expression)
    text = str(info.value)
    assert message in text
    assert 0 < len(text) <= 200  # short enough for the model to read


@pytest.mark.parametrize(("expression", "value"), [("pi", "3.14159265359"), ("sqrt(pi)", "1.77245385091"),
                                                  ("e", "2.71828182846")])
def test_names_are_not_taken_for_a_look_up(expression: str, value: str) -> None:
    """Constants and functions are arithmetic: computed, not sent back as words to look up."""
    assert calculate(expression) == value


def test_an_unknown_name_is_not_taken_for_a_look_up_either() -> None:
    """One letter is a name the calculator does not know (it says which it does), not words to search for."""
    with pytest.raises(ToolError) as info:
        calculate("x")
    assert "name 'x' is not allowed (allowed: constants pi, e;" in str(info.value)
    assert "words" not in str(info.value)


def test_non_text_input_is_rejected() -> None:
    with pytest.raises(ToolError):
        calculate(None)  # type: ignore[arg-type]


def test_nesting_inside_the_length_limit_is_fine() -> None:
    assert calculate("(" * 99 + "1" + ")" * 99) == "1"


def test_imports_only_the_standard_library() -> None:
    """A separate venv (without torch) must be able to import the calculator."""
    code = (
        "import sys; import app.tools.calculator as c; "
        "bad = [m for m in ('torch', 'transformers', 'gradio', 'numpy') if m in sys.modules]; "
        "assert not bad, bad; print(c.calculate('6*7'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "42"


@pytest.mark.parametrize("expression, expected", [
    ("ln(1/10**400)", "-921.034037198"),  # regression: "cannot compute this (math domain error)"
    ("log(1/8, 1/2)", "3"),
    ("sqrt(2/10**1000)", "error: number too small for a decimal result"),  # regressions: both printed 0
    ("(10**-700)**0.5", "error: number too small for a decimal result"),
    ("10**-700", "1e-700"), ("0*0.5", "0"),
])
def test_tiny_exact_numbers_are_computed_or_a_clear_error_never_a_silent_zero(expression, expected):
    try:
        got = calculate(expression)
    except ToolError as error:
        got = f"error: {error}"
    assert got == expected


@pytest.mark.parametrize("expression, expected", [
    ("square root of 2", "1.41421356237"),  # regression: sent to Search, which found "Death Square"; "Result = 100"
    ("the square root of 1,024", "32"), ("Square Root of 144", "12"), ("12 squared", "144"), ("(2+3) squared", "25"),
    ("3 cubed", "27"), ("2 to the power of 10", "1024"), ("15 times 4", "60"), ("3 times (4+1)", "15"),
    ("10 divided by 4", "2.5"), ("3 plus 4", "7"), ("3 minus 7", "-4"), ("10 percent of 50", "5"),
    ("7 multiplied by 6", "42"), ("5!", "120"),  # regression: "what is 5!" -> "could not parse '5!'"
    ("5 factorial", "120"), ("factorial of 6", "720"), ("3! + 1", "7"), ("factorial(5)", "120"),
    ("2 times -3", "-6"), ("10 to the power of -2", "0.01"), ("3 - 7?", "-4"),  # (review)
])
def test_operators_in_words_between_numbers(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression", ["times", "square root of two", "12 squared meters", "3 plus minus 4",
                                        "plus 3", "the times", "5 != 4", "x!"])
def test_operator_words_elsewhere_stay_words(expression: str) -> None:
    with pytest.raises(ToolError):
        calculate(expression)


@pytest.mark.parametrize("question, expected", [
    ("What is 2 + 2 * 3?", "2 + 2 * 3"), ("What is 7 * 8 - 5?", "7 * 8 - 5"), ("Whats 99 + 1", "99 + 1"),
    ("What is (12 + 8) * 5?", "(12 + 8) * 5"), ("What is 1,250 + 3,780?", "1,250 + 3,780"), ("What is 2^10?", "2^10"),
    ("What is -5 + 3?", "-5 + 3"), ("What is 3.5 * 2.", "3.5 * 2"), ("What is 12 / (3 + 1)?", "12 / (3 + 1)"),
    ("What is 1 / 0?", "1 / 0"),  # (the calculator reads it; its error is the answer's to give)
    ("What is 10 percent of 50?", None), ("what is 6 times 7", None), ("square root of 2", None),  # words: the model's
    ("Define 404", None), ("What is 5!", None), ("How much is 15% of 80?", None),  # no operator between numbers
    ("What is 2 + 3 and 4 * 5?", None),  # two sums: which one is asked is the model's to say
    ("What is 2 + 2)?", None),  # not read by the calculator
    ("What is 8 ÷ 2?", "8 / 2"), ("What is 6 × 7?", "6 * 7"), ("What is 2 +  2 then?", "2 + 2"),  # spelled as tokens
    # a piece of what the calculator reads whole (review: "sqrt(16) + 4" sent "(16) + 4", answered 20)
    ("What is sqrt(16) + 4?", None), ("What is abs(-5) + 1?", None), ("what is 1e3 + 1", None),
    ("what is 0x10 + 1", None), ("x^2 + 3 when x = 2", None),
    # ratios, dates, scores: a/b or a-b with no spaces is the model's to read
    ("What's the 80/20 rule?", None), ("Is 24/7 support worth it?", None), ("What day is 12/25/2024?", None),
    ("Explain 10-4", None), ("What is 4-6?", None), ("What is 2*3+1?", "2*3+1"),
])
def test_the_sum_a_question_writes(question, expected):
    assert sum_in(question) == expected

