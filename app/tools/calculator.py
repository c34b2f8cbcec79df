"""A safe calculator for model-written arithmetic. Pure standard library, never `eval`.

`calculate("12*(3+4)") -> "84"`. The text is normalised (×, ÷, ^, unicode minus, thousands
separators, a trailing `=`), parsed with `ast.parse(mode="eval")` and walked with an
allowlist. Every bound is checked before the work it guards is done, so no input can hang
the process or exhaust memory:

- input at most 200 characters (checked before parsing; parser recursion/memory errors caught),
- at most 64 expression nodes,
- exact numbers (ints and fractions) at most 4,096 bits in numerator and denominator,
- `a**b` with an exact base: rejected when (bit_length(a) - 1) * |b| > 4,096,
- `a*b`: rejected when the bit lengths add up to more than 4,097,
- factorial only for 0..170, `round` with one argument only, no inf/nan results.

Integer arithmetic is exact (Python ints; `/` gives a Fraction, printed as an int when
integral). Floats are printed with 12 significant digits, so `0.1+0.2` gives `0.3`.
"""

from __future__ import annotations

import ast
import keyword
import math
import re
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Callable, Union

from app.tools.registry import ToolError

MAX_INPUT_CHARS = 200
MAX_NODES = 64
MAX_BITS = 4096
MAX_FACTORIAL = 170
SIGNIFICANT_DIGITS = 12

Exact = Union[int, Fraction]
Number = Union[int, Fraction, float]

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}

# Characters small models write for operators, mapped to Python's.
_REPLACEMENTS = {
    "×": "*", "✕": "*", "∗": "*", "·": "*", "⋅": "*",
    "÷": "/", "∕": "/",
    "−": "-", "–": "-", "‒": "-", "—": "-", "﹣": "-", "－": "-",
    "＋": "+",
    "^": "**",
    "（": "(", "）": ")",
}
# 1,000 / 12,345,678 / 1,234.5: a 1-3 digit group at the start of a number, then groups of
# exactly three digits. A comma followed by a space, or by a group of another size, is left
# alone, so `log(8,2)` and `log(100, 10)` keep their argument commas; `log(100,100)` (one comma,
# directly inside log) is read as log(x, base) too.
_THOUSANDS = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?!\d)(?!,\d)")
# "25% of 640", as the model writes a question's percentage; a bare % stays Python's modulo.
_PERCENT_OF = re.compile(r"(\d+(?:\.\d+)?)\s*%\s*of\b\s*", re.IGNORECASE)

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


def _error(message: str) -> ToolError:
    return ToolError(message)


def _bits(value: Exact) -> int:
    if isinstance(value, int):
        return value.bit_length()
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _normalize(value: Number) -> Number:
    """Fractions with denominator 1 become ints; exact values are checked against MAX_BITS; floats must be finite."""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, Fraction):
        if value.denominator == 1:
            value = value.numerator
        elif _bits(value) > MAX_BITS:
            raise _error(f"number too large (over {MAX_BITS} bits)")
        else:
            return value
    if isinstance(value, int):
        if value.bit_length() > MAX_BITS:
            raise _error(f"number too large (over {MAX_BITS} bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _error("result too large (not a finite number)")
        return value
    if isinstance(value, complex):
        raise _error("result is not a real number")
    raise _error(f"unsupported value {type(value).__name__}")


def _to_float(value: Number) -> float:
    try:
        result = float(value)
    except OverflowError:
        raise _error("number too large for a decimal result") from None
    if not math.isfinite(result):
        raise _error("number too large for a decimal result")
    return result


def _integral(value: Number, what: str) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _error(f"{what} needs a whole number")


# --- functions ------------------------------------------------------------------------------


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise _error("sqrt of a negative number is not a real number")
    if isinstance(x, int):
        root = math.isqrt(x)
        if root * root == x:
            return root
    if isinstance(x, Fraction):
        num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if num * num == x.numerator and den * den == x.denominator:
            return Fraction(num, den)
        # a float can't hold very large or very small fractions: go through Decimal
        with localcontext() as ctx:
            ctx.prec = 20
            return _to_float((Decimal(x.numerator) / Decimal(x.denominator)).sqrt())
    if isinstance(x, int) and x.bit_length() > 1000:
        return _to_float(Decimal(x).sqrt())
    return math.sqrt(_to_float(x))


def _log(x: Number, base: Number | None = None) -> float:
    if x <= 0:
        raise _error("log is only defined for positive numbers")
    value = math.log(x) if isinstance(x, int) else math.log(_to_float(x))
    if base is None:
        return value
    if base <= 0 or base == 1:
        raise _error("log base must be positive and not 1")
    return value / (math.log(base) if isinstance(base, int) else math.log(_to_float(base)))


def _exp(x: Number) -> float:
    try:
        return math.exp(_to_float(x))
    except OverflowError:
        raise _error("exp result too large") from None


def _trig(func: Callable[[float], float]) -> Callable[[Number], float]:
    def apply(x: Number) -> float:
        try:
            result = func(_to_float(x))
        except ValueError:
            raise _error(f"{func.__name__} is not defined there") from None
        # sin(pi) is 1.2e-16 in floating point: show such noise as 0
        return 0.0 if abs(result) < 1e-15 else result

    return apply


def _abs(x: Number) -> Number:
    return abs(x)


def _round(x: Number) -> int:
    """Round half away from zero (round(2.5) == 3), computed exactly."""
    exact = Fraction(x)
    magnitude = math.floor(abs(exact) + Fraction(1, 2))
    return magnitude if exact >= 0 else -magnitude


def _floor(x: Number) -> int:
    return math.floor(x)


def _ceil(x: Number) -> int:
    return math.ceil(x)


def _factorial(x: Number) -> int:
    n = _integral(x, "factorial")
    if not 0 <= n <= MAX_FACTORIAL:
        raise _error(f"factorial is only supported for 0..{MAX_FACTORIAL}")
    return math.factorial(n)


# name -> (function, min args, max args)
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (_sqrt, 1, 1),
    "log": (_log, 1, 2),
    "ln": (_log, 1, 1),
    "exp": (_exp, 1, 1),
    "sin": (_trig(math.sin), 1, 1),
    "cos": (_trig(math.cos), 1, 1),
    "tan": (_trig(math.tan), 1, 1),
    "abs": (_abs, 1, 1),
    "round": (_round, 1, 1),
    "floor": (_floor, 1, 1),
    "ceil": (_ceil, 1, 1),
    "factorial": (_factorial, 1, 1),
}


def _allowed_names() -> str:
    return f"constants {', '.join(CONSTANTS)}; functions {', '.join(FUNCTIONS)}"


# --- operators ------------------------------------------------------------------------------


def _is_exact(value: Number) -> bool:
    return isinstance(value, (int, Fraction))


def _mul(a: Number, b: Number) -> Number:
    if _is_exact(a) and _is_exact(b):
        fa, fb = Fraction(a), Fraction(b)
        if (fa.numerator.bit_length() + fb.numerator.bit_length() > MAX_BITS + 1
                or fa.denominator.bit_length() + fb.denominator.bit_length() > MAX_BITS + 1):
            raise _error(f"product too large (over {MAX_BITS} bits)")
        return a * b
    return _to_float(a) * _to_float(b)


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        raise _error("division by zero")
    if _is_exact(a) and _is_exact(b):
        fa, fb = Fraction(a), Fraction(b)
        if (fa.numerator.bit_length() + fb.denominator.bit_length() > MAX_BITS + 1
                or fa.denominator.bit_length() + fb.numerator.bit_length() > MAX_BITS + 1):
            raise _error(f"quotient too large (over {MAX_BITS} bits)")
        return fa / fb
    return _to_float(a) / _to_float(b)


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise _error("division by zero")
    if _is_exact(a) and _is_exact(b):
        return a // b
    return _to_float(a) // _to_float(b)


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise _error("modulo by zero")
    if _is_exact(a) and _is_exact(b):
        return a % b
    return _to_float(a) % _to_float(b)


def _pow(a: Number, b: Number) -> Number:
    if isinstance(b, int) and _is_exact(a):
        if a == 0 and b < 0:
            raise _error("division by zero (0 to a negative power)")
        if (_bits(a) - 1) * abs(b) > MAX_BITS:
            raise _error(f"power too large (over {MAX_BITS} bits)")
        return Fraction(a) ** b
    base, exponent = _to_float(a), _to_float(b)
    if base == 0 and exponent < 0:
        raise _error("division by zero (0 to a negative power)")
    if base < 0 and not exponent.is_integer():
        raise _error("a negative number to a fractional power is not a real number")
    try:
        return math.pow(base, exponent)
    except OverflowError:
        raise _error("power too large") from None


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: lambda a, b: a + b if _is_exact(a) and _is_exact(b) else _to_float(a) + _to_float(b),
    ast.Sub: lambda a, b: a - b if _is_exact(a) and _is_exact(b) else _to_float(a) - _to_float(b),
    ast.Mult: _mul,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
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
    text = re.sub(r"[\s=]+$", "", text)  # "12*3 =" -> "12*3"
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
        raise _error("expression is nested too deeply") from None
    except (SyntaxError, ValueError) as exc:
        detail = getattr(exc, "msg", None) or str(exc)
        raise _error(f"could not parse {text!r} as arithmetic ({detail})") from None


def _describe(node: ast.AST) -> str:
    return _NODE_NAMES.get(type(node), f"{type(node).__name__} is not allowed")


def _check(tree: ast.Expression) -> None:
    """Reject anything outside the allowlist before anything is computed."""
    nodes = [node for node in ast.walk(tree) if isinstance(node, ast.expr)]
    if len(nodes) > MAX_NODES:
        raise _error(f"expression too long (over {MAX_NODES} parts)")
    for node in nodes:
        if isinstance(node, ast.BinOp):
            if type(node.op) not in _BINARY:
                raise _error(f"operator {_OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, (ast.UAdd, ast.USub)):
                raise _error(f"operator {_OPERATOR_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")
        elif isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, str) or isinstance(value, bytes):
                raise _error("strings are not allowed")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _error(f"{value!r} is not allowed, only numbers")
        elif isinstance(node, ast.Name):
            name = node.id.lower()
            if name not in CONSTANTS and name not in FUNCTIONS:
                raise _error(f"name {node.id!r} is not allowed (allowed: {_allowed_names()})")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, (ast.Constant, ast.BinOp, ast.UnaryOp)) or (
                isinstance(func, ast.Name) and func.id.lower() in CONSTANTS
            ):
                raise _error("use * for multiplication, e.g. 2*(3+4)")
            if not isinstance(func, ast.Name):
                if type(func) in _NODE_NAMES:
                    raise _error(_describe(func))
                raise _error(f"only calls of {', '.join(FUNCTIONS)} are allowed")
            name = func.id.lower()
            if name not in FUNCTIONS:
                raise _error(f"function {func.id!r} is not allowed (allowed: {', '.join(FUNCTIONS)})")
            if node.keywords:
                raise _error(f"keyword arguments are not allowed ({func.id})")
            if any(isinstance(arg, ast.Starred) for arg in node.args):
                raise _error("* unpacking is not allowed")
            _, low, high = FUNCTIONS[name]
            if not low <= len(node.args) <= high:
                count = f"{low}" if low == high else f"{low} or {high}"
                plural = "" if high == 1 else "s"
                raise _error(f"{name} takes {count} argument{plural}, got {len(node.args)}")
        else:
            raise _error(_describe(node))


def _evaluate(node: ast.expr) -> Number:
    if isinstance(node, ast.Constant):
        return _normalize(node.value)
    if isinstance(node, ast.Name):
        name = node.id.lower()
        if name in CONSTANTS:
            return CONSTANTS[name]
        raise _error(f"{node.id} is a function: call it like {name}(2)")
    if isinstance(node, ast.UnaryOp):
        value = _evaluate(node.operand)
        return _normalize(-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _normalize(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.Call):
        function = FUNCTIONS[node.func.id.lower()][0]  # type: ignore[union-attr]
        args = [_evaluate(arg) for arg in node.args]
        return _normalize(function(*args))
    raise _error(_describe(node))  # unreachable after _check


def format_number(value: Number) -> str:
    """Exact ints in full; everything else with 12 significant digits and no trailing noise."""
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Fraction):
        try:
            as_float = float(value)
        except OverflowError:
            as_float = math.inf
        if not math.isfinite(as_float) or as_float == 0:  # too large or too small for a float
            with localcontext() as ctx:
                ctx.prec = SIGNIFICANT_DIGITS + 2
                text = format(Decimal(value.numerator) / Decimal(value.denominator), f".{SIGNIFICANT_DIGITS}g")
        else:
            text = format(as_float, f".{SIGNIFICANT_DIGITS}g")
    else:
        text = format(value, f".{SIGNIFICANT_DIGITS}g")
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return "0" if text in ("-0", "0") else text


def calculate(expression: str) -> str:
    """Evaluate arithmetic text and return the result as text; ToolError on any rejection."""
    if not isinstance(expression, str):
        raise _error("expression must be text")
    if len(expression) > MAX_INPUT_CHARS:
        raise _error(f"expression too long ({len(expression)} characters, max {MAX_INPUT_CHARS})")
    text = _prepare(expression)
    if not text:
        raise _error("empty expression: write arithmetic like 12*(3+4)")
    _not_words(text)
    tree = _parse(text)
    _check(tree)
    try:
        value = _evaluate(tree.body)
    except ToolError:
        raise
    except ZeroDivisionError:
        raise _error("division by zero") from None
    except OverflowError:
        raise _error("result too large") from None
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise _error(f"cannot compute this ({exc})") from None
    return format_number(value)
