"""A safe calculator for model-written arithmetic: standard library only, never `eval`.

The text is normalised (×, ÷, ^, thousands separators, operators in words), parsed with `ast.parse(mode="eval")` and
walked with an allowlist; numbers and their bounds are app.tools.numbers'. Every bound (200 characters, 64 expression
nodes, the number sizes) is checked before the work it guards, so no input can hang the process or exhaust memory.
"""

from __future__ import annotations

import ast
import keyword
import re
from typing import Callable

from app.tools.base import ToolError
from app.tools.numbers import (CONSTANTS, FUNCTIONS, Number, add, div, floordiv, format_number, mod, mul,
                               normalize, power, sub)

MAX_INPUT_CHARS = 200
MAX_NODES = 64

# Characters small models write for operators, mapped to Python's.
_REPLACEMENTS = {
    "×": "*", "✕": "*", "∗": "*", "·": "*", "⋅": "*",
    "÷": "/", "∕": "/",
    "−": "-", "–": "-", "‒": "-", "—": "-", "﹣": "-", "－": "-",
    "＋": "+",
    "^": "**",
    "（": "(", "）": ")",
}
# Thousands separators (1,000 / 1,234.5): groups of exactly three digits after the first, so argument commas
# such as `log(8,2)` and `log(100, 10)` stay; `log(100,100)` is read as log(x, base) too.
_THOUSANDS = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?!\d)(?!,\d)")
# "25% of 640", as the model writes a question's percentage; a bare % stays Python's modulo.
_PERCENT_OF = re.compile(r"(\d+(?:\.\d+)?)\s*(?:%|percent)\s*of\b\s*", re.IGNORECASE)
# Operators in words ("square root of 2"), only between numbers or brackets, so other phrases stay words.
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_IN_WORDS = [(re.compile(rf"\b(?:the\s+)?square\s+root\s+of\s+({_NUMBER})", re.IGNORECASE), r"sqrt(\1)"),
             (re.compile(rf"({_NUMBER}|\))\s+squared\b", re.IGNORECASE), r"\1**2"),
             (re.compile(rf"({_NUMBER}|\))\s+cubed\b", re.IGNORECASE), r"\1**3"),
             (re.compile(rf"(?<![\w.])({_NUMBER})\s*!(?!=)"), r"factorial(\1)"),  # "5!" (the model writes it)
             (re.compile(rf"({_NUMBER})\s+factorial\b(?!\s*\()", re.IGNORECASE), r"factorial(\1)"),
             (re.compile(rf"\bfactorial\s+of\s+({_NUMBER})", re.IGNORECASE), r"factorial(\1)")]
_OPERATOR_WORDS = {r"times": "*", r"multiplied\s+by": "*", r"divided\s+by": "/", r"plus": "+", r"minus": "-",
                   r"to\s+the\s+power\s+of": "**"}
_IN_WORDS += [(re.compile(rf"(?<=[\d)])\s+{words}\s+(?=[-+]?[\d(.])", re.IGNORECASE), symbol)
              for words, symbol in _OPERATOR_WORDS.items()]

_OPERATOR_NAMES = {
    ast.BitXor: "^", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>",
    ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}
_NODE_NAMES = {
    ast.Attribute: "attribute access (.) is not allowed",
    ast.Subscript: "indexing ([...]) is not allowed",
    ast.Slice: "slices are not allowed",
    ast.Lambda: "lambda is not allowed",
    ast.List: "lists are not allowed",
    ast.Tuple: "a bare comma is not allowed (commas only as thousands separators, 1,000, or between function arguments)",
    ast.Set: "sets are not allowed",
    ast.Dict: "dicts are not allowed",
    ast.ListComp: "comprehensions are not allowed",
    ast.SetComp: "comprehensions are not allowed",
    ast.DictComp: "comprehensions are not allowed",
    ast.GeneratorExp: "comprehensions are not allowed",
    ast.Compare: "comparisons are not allowed",
    ast.BoolOp: "and/or are not allowed",
    ast.IfExp: "if/else is not allowed",
    ast.NamedExpr: "assignment (:=) is not allowed",
    ast.Starred: "* unpacking is not allowed",
    ast.JoinedStr: "strings are not allowed",
    ast.FormattedValue: "strings are not allowed",
    ast.Await: "await is not allowed",
    ast.Yield: "yield is not allowed",
    ast.YieldFrom: "yield is not allowed",
}


def _allowed_names() -> str:
    return f"constants {', '.join(CONSTANTS)}; functions {', '.join(FUNCTIONS)}"


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: add, ast.Sub: sub, ast.Mult: mul, ast.Div: div, ast.FloorDiv: floordiv, ast.Mod: mod, ast.Pow: power,
}


# --- parsing and checking -------------------------------------------------------------------


def _merge_thousands(match: re.Match[str]) -> str:
    number = match.group(0)
    before, after = match.string[: match.start()].rstrip(), match.string[match.end() :].lstrip()
    if number.count(",") == 1 and before.lower().endswith("log(") and after.startswith(")"):
        return number  # log(100,100): the two arguments of log(x, base)
    return number.replace(",", "")


def _prepare(expression: str) -> str:
    text = expression.strip()
    for old, new in _REPLACEMENTS.items():
        text = text.replace(old, new)
    text = re.sub(r"[\s=?]+$", "", text)  # "12*3 =" -> "12*3"; "3 - 7?" -> "3 - 7" (Search passes it on)
    for words, symbols in _IN_WORDS:
        text = words.sub(symbols, text)
    text = _THOUSANDS.sub(_merge_thousands, text)
    return _close_parentheses(_PERCENT_OF.sub(r"(\1/100)*", text))


def _close_parentheses(text: str) -> str:
    """Close the parentheses left open at the end, as a pocket calculator does: `sqrt(2025` is `sqrt(2025)`.
    (A small model often stops one `)` short; anything else unbalanced is left to the parser's error.)"""
    depth = 0
    for char in text:
        depth += (char == "(") - (char == ")")
        if depth < 0:
            return text
    return text + ")" * depth


# A word or a phrase and nothing else ("heisenbug", "yak shaving"): a look-up sent to the wrong tool.
_WORDS = re.compile(r"[A-Za-z][A-Za-z' -]*[A-Za-z]")


def _not_words(text: str) -> None:
    """Reject a bare word or phrase with a message that names the tool for it: a small model that sent a look-up
    here reads the error and can search instead. (Constants and function names are arithmetic: `pi`.)"""
    words = text.split()
    if (_WORDS.fullmatch(text) and not {w.lower() for w in words} & (set(CONSTANTS) | set(FUNCTIONS))
            and not any(keyword.iskeyword(w) for w in words)):  # True, lambda: the parser's own messages
        raise ToolError(f"{text!r} is words, not arithmetic",
                        hint=("Search", "to look up what a word means, use Search"))


def _parse(text: str) -> ast.Expression:
    try:
        return ast.parse(text, mode="eval")
    except (RecursionError, MemoryError):
        raise ToolError("expression is nested too deeply") from None
    except (SyntaxError, ValueError) as exc:
        detail = getattr(exc, "msg", None) or str(exc)
        raise ToolError(f"could not parse {text!r} as arithmetic ({detail})") from None


def _describe(node: ast.AST) -> str:
    return _NODE_NAMES.get(type(node), f"{type(node).__name__} is not allowed")


def _check(tree: ast.Expression) -> None:
    """Reject anything outside the allowlist before anything is computed."""
    nodes = [node for node in ast.walk(tree) if isinstance(node, ast.expr)]
    if len(nodes) > MAX_NODES:
        raise ToolError(f"expression too long (over {MAX_NODES} parts)")
    for node in nodes:
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise ToolError(f"operator {_OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise ToolError(f"operator {_OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")
        elif isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, str) or isinstance(value, bytes):
                raise ToolError("strings are not allowed")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ToolError(f"{value!r} is not allowed, only numbers")
        elif isinstance(node, ast.Name):
            name = node.id.lower()
            if name not in CONSTANTS and name not in FUNCTIONS:
                raise ToolError(f"name {node.id!r} is not allowed (allowed: {_allowed_names()})")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, (ast.Constant, ast.BinOp, ast.UnaryOp)) or (
                isinstance(func, ast.Name) and func.id.lower() in CONSTANTS
            ):
                raise ToolError("use * for multiplication, e.g. 2*(3+4)")
            if not isinstance(func, ast.Name):
                if type(func) in _NODE_NAMES:
                    raise ToolError(_describe(func))
                raise ToolError(f"only calls of {', '.join(FUNCTIONS)} are allowed")
            name = func.id.lower()
            if name not in FUNCTIONS:
                raise ToolError(f"function {func.id!r} is not allowed (allowed: {', '.join(FUNCTIONS)})")
            if node.keywords:
                raise ToolError(f"keyword arguments are not allowed ({func.id})")
            if any(isinstance(arg, ast.Starred) for arg in node.args):
                raise ToolError("* unpacking is not allowed")
            _, low, high = FUNCTIONS[name]
            if not low <= len(node.args) <= high:
                count = f"{low}" if low == high else f"{low} or {high}"
                plural = "" if high == 1 else "s"
                raise ToolError(f"{name} takes {count} argument{plural}, got {len(node.args)}")
        else:
            raise ToolError(_describe(node))


def _evaluate(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        return normalize(node.value)
    if isinstance(node, ast.Name):
        name = node.id.lower()
        if name in CONSTANTS:
            return CONSTANTS[name]
        raise ToolError(f"{node.id} is a function: call it like {name}(2)")
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand)
        return normalize(-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return normalize(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call):
        function = FUNCTIONS[node.func.id.lower()][0]  # type: ignore[union-attr]
        args = [_evaluate(arg) for arg in node.args]
        return normalize(function(*args))
    raise ToolError(_describe(node))  # unreachable after _check


def _checked(expression: str) -> ast.Expression:
    """The expression's syntax tree, every check passed (nothing computed yet); ToolError on any rejection."""
    if not isinstance(expression, str):
        raise ToolError("expression must be text")
    if len(expression) > MAX_INPUT_CHARS:
        raise ToolError(f"expression too long ({len(expression)} characters, max {MAX_INPUT_CHARS})")
    text = _prepare(expression)
    if not text:
        raise ToolError("empty expression: write arithmetic like 12*(3+4)")
    _not_words(text)
    tree = _parse(text)
    _check(tree)
    return tree


def reads(expression: str) -> bool:
    """Whether this is arithmetic the calculator takes (it may still fail to compute it: 1/0), without computing
    it: how Search tells a sum sent to it (app.tools.search.is_arithmetic)."""
    try:
        _checked(expression)
    except ToolError:
        return False
    return True


# A sum written in symbols: numbers joined by operators, brackets and spaces ("(12 + 8) * 5", "2^10"), no words,
# and not a piece of something larger (no letter, point or ^ just before it, no letter or bracket just after)
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_SUM = re.compile(rf"(?<![\w.^])(?:[-(]\s*)*{_NUMBER}[)\s]*"
                  rf"(?:(?:\*\*|[-+*/×÷^])[(\s]*-?{_NUMBER}[)\s]*)+(?![\w(]|\.\d)")
_MAY_HOLD_A_SUM = re.compile(r"\d[)\s]*(?:\*\*|[-+*/×÷^])")  # (a quick test first: a long question is scanned once)
_NOT_A_SUM = re.compile(r"[\d,.]+(?:[-/][\d,.]+)+")  # 80/20, 24/7, 9/11, 12/25/2024, 3-2, 555-1234: no spaces, - or /
_SPELLED = {"×": "*", "÷": "/"}  # (SmolLM2 has no token for "÷": the call could not be spelled as written)


def sum_in(question: str) -> str | None:
    """The one sum a question writes in symbols, as the calculator reads it ("What is 2 + 2 * 3?" -> "2 + 2 * 3"); None
    for none, more than one, or a ratio, date or score-like `a/b` or `a-b`. Left alone, the small model miscopies such
    sums or skips the call."""
    if not _MAY_HOLD_A_SUM.search(question):
        return None
    found = [match.group(0).strip().rstrip(",") for match in _SUM.finditer(question)]
    if len(found) != 1 or _NOT_A_SUM.fullmatch(found[0]) or not reads(found[0]):
        return None
    text = re.sub(r"\s+", " ", found[0])
    for written, spelled in _SPELLED.items():
        text = text.replace(written, spelled)
    return text


def calculate(expression: str) -> str:
    """Evaluate arithmetic text and return the result as text; ToolError on any rejection."""
    tree = _checked(expression)
    try:
        value = _evaluate(tree.body)
    except ToolError:
        raise
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large") from None
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ToolError(f"cannot compute this ({exc})") from None
    return format_number(value)
