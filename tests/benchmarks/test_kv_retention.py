"""The KV retention benchmark replays one workload under both policies and reports the figures
issue 5 asks for, with outputs identical across policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks import refused, run_benchmark


@pytest.mark.slow  # the default suite's time: run by scripts/test.sh --slow
def test_trajectory_retention_reprefills_less_than_lru_with_identical_outputs(
    tmp_path: Path,
) -> None:
    args = ["--preset", "micro", "--model-dir", str(tmp_path / "model"), "--groups", "1"]
    args += ["--group-size", "4", "--tool-scale", "0.05", "--layer-residency", "0.3"]
    proc = run_benchmark("kv_retention.py", *args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["outputs_identical"] is True
    lru, ours = out["lru"], out["trajectory"]
    assert lru["host_hit_tokens"] == 0 and lru["offloaded_bytes"] == 0
    assert ours["host_hit_tokens"] > 0 and ours["loaded_bytes"] > 0
    assert ours["reprefill_tokens"] < lru["reprefill_tokens"]
    for res in (lru, ours):  # every turn after the first answers a tool
        assert res["tool_returns"] == out["workload"]["tool_returns"] > 0
    assert out["reprefill_reduction"] == round(
        1 - ours["reprefill_tokens"] / lru["reprefill_tokens"], 3
    )
    assert out["makespan_ratio"] == round(lru["makespan_s"] / ours["makespan_s"], 3)
    layers = out["trajectory_layers"]  # outputs_identical covers this run too
    assert layers["banded_pages"] > 0 and layers["streamed_bytes"] > 0
    assert layers["reprefill_tokens"] <= ours["reprefill_tokens"]
    assert out["layers_makespan_ratio"] == round(ours["makespan_s"] / layers["makespan_s"], 3)


def test_bad_arguments_are_refused_with_the_flag_named() -> None:
    code, stderr = refused("kv_retention.py", "--capacity", "2")
    assert code != 0 and "--capacity" in stderr
    code, stderr = refused("kv_retention.py", "--layer-residency", "1")
    assert code != 0 and "--layer-residency" in stderr
    code, stderr = refused("kv_retention.py", "--preset", "huge", "--model-dir", "/nonexistent/m")
    assert code != 0 and "--preset" in stderr and "Traceback" not in stderr
