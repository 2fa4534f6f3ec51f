"""The reward-worker benchmark runs `venusrl train` both ways and prints what it says it prints.
Slow: four short training runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
]


def test_the_reward_worker_benchmark_prints_both_placements_and_their_ratio() -> None:
    small = ["run.warm_start_episodes=16", "run.warm_start_epochs=1", "rollout.group_size=2",
             "rollout.batch_groups=2"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "benchmarks/reward_workers.py", "--pairs", "1", "--steps", "3",
         "--grade-cpu-s", "0.2", "--admission", "aimd", "--", *small],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=True,
    ).stdout  # fmt: skip
    result = json.loads(out)
    inline, pool = result["inline"][0], result["pool"][0]
    assert result["admission"] == "aimd"
    assert result["step_time_ratio_inline_over_pool"] == [
        round(inline["step_s"] / pool["step_s"], 3)
    ]
    for run in (inline, pool):
        assert run["step_s"] > 0 and 0 <= run["reward_wait_share"] <= 1
        # Each reward burns 0.2 s of CPU in its sandbox before it is in.
        assert run["reward_p50_s"] >= 0.2
