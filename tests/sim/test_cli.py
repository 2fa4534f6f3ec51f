"""`venusrl sim` from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from venusrl import cli

SMALL = """\
base: swe-short
rollout_gpus: 2
train_gpus: 2
prompts_per_batch: 4
group_size: 4
turns: {kind: lognormal, prompt_median: {lognormal: {median: 8, sigma: 0.35}}, sigma: 0.35}
"""


def sim(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "venusrl.cli", "sim", *args], capture_output=True, text=True
    )


def test_sim_prints_one_json_object_with_speedups_per_policy(tmp_path: Path) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    proc = sim("--workload", str(workload), "--policies", "sync,venus", "--steps", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["workload"] == "small" and out["seeds"] == [0]
    sync, ours = out["runs"]["0"]
    assert ours["policy"] == "venus" and ours["steps"] == 3
    assert ours["speedup_vs_sync"] == sync["mean_step_s"] / ours["mean_step_s"]
    assert ours["knobs"]["priorities"] == "critical"  # the knobs are printed with the results
    # Asking the scheduler at every iteration gives the same steps, with more decisions.
    args = ("--policies", "sync,venus", "--steps", "3", "--decide-every-iteration", "--json")
    decided = json.loads(sim("--workload", str(workload), *args).stdout)["runs"]["0"]
    assert [r["mean_step_s"] for r in decided] == [sync["mean_step_s"], ours["mean_step_s"]]
    assert decided[1]["decisions"] > ours["decisions"]
    proc = sim(
        "--workload", str(workload), "--policies", "async@2,venus@2", "--steps", "2", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    baseline, ours = json.loads(proc.stdout)["runs"]["0"]
    assert ours["policy"] == "venus@2" and ours["knobs"]["max_staleness"] == 2
    assert baseline["knobs"]["max_staleness"] == 2 and "speedup_vs_async@2" in ours
    table = sim(
        "--workload", str(workload), "--policies", "sync,venus", "--steps", "2", "--jobs", "1"
    )
    assert table.returncode == 0 and "speedup_vs_sync" in table.stdout


def test_sim_takes_a_policy_s_knobs_and_cost_constants_from_the_command_line(
    tmp_path: Path,
) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    args = ("--policies", "venus,venus[migrate=false]", "--steps", "2", "--json")
    proc = sim("--workload", str(workload), *args, "--cost", "weight_sync_fixed_s=10")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cost"] == {"weight_sync_fixed_s": 10.0}
    ours, unmoved = out["runs"]["0"]
    assert unmoved["policy"] == "venus[migrate=false]"
    assert unmoved["knobs"]["admission"]["migrate"] is False and unmoved["migrations"] == 0
    # qwen3-4b's 8 GB of weights at 25 GB/s after the fixed 10 s
    assert ours["weight_sync_s_per_step"] == unmoved["weight_sync_s_per_step"] == 10.32


def test_sim_over_several_seeds_prints_each_seed_the_median_and_the_worst(tmp_path: Path) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    args = ("--policies", "async,async+offload", "--steps", "2", "--seeds", "0,1,2")
    out = json.loads(sim("--workload", str(workload), *args, "--json").stdout)
    assert out["seeds"] == [0, 1, 2] and set(out["runs"]) == {"0", "1", "2"}
    steps = [out["runs"][s][1]["mean_step_s"] for s in ("0", "1", "2")]
    speedups = [out["runs"][s][1]["speedup_vs_async"] for s in ("0", "1", "2")]
    row = out["summary"]["async+offload"]
    assert row["mean_step_s"] == {
        "per_seed": steps,
        "median": sorted(steps)[1],
        "worst": max(steps),
    }
    assert row["speedup_vs_async"]["worst"] == min(speedups)
    assert row["speedup_vs_async"]["median"] == sorted(speedups)[1]
    table = sim("--workload", str(workload), *args).stdout
    assert "seed 2" in table and "median (worst)" in table


def test_sim_names_a_bad_policy_scenario_or_job_count(capsys: pytest.CaptureFixture[str]) -> None:
    # In the test's process: each refusal comes before any work.
    def refused(*args: str) -> str:
        assert cli.main(["sim", *args]) == 2
        return capsys.readouterr().err

    err = refused("--scenario", "swe-longg")
    assert "swe-longg" in err and "swe-long" in err
    assert "fastest" in refused("--scenario", "swe-long", "--policies", "sync,fastest")
    err = refused("--scenario", "swe-long", "--policies", "venus@two")
    assert "venus@two" in err and "staleness bound" in err
    assert "--jobs must be >= 1, got 0" in refused("--scenario", "swe-long", "--jobs", "0")
    assert "listed twice" in refused("--scenario", "swe-long", "--seeds", "1,1")
    assert "--cost: 'pcie' is not KEY=VALUE" in refused("--scenario", "swe-long", "--cost", "pcie")
    err = refused("--scenario", "swe-long", "--policies", "venus[lane=3]")
    assert "venus[lane=3]" in err and "lane must be in (0, 1]" in err


def test_ctrl_c_ends_a_simulation_with_one_line_and_no_traceback() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "venusrl.cli", "sim", "--scenario", "swe-long", "--steps", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's Ctrl-C reaches
        # As from a terminal: a shell running the tests in the background ignores SIGINT, and a
        # process inherits that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Once the policies' worker processes run, the command is past its imports and simulating.
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "venusrl sim: interrupted"
    assert "Traceback" not in err
