"""The publish benchmark times one trainer process and two FSDP2 ranks putting their weights into
an engine, and the ranks' publish leaves the engine with exactly the trainer's weights."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks import refused, run_benchmark


@pytest.mark.slow  # runs the benchmark
def test_publishing_from_one_process_and_from_two_ranks_is_timed_against_model_size() -> None:
    proc = run_benchmark("publish_weights.py", "--presets", "micro", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    (micro,) = json.loads(proc.stdout)["presets"]
    assert micro["preset"] == "micro" and micro["weight_bytes"] > 0
    assert micro["ranks_weights_equal"] is True
    for name in ("one_process", "two_ranks"):
        assert micro[name]["median_s"] > 0 and micro[name]["gb_per_s"] > 0
    assert micro["ranks_over_one_process"] > 0


def test_an_unknown_preset_is_refused_by_name() -> None:
    code, stderr = refused("publish_weights.py", "--presets", "micro,huge")
    assert code != 0 and "--presets" in stderr and "huge" in stderr
