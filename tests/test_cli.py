"""What `venusrl train` shows on its console."""

from __future__ import annotations

import io
from typing import Any

from venusrl import cli


def line(step: int, wall_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "reward_mean": 0.25,
        "tool_calls_mean": 3.0,
        "staleness_mean": 0.5,
        "tokens": 100,
        "sandboxes_running": 4,
        "infra_failures": 0,
        "wall_s": wall_s,
        "since_last_step": {"infra_failures": 0, "env_failures": 0, "groups_dropped": 0},
        **extra,
    }


def test_the_console_shows_the_step_of_the_run_and_when_it_will_end() -> None:
    shown: list[str] = []
    show = cli._StepLine(20, shown.append)
    for step in range(5):
        show(line(step, wall_s=10.0 * (step + 1)))
    assert shown[0].startswith("step 1/20 ") and shown[0].endswith("ETA -")
    # 10 s a step, 15 steps left.
    assert shown[-1].startswith("step 5/20 ") and shown[-1].endswith("ETA 3 min")
    for step in range(5, 19):
        show(line(step, wall_s=10.0 * (step + 1) + 5.0 * (step - 4)))  # 15 s a step from here
    assert shown[-1].endswith("ETA 15 s")  # at the pace of the last ten steps, one left
    show(line(19, wall_s=200.0))
    assert shown[-1].endswith("ETA 0 s")


def test_the_console_counts_failures_of_dropped_groups_since_the_last_step() -> None:
    shown: list[str] = []
    failed = {"infra_failures": 5, "env_failures": 5, "groups_dropped": 2}
    # The batch's own groups had no failure: the dropped groups' are what the step line shows.
    cli._StepLine(3, shown.append)(line(0, 10.0, since_last_step=failed))
    assert "infra 5  dropped 2" in shown[0]
    cli._StepLine(3, shown.append)(line(0, 10.0))
    assert "infra 0 " in shown[1] and "dropped" not in shown[1]


def test_a_console_written_to_a_log_file_keeps_long_lines_whole() -> None:
    log = io.StringIO()
    long = "step 1/150  " + "reward 0.123  " * 20
    cli._console(log).print(long)
    assert log.getvalue() == long + "\n"
