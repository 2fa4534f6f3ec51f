"""A final numeric answer read from a model's text and compared with the reference.

The answer is the last `\\boxed{...}` in the text, else the last `Answer: ...` line. A number may
be written as an integer, a decimal, `3/4`, `\\frac{3}{4}`, with thousands commas, a `$` or a
trailing period; two numbers agree within a relative tolerance (1e-6) or an absolute one (1e-9),
so that 0.3333 is not 1/3 but 0.3333333 is (a decimal to seven places).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

REL_TOL = 1e-6
ABS_TOL = 1e-9

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_ANSWER_LINE = re.compile(r"^\s*\**answer\**\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def final_answer(text: str) -> str | None:
    """The answer the text gives: its last `\\boxed{}`, else its last `Answer:` line."""
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1]).strip()
    lines = _ANSWER_LINE.findall(text)
    return str(lines[-1]) if lines else None


def parse_number(text: str) -> Fraction | float | None:
    """The number `text` writes (exact when it is rational), or None when it writes none."""
    cleaned = text.strip().strip("$").strip().rstrip(".").replace(",", "").replace(" ", "")
    cleaned = cleaned.removeprefix("\\(").removesuffix("\\)")
    frac = _FRAC.match(cleaned)
    if frac:
        numerator, denominator = parse_number(frac.group(1)), parse_number(frac.group(2))
        if numerator is None or not denominator:
            return None
        return Fraction(numerator) / Fraction(denominator)
    try:
        return Fraction(cleaned)  # "12", "-1.5", "3/4", "1e3"
    except (ValueError, ZeroDivisionError):
        pass
    try:
        value = float(cleaned)  # "inf", "nan": no answer to a word problem
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def numbers_agree(given: Fraction | float, expected: Fraction | float) -> bool:
    if isinstance(given, Fraction) and isinstance(expected, Fraction) and given == expected:
        return True
    return math.isclose(float(given), float(expected), rel_tol=REL_TOL, abs_tol=ABS_TOL)


def answer_is_correct(text: str, expected: object) -> bool:
    """Whether `text`'s final answer is the number `expected` (a number, or a string of one)."""
    answer = final_answer(text)
    given = None if answer is None else parse_number(answer)
    if isinstance(expected, bool) or not isinstance(expected, int | float | str):
        raise ValueError(f"a reference answer is a number or a string of one, got {expected!r}")
    reference = parse_number(str(expected)) if isinstance(expected, str) else Fraction(expected)
    if reference is None:
        raise ValueError(f"the reference answer {expected!r} is not a number")
    return given is not None and numbers_agree(given, reference)
