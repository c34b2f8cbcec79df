"""The calculator's numbers: exact ints and fractions (at most 4,096 bits each), floats only where a function needs one,
every size bound checked before the work it guards, and how a result is printed (floats with 12 significant digits, so
`0.1+0.2` gives `0.3`). Standard library only."""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Callable, Union

from app.tools.base import ToolError

MAX_BITS = 4096
MAX_FACTORIAL = 170
SIGNIFICANT_DIGITS = 12

Exact = Union[int, Fraction]
Number = Union[int, Fraction, float]

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _bits(value: Exact) -> int:
    if isinstance(value, int):
        return value.bit_length()
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def normalize(value: Number) -> Number:
    """Fractions with denominator 1 become ints; exact values are checked against MAX_BITS; floats must be finite."""
    if isinstance(value, bool):
        value = int(value)
    if isinstance(value, Fraction):
        if value.denominator == 1:
            value = value.numerator
        elif _bits(value) > MAX_BITS:
            raise ToolError(f"number too large (over {MAX_BITS} bits)")
        else:
            return value
    if isinstance(value, int):
        if value.bit_length() > MAX_BITS:
            raise ToolError(f"number too large (over {MAX_BITS} bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result too large (not a finite number)")
        return value
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    raise ToolError(f"unsupported value {type(value).__name__}")


def _to_float(value: Number) -> float:
    try:
        result = float(value)
    except OverflowError:
        raise ToolError("number too large for a decimal result") from None
    if not math.isfinite(result):
        raise ToolError("number too large for a decimal result")
    if result == 0 and value != 0:  # (underflow: "sqrt(2/10**1000)" would print 0)
        raise ToolError("number too small for a decimal result")
    return result


def _integral(value: Number, what: str) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ToolError(f"{what} needs a whole number")


# --- functions ------------------------------------------------------------------------------


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise ToolError("sqrt of a negative number is not a real number")
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
        raise ToolError("log is only defined for positive numbers")
    value = _ln(x)
    if base is None:
        return value
    if base <= 0 or base == 1:
        raise ToolError("log base must be positive and not 1")
    return value / _ln(base)


def _ln(x: Number) -> float:
    """math.log of a positive number, exact ones whatever their size (a fraction's parts: ln(1/10**400) is -921,
    not the log of its float, 0)."""
    if isinstance(x, Fraction):
        return math.log(x.numerator) - math.log(x.denominator)
    return math.log(x) if isinstance(x, int) else math.log(_to_float(x))


def _exp(x: Number) -> float:
    try:
        return math.exp(_to_float(x))
    except OverflowError:
        raise ToolError("exp result too large") from None


def _trig(func: Callable[[float], float]) -> Callable[[Number], float]:
    def apply(x: Number) -> float:
        try:
            result = func(_to_float(x))
        except ValueError:
            raise ToolError(f"{func.__name__} is not defined there") from None
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
        raise ToolError(f"factorial is only supported for 0..{MAX_FACTORIAL}")
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


# --- operators ------------------------------------------------------------------------------


def _is_exact(value: Number) -> bool:
    return isinstance(value, (int, Fraction))


def add(a: Number, b: Number) -> Number:
    return a + b if _is_exact(a) and _is_exact(b) else _to_float(a) + _to_float(b)


def sub(a: Number, b: Number) -> Number:
    return a - b if _is_exact(a) and _is_exact(b) else _to_float(a) - _to_float(b)


def mul(a: Number, b: Number) -> Number:
    if _is_exact(a) and _is_exact(b):
        fa, fb = Fraction(a), Fraction(b)
        if (fa.numerator.bit_length() + fb.numerator.bit_length() > MAX_BITS + 1
                or fa.denominator.bit_length() + fb.denominator.bit_length() > MAX_BITS + 1):
            raise ToolError(f"product too large (over {MAX_BITS} bits)")
        return a * b
    return _to_float(a) * _to_float(b)


def div(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolError("division by zero")
    if _is_exact(a) and _is_exact(b):
        fa, fb = Fraction(a), Fraction(b)
        if (fa.numerator.bit_length() + fb.denominator.bit_length() > MAX_BITS + 1
                or fa.denominator.bit_length() + fb.numerator.bit_length() > MAX_BITS + 1):
            raise ToolError(f"quotient too large (over {MAX_BITS} bits)")
        return fa / fb
    return _to_float(a) / _to_float(b)


def floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolError("division by zero")
    if _is_exact(a) and _is_exact(b):
        return a // b
    return _to_float(a) // _to_float(b)


def mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise ToolError("modulo by zero")
    if _is_exact(a) and _is_exact(b):
        return a % b
    return _to_float(a) % _to_float(b)


def power(a: Number, b: Number) -> Number:
    if isinstance(b, int) and _is_exact(a):
        if a == 0 and b < 0:
            raise ToolError("division by zero (0 to a negative power)")
        if (_bits(a) - 1) * abs(b) > MAX_BITS:
            raise ToolError(f"power too large (over {MAX_BITS} bits)")
        return Fraction(a) ** b
    base, exponent = _to_float(a), _to_float(b)
    if base == 0 and exponent < 0:
        raise ToolError("division by zero (0 to a negative power)")
    if base < 0 and not exponent.is_integer():
        raise ToolError("a negative number to a fractional power is not a real number")
    try:
        return math.pow(base, exponent)
    except OverflowError:
        raise ToolError("power too large") from None


# --- printing -------------------------------------------------------------------------------


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
