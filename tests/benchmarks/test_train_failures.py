"""The failure breakdown names the first departure from binary search of a lost episode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train_failures import classify

from venusrl.envs.builtin.guess_number import BinarySearchExpert, _guess_call


@pytest.mark.parametrize(
    ("turns", "kind", "depth"),
    [
        ([_guess_call(32), _guess_call(48)], "outside_interval", 2),  # "lower" left 1..31
        ([_guess_call(32), _guess_call(20)], "off_midpoint", 2),
        ([_guess_call(32), "<tool_call>\n{oops}\n</tool_call>"], "malformed_call", 2),
        ([_guess_call(32), _guess_call(16) + _guess_call(8)], "malformed_call", 2),
        ([_guess_call(32), "I give up."], "no_guess", 2),
    ],
)
def test_the_first_departure_from_binary_search_is_named(
    turns: list[str], kind: str, depth: int
) -> None:
    assert classify(turns, secret=10) == (kind, depth)


def test_binary_search_itself_has_no_departure() -> None:
    expert = BinarySearchExpert()
    turns = [expert("")]
    while expert.last_guess != 10:
        reply = "higher" if expert.last_guess < 10 else "lower"
        turns.append(expert(f"<tool_response>\n{reply}"))
    assert classify(turns, secret=10)[0] == "no_guess"
