"""A final numeric answer read from a model's reply and compared with the reference."""

from __future__ import annotations

import pytest

from venusrl.envs.numeric_answer import answer_is_correct, final_answer


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("The sum is 2318.\nAnswer: 2318", 2318),
        ("so the total is\nANSWER: 1,234,567.", 1234567),
        ("Answer: $633.39", "633.39"),
        ("the result is \\boxed{\\frac{61857}{764}}", "61857/764"),
        ("Answer: 61857/764", "61857/764"),
        ("Answer: 80.96466", "61857/764"),  # a decimal of a fraction, to 1e-6 relative
        ("Answer: 0.75", "3/4"),
        ("Answer: 3/4", 0.75),
        ("Answer: -12", -12),
        ("Answer: 1e3", 1000),
        ("first Answer: 5, then on reflection\nAnswer: 7", 7),  # the last answer line counts
        ("\\boxed{7} is what I get. Answer: 9", 7),  # a box wins over an answer line
    ],
)
def test_a_final_answer_written_any_common_way_matches_the_reference(
    reply: str, expected: object
) -> None:
    assert answer_is_correct(reply, expected)


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("Answer: 2319", 2318),
        ("Answer: 0.3333", "1/3"),  # a decimal of a fraction must get within 1e-6 of it
        ("The answer is 2318", 2318),  # no final-answer line: no answer
        ("Answer: about two thousand", 2000),
        ("Answer: nan", 0),
        ("Answer: 1/0", 0),
    ],
)
def test_a_wrong_or_missing_final_answer_does_not_match(reply: str, expected: object) -> None:
    assert not answer_is_correct(reply, expected)


def test_a_reference_that_is_not_a_number_is_an_error_not_a_zero() -> None:
    assert final_answer("Answer: 4") == "4"
    with pytest.raises(ValueError, match="not a number"):
        answer_is_correct("Answer: 4", "four")
    with pytest.raises(ValueError, match="a number or a string of one"):
        answer_is_correct("Answer: 4", [4])
