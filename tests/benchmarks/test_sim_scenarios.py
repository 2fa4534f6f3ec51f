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
    # How far each step is above the GPU work its samples need: the largest is the worst.
    headroom = [r[1]["mean_step_s"] / r[1]["work_floor_step_s"] for r in res["runs"].values()]
    assert res["summary"]["venus"]["floor_headroom"]["worst"] == max(headroom) > 1
    table = bench(*common, "--steps", "2", "--markdown")
    assert table.startswith("| scenario | policy |") and "| small | venus |" in table


def test_a_json_out_it_cannot_write_is_refused_before_simulating(tmp_path: Path) -> None:
    out = str(tmp_path / "missing" / "out.json")
    code, stderr = refused("sim_scenarios.py", "--scenarios", "math-python", "--json-out", out)
    assert code == 2 and "--json-out: cannot write" in stderr


def test_unloaded_runs_every_trajectory_alone_at_each_bound_and_reports_the_ceiling(
    tmp_path: Path,
) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    policies = "async@1:1,venus@1:1,venus"
    args = ["--workload", str(workload), "--seeds", "0", "--steps", "3", "--policies", policies]
    res = json.loads(bench(*args, "--unloaded", "--jobs", "1"))["small"]
    runs = {r["policy"]: r for r in res["runs"]["0"]}
    # One unloaded run per bound the policies use (venus's default is 1:4).
    assert list(runs) == [*policies.split(","), "unloaded@1:1", "unloaded@1:4"]
    for name in ("unloaded@1:1", "unloaded@1:4"):
        alone = runs[name]
        # Nothing ever waited for room on an engine: no preemption, eviction or re-prefill.
        assert alone["preemptions"] == alone["evictions"] == alone["reprefill_tokens"] == 0
    ceiling = runs["unloaded@1:1"]["run_speedup_vs_async@1:1"]
    assert ceiling == runs["async@1:1"]["run_s"] / runs["unloaded@1:1"]["run_s"]
    assert res["summary"]["unloaded@1:4"]["run_speedup_vs_venus"]["per_seed"] == [
        runs["venus"]["run_s"] / runs["unloaded@1:4"]["run_s"]
    ]


def test_the_unloaded_scenario_has_an_engine_for_every_trajectory_its_bound_lets_run() -> None:
    from benchmarks.sim_scenarios import unloaded
    from venusrl.sim.policies import sim_policies
    from venusrl.workloads import SCENARIOS

    w = SCENARIOS["swe-long-32b"]
    ((alone, policy),) = unloaded(w, sim_policies("venus@2:3"))
    assert policy.name == "unloaded@2:3"
    assert (policy.max_staleness, policy.max_train_staleness) == (2, 3)
    assert alone.rollout_gpus == 3 * w.prompts_per_batch * w.group_size * w.tp
    assert alone.scaled_for(rollout_gpus=w.rollout_gpus) == w  # nothing else changed


def test_an_unloaded_run_past_the_simulator_s_engine_limit_is_refused_before_simulating(
    tmp_path: Path,
) -> None:
    workload = tmp_path / "wide.yaml"
    workload.write_text("base: swe-short\nprompts_per_batch: 4000\ngroup_size: 16\n")
    args = ["--workload", str(workload), "--policies", "venus", "--unloaded"]
    code, stderr = refused("sim_scenarios.py", *args)
    assert code == 2 and "--unloaded: workload" in stderr and "rollout_gpus must be <=" in stderr


def test_a_cost_constant_set_on_the_command_line_holds_in_every_run_and_is_reported(
    tmp_path: Path,
) -> None:
    workload = tmp_path / "small.yaml"
    workload.write_text(SMALL)
    args = ["--workload", str(workload), "--seeds", "0", "--steps", "2", "--policies", "venus"]
    res = json.loads(bench(*args, "--unloaded", "--cost", "weight_sync_fixed_s=10"))["small"]
    assert res["cost"] == {"weight_sync_fixed_s": 10.0}
    # qwen3-4b's 8 GB of weights at 25 GB/s, after the fixed 10 s (2 s by default)
    for run in res["runs"]["0"]:
        assert run["weight_sync_s_per_step"] == 10.32, run["policy"]


def test_a_bad_cost_constant_is_refused_before_simulating() -> None:
    for cost, error in [
        ("gpu.pcie=1", "--cost: gpu.pcie: not a constant of the cost model; known:"),
        ("gpu.pcie_h2d", "--cost: 'gpu.pcie_h2d' is not KEY=VALUE"),
        ("gpu.pcie_h2d=fast", "--cost: gpu.pcie_h2d: needs a number, got 'fast'"),
        ("gpu.pcie_h2d=0", "--cost: gpu.pcie_h2d: needs a number > 0, got 0.0"),
        ("train_mfu=0.3,train_mfu=0.5", "--cost: train_mfu set twice"),
        ("model.layers=1.5", "--cost: model.layers: needs an integer > 0"),
        ("reserved_bytes=1e12", "--cost: qwen3-4b does not fit 1 x h200"),
    ]:
        code, stderr = refused("sim_scenarios.py", "--scenarios", "math-python", "--cost", cost)
        assert code == 2 and error in stderr, (cost, stderr)
