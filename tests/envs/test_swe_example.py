"""The SWE example end to end, as the README runs it: its Debian images built with mmdebstrap,
its task file validated, and `venusrl train` on it, every episode graded in a fresh sandbox of
its task's image. Slow: the Debian root takes about a minute to build the first time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENUSRL = [sys.executable, "-m", "venusrl.cli"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root"),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="apt-get install mmdebstrap"),
]


def test_the_swe_example_builds_validates_and_trains_with_graded_episodes(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "examples/swe/build.py"], cwd=ROOT, check=True, timeout=900)
    checked = subprocess.run(
        [*VENUSRL, "swe", "validate", "examples/swe/tasks.jsonl", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in checked.stdout.splitlines()]
    assert checked.returncode == 0 and len(rows) == 4 and all(r["valid"] for r in rows), rows
    run = tmp_path / "run"
    train = subprocess.run(
        [*VENUSRL, "train", "--config", "examples/swe-agent.yaml", "--run-dir", str(run)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    warm = json.loads((run / "warm_start.json").read_text())
    assert warm["demo_reward_mean"] == 1.0  # the gold fixes, graded resolved in fresh sandboxes
    records = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {0, 1, 2, 3}
    for r in records:  # trained on, graded (0 or 1, never masked), with its diff kept
        assert r["reward"] in (0.0, 1.0) and r["failure"] is None, r["failure"]
        assert isinstance(r["output"], str)
