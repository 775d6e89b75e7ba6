"""Arithmetic on rule values (guards and computed attributes), with bounds.

A rule file is data, so `9 ** 9 ** 9` or `'a' * 4000000000` in a guard must
not hang or fill memory: results larger than these bounds raise
`ArithmeticLimit` instead of being computed. Rules compute shapes, dims and
scales, far below them. A guard that hits a bound is false; a literal
expression that does is an error when the rule loads (rules.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_INT_BITS = 1024
MAX_LENGTH = 10_000  # of a string, list or tuple


class ArithmeticLimit(ValueError):
    """A result beyond MAX_INT_BITS or MAX_LENGTH, or one Python cannot represent."""


def _sized(v: Any) -> bool:
    return isinstance(v, str | tuple | list)


def _check(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
        raise ArithmeticLimit(f"an integer of {v.bit_length()} bits (at most {MAX_INT_BITS})")
    return v


def _bits(v: Any) -> int:
    return abs(int(v)).bit_length() if isinstance(v, int) else 0


def _mul(a: Any, b: Any) -> Any:
    for seq, n in ((a, b), (b, a)):
        if _sized(seq) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_LENGTH:
            raise ArithmeticLimit(f"a sequence of {len(seq)} x {n} items (at most {MAX_LENGTH})")
    if _bits(a) + _bits(b) > MAX_INT_BITS + 1:
        raise ArithmeticLimit(f"a product of about {_bits(a) + _bits(b)} bits "
                              f"(at most {MAX_INT_BITS})")
    return _check(a * b)


def _add(a: Any, b: Any) -> Any:
    if _sized(a) and _sized(b) and len(a) + len(b) > MAX_LENGTH:
        raise ArithmeticLimit(f"a sequence of {len(a) + len(b)} items (at most {MAX_LENGTH})")
    return _check(a + b)


def _pow(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 \
            and b * _bits(a) > MAX_INT_BITS + b:
        raise ArithmeticLimit(f"{a} ** {b} has about {b * (_bits(a) - 1)} bits "
                              f"(at most {MAX_INT_BITS})")
    return _check(a ** b)


def _mod(a: Any, b: Any) -> Any:
    if isinstance(a, str):  # '%...d' % n formats, and may pad to any width
        raise TypeError("% on a string formats it; rules only take remainders")
    return a % b


def _guarded(fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def run(a: Any, b: Any) -> Any:
        try:
            return fn(a, b)
        except (OverflowError, MemoryError) as e:
            raise ArithmeticLimit(str(e) or type(e).__name__) from None
    return run


ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": _guarded(_add),
    "-": _guarded(lambda a, b: _check(a - b)),
    "*": _guarded(_mul),
    "/": _guarded(lambda a, b: a / b),
    "//": _guarded(lambda a, b: a // b),
    "%": _guarded(_mod),
    "**": _guarded(_pow),
}
