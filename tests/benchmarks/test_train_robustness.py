"""The robustness benchmark runs the CPU example plain, killed and resumed, with faults, and over
HTTP, and accounts for every step and every failed member."""

from __future__ import annotations

import json
import os

import pytest

from tests.benchmarks import refused, run_benchmark
from tests.runtime import SMALL

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.mark.slow
def test_every_run_completes_its_steps_once_and_no_failed_member_is_scored() -> None:
    proc = run_benchmark(
        "train_robustness.py", "--steps", "4", "--window", "2", *SMALL, "run.checkpoint_every=1"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    runs = out["runs"]
    assert set(runs) == {"plain", "resumed", "faults", "local_from_start", "http_from_start"}
    for run in runs.values():
        assert run["steps"] == 4 and run["steps_consecutive"]
        assert run["failed_scored"] == 0 and run["staleness_max"] <= 1
    assert runs["plain"]["infra_failures"] == 0
    gap = runs["resumed"]["reward_last"] - runs["plain"]["reward_last"]
    assert out["last_gap_resumed_vs_plain"] == round(gap, 3)


def test_steps_that_do_not_hold_two_windows_are_refused() -> None:
    code, stderr = refused("train_robustness.py", "--steps", "5", "--window", "3")
    assert code != 0 and "--steps must hold two windows" in stderr
