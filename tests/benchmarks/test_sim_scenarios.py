"""The scenario table benchmark runs end to end and reports what it claims to report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.benchmarks import refused
from tests.sim.test_cli import SMALL

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sim_scenarios.py"), *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_it_prints_every_policy_per_seed_with_sources_medians_and_worst(tmp_path: Path) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    common = ["--workload", str(workload), "--seeds", "0,1", "--policies", "sync,venus"]
    out = json.loads(bench(*common, "--steps", "3"))
    res = out["small"]
    assert res["workload"]["group_size"] == 4 and "sources" in res["workload"]
    assert set(res["runs"]) == {"0", "1"}
    per_seed = [res["runs"][s][1]["speedup_vs_sync"] for s in ("0", "1")]
    assert res["summary"]["venus"]["speedup_vs_sync"] == {
        "per_seed": per_seed,
        "median": sum(per_seed) / 2,
        "worst": min(per_seed),
    }
    assert res["summary"]["sync"]["mean_step_s"]["worst"] == max(
        res["runs"][s][0]["mean_step_s"] for s in ("0", "1")
    )
    table = bench(*common, "--steps", "2", "--markdown")
    assert table.startswith("| scenario | policy |") and "| small | venus |" in table


def test_a_json_out_it_cannot_write_is_refused_before_simulating(tmp_path: Path) -> None:
    out = str(tmp_path / "missing" / "out.json")
    code, stderr = refused("sim_scenarios.py", "--scenarios", "math-python", "--json-out", out)
    assert code == 2 and "--json-out: cannot write" in stderr
