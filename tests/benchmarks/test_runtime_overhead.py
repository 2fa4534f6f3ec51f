"""The runtime overhead benchmark runs the same example in both runtimes and reports the ratio."""

from __future__ import annotations

import json
import os

import pytest

from tests.benchmarks import refused, run_benchmark
from tests.runtime import SMALL

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root")


@pytest.mark.slow
def test_it_times_both_runtimes_on_the_same_steps_and_reports_the_overhead() -> None:
    proc = run_benchmark("runtime_overhead.py", "--steps", "5", "--repeats", "1", *SMALL)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    local, ray = out["local"][0], out["ray"][0]
    assert local["steps_run"] == ray["steps_run"] == 5  # --steps wins over the config's
    assert local["step_s"] > 0 and ray["step_s"] > 0
    assert out["overhead_per_step"] == round(ray["step_s"] / local["step_s"] - 1, 3)
    # Both runs play the policy they started from, unless --learning says otherwise.
    assert out["overrides"][0] == "trainer.lr=1e-12"
    # Only the Ray run crosses process boundaries: one call per episode, never one per turn.
    assert "actor_calls" not in local
    calls = ray["actor_calls"]
    assert calls["play"] > 0 and "generate" not in calls


@pytest.mark.slow
def test_a_side_that_fails_is_recorded_with_its_error_and_the_json_is_still_printed() -> None:
    # The Ray side asks for more CPUs than the machine has (refused before any actor starts);
    # the local side ignores runtime.* and runs.
    args = ["--steps", "3", "--skip", "1", "--repeats", "1", *SMALL, "runtime.engine_cpus=1024"]
    proc = run_benchmark("runtime_overhead.py", *args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "needs 1024 CPUs" in out["ray"][0]["error"] and out["local"][0]["steps_run"] == 3
    assert out["overhead_per_step"] is None and out["overhead_per_token"] is None
    # Its progress, on stderr.
    assert "ray run 1 of 1: 3 steps" in proc.stderr and "ray: failed (see the JSON)" in proc.stderr


def test_a_timing_window_with_no_step_is_refused() -> None:
    code, stderr = refused("runtime_overhead.py", "--steps", "2", "--skip", "2")
    assert code != 0 and "--steps > --skip + 1" in stderr
