"""The density benchmark runs its three configurations and reports what it claims to report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~60 s: three pool configurations run for their window each
@pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes need root (namespaces, cgroups)")
def test_density_benchmark_prints_configs_and_ratios_with_no_oom() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "sandbox_density.py"),
            "--duration-s", "6",
            "--budget-gib", "8",
            "--k", "4",
            "--working-set-mb", "20", "40",
            "--think-s", "0.1", "0.3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    configs = out["configs"]
    assert set(configs) == {"quota", "footprint", "footprint+fork"}
    for name, c in configs.items():
        assert c["oom_kills"] == 0, name
        assert c["completed"] > 0 and c["task_failures"] == [], (name, c)
        assert c["gb_seconds_per_completed"] == pytest.approx(
            8 * c["window_s"] / c["completed"], rel=1e-6
        )
    # Quota admits floor(8 GiB / 4 GiB declared) sandboxes at a time, never more.
    assert configs["quota"]["mean_concurrent"] <= 2.0 + 1e-6
    fork = configs["footprint+fork"]
    assert out["density_ratio"] == pytest.approx(
        fork["mean_concurrent"] / configs["quota"]["mean_concurrent"]
    )
    assert out["cost_ratio"] == pytest.approx(
        fork["gb_seconds_per_completed"] / configs["quota"]["gb_seconds_per_completed"]
    )
    assert out["density_ratio"] > 1  # small sandboxes: admission by footprint admits more
