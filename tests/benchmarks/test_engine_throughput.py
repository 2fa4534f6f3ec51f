"""The throughput benchmark runs end to end and reports what it claims to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the default suite's time: run by scripts/test.sh --slow
def test_benchmark_prints_one_json_object_with_ratios_and_agreement(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "engine_throughput.py"),
            "--engines",
            "venusrl,hf",
            "--groups",
            "2",
            "--group-size",
            "4",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--model-dir",
            str(tmp_path / "model"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(proc.stdout)
    assert set(report["engines"]) == {"venusrl", "hf"}
    ours = report["engines"]["venusrl"]
    assert ours["generated_tokens"] == report["workload"]["output_tokens_total"]
    assert report["speedup_vs_hf"] > 0
    # Same greedy tokens as the reference: the speed does not come from doing other work.
    assert report["greedy_agreement_with_hf"] == 1.0
    # Each group of 4 computes its prompt once: 3 of 4 siblings read it from the cache.
    assert 0.6 < report["prefix_hit_ratio"] <= 0.75
