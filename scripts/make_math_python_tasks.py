"""Write `venusrl/envs/builtin/data/math_python.jsonl`: the math_python environment's tasks.

    python scripts/make_math_python_tasks.py [--check]

Word problems that take a bit of computation (sums over ranges, primes, compound interest, exact
fractions, combinatorics), drawn from one seeded generator. Each row has `id`, `question`,
`answer` and `program` (Python that prints the answer: what the demonstrator runs). Every answer
is computed here, then checked against what its program prints when run; `--check` verifies the
shipped file is what this script writes (tests/envs/test_math_python.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "venusrl/envs/builtin/data/math_python.jsonl"
SEED = 20261204
PER_KIND = 10

# (question, program, answer) from a generator: the program is the computation as a model
# would write it, the answer the same computed here, independently of the program's text.
Problem = tuple[str, str, int | str]


def _sum_of_multiples(rng: random.Random) -> Problem:
    a, b = rng.choice([(3, 5), (2, 7), (4, 6), (3, 7)])
    n = rng.randint(200, 2000)
    answer = sum(k for k in range(1, n) if k % a == 0 or k % b == 0)
    question = (
        f"What is the sum of the positive integers below {n} that are multiples of {a} or {b}?"
    )
    program = f"print(sum(k for k in range(1, {n}) if k % {a} == 0 or k % {b} == 0))"
    return question, program, answer


def _count_primes(rng: random.Random) -> Problem:
    lo = rng.randint(100, 2000)
    hi = lo + rng.randint(100, 800)
    answer = sum(all(k % d for d in range(2, math.isqrt(k) + 1)) for k in range(lo, hi + 1))
    question = f"How many prime numbers are there between {lo} and {hi}, inclusive?"
    program = (
        "import math\n"
        f"print(sum(all(k % d for d in range(2, math.isqrt(k) + 1))"
        f" for k in range({lo}, {hi + 1})))"
    )
    return question, program, answer


def _compound_interest(rng: random.Random) -> Problem:
    principal = rng.choice([500, 1000, 2500, 4000, 10000])
    rate = rng.choice([2, 3, 4, 5, 6])
    years = rng.randint(3, 15)
    answer = principal * (1 + rate / 100) ** years
    question = (
        f"A deposit of {principal} dollars earns {rate}% interest per year, compounded yearly."
        f" How many dollars are in the account after {years} years? Round to the cent."
    )
    program = f"print(f'{{{principal} * (1 + {rate} / 100) ** {years}:.2f}}')"
    return question, program, f"{answer:.2f}"


def _fraction_sum(rng: random.Random) -> Problem:
    n = rng.randint(5, 15)
    answer = sum(Fraction(1, k * (k + 1)) for k in range(1, n + 1))
    question = (
        f"What is 1/(1*2) + 1/(2*3) + ... + 1/({n}*{n + 1})? Give the exact value as a fraction."
    )
    program = (
        "from fractions import Fraction\n"
        f"print(sum(Fraction(1, k * (k + 1)) for k in range(1, {n + 1})))"
    )
    return question, program, str(answer)


def _gcd_lcm(rng: random.Random) -> Problem:
    a, b, c = (rng.randint(12, 400) for _ in range(3))
    answer = math.lcm(a, b, c) // math.gcd(a, b, c)
    question = (
        f"Divide the least common multiple of {a}, {b} and {c} by their greatest common"
        " divisor. What is the result?"
    )
    program = f"import math\nprint(math.lcm({a}, {b}, {c}) // math.gcd({a}, {b}, {c}))"
    return question, program, answer


def _combinations(rng: random.Random) -> Problem:
    people = rng.randint(8, 25)
    team = rng.randint(3, 6)
    answer = math.comb(people, team)
    question = f"In how many ways can a team of {team} be chosen from {people} people?"
    program = f"import math\nprint(math.comb({people}, {team}))"
    return question, program, answer


def _digit_sum_factorial(rng: random.Random) -> Problem:
    n = rng.randint(15, 60)
    answer = sum(int(d) for d in str(math.factorial(n)))
    question = f"What is the sum of the digits of {n}! ({n} factorial)?"
    program = f"import math\nprint(sum(int(d) for d in str(math.factorial({n}))))"
    return question, program, answer


def _savings(rng: random.Random) -> Problem:
    start = rng.randint(5, 40)
    step = rng.randint(2, 9)
    weeks = rng.randint(10, 52)
    answer = sum(start + step * w for w in range(weeks))
    question = (
        f"Mia saves {start} dollars in the first week and {step} dollars more each week than"
        f" the week before. How many dollars has she saved after {weeks} weeks?"
    )
    program = f"print(sum({start} + {step} * w for w in range({weeks})))"
    return question, program, answer


def _average_speed(rng: random.Random) -> Problem:
    d1, v1 = rng.randint(30, 200), rng.randint(30, 90)
    d2, v2 = rng.randint(30, 200), rng.randint(30, 90)
    answer = Fraction(d1 + d2) / (Fraction(d1, v1) + Fraction(d2, v2))
    question = (
        f"A car drives {d1} km at {v1} km/h, then {d2} km at {v2} km/h. What is its average"
        " speed over the whole trip in km/h? Give the exact value as a fraction."
    )
    program = (
        "from fractions import Fraction\n"
        f"print(Fraction({d1} + {d2}) / (Fraction({d1}, {v1}) + Fraction({d2}, {v2})))"
    )
    return question, program, str(answer)


def _collatz(rng: random.Random) -> Problem:
    n = rng.randint(20, 3000)
    steps, k = 0, n
    while k != 1:
        k = k // 2 if k % 2 == 0 else 3 * k + 1
        steps += 1
    question = (
        f"Start at {n}. If the number is even, halve it; if it is odd, triple it and add 1."
        " How many steps does it take to reach 1?"
    )
    program = (
        f"k, steps = {n}, 0\n"
        "while k != 1:\n"
        "    k = k // 2 if k % 2 == 0 else 3 * k + 1\n"
        "    steps += 1\n"
        "print(steps)"
    )
    return question, program, steps


KINDS: list[Callable[[random.Random], Problem]] = [
    _sum_of_multiples,
    _count_primes,
    _compound_interest,
    _fraction_sum,
    _gcd_lcm,
    _combinations,
    _digit_sum_factorial,
    _savings,
    _average_speed,
    _collatz,
]


def printed_by(program: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {})
    return out.getvalue().strip()


def rows() -> list[dict[str, object]]:
    """The tasks, each answer checked against what its program prints."""
    rng = random.Random(SEED)
    made: dict[str, dict[str, object]] = {}  # by question: no problem twice
    for kind in KINDS:
        while len(made) < PER_KIND * (KINDS.index(kind) + 1):
            question, program, answer = kind(rng)
            if (printed := printed_by(program)) != str(answer):
                raise AssertionError(f"{kind.__name__}: {program!r} printed {printed}, {answer=}")
            made.setdefault(question, {"question": question, "answer": answer, "program": program})
    rows = list(made.values())
    rng.shuffle(rows)
    return [{"id": f"math-{i:03d}", **row} for i, row in enumerate(rows)]


def render() -> str:
    return "".join(json.dumps(row) + "\n" for row in rows())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped file")
    args = parser.parse_args()
    if args.check:
        same = OUT.read_text() == render()
        print(f"{OUT}: {'up to date' if same else 'differs from what this script writes'}")
        return 0 if same else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
