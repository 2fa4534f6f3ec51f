"""What in-flight weight updates save: step time with `engine.weight_update=keep` (new weights
load between two engine steps, the requests in flight keep their KV and go on) against `drain`
(the turns in flight first run to their end, none admitted meanwhile, as engines that cannot
update mid-request do). Printed as JSON, both modes on the same seeds side by side:

- `cpu`: `venusrl train` on the built-in CPU example (its default config, a short warm start),
  once per mode per pair, A B A B; each run's mean step time over its steps after the first
  (which fills the pipeline), the ratio drain / keep pair by pair, and the most weight versions
  one trajectory spans (above 1 under both: a trajectory's later turns start after a publish);
- `sim`: the simulator's `venus` policy on `--scenarios`, seeds `--seeds`, both modes; the ratio
  of mean step times drain / keep per seed, its median and worst, and the seconds per step the
  engines waited for turns in flight (`drain_s_per_step`).

A ratio above 1 is the gain of keeping. Absolute times are context: this machine is shared.

    python benchmarks/weight_update.py [--pairs 2] [--steps 8] [--scenarios search-short,swe-short]
        [--seeds 0,1,2] [--sim-steps 4] [--skip-cpu] [--skip-sim]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.runtime.record import read_metrics  # noqa: E402
from venusrl.sim.executor import sim_policies, simulate  # noqa: E402
from venusrl.sim.types import SimConfig  # noqa: E402
from venusrl.workloads import SCENARIOS  # noqa: E402

MODES = ("keep", "drain")


def train_run(mode: str, steps: int, run_dir: Path) -> dict[str, Any]:
    overrides = [
        f"run.steps={steps}",
        "run.warm_start_episodes=64",
        "run.warm_start_epochs=3",
        f"engine.weight_update={mode}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "venusrl.cli", "train", "--run-dir", str(run_dir), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"venusrl train ({mode}) failed:\n{done.stderr[-3000:]}")
    metrics = read_metrics(run_dir)
    walls = [m["wall_s"] for m in metrics]
    step_s = [b - a for a, b in itertools.pairwise(walls)]  # after the first step
    return {
        "mean_step_s": statistics.fmean(step_s),
        "versions_per_trajectory_max": max(m["versions_per_trajectory_max"] for m in metrics),
    }


def cpu(pairs: int, steps: int) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            runs = {mode: train_run(mode, steps, Path(tmp) / f"{mode}-{pair}") for mode in MODES}
            runs["drain_over_keep"] = runs["drain"]["mean_step_s"] / runs["keep"]["mean_step_s"]
            rows.append(runs)
    ratios = [r["drain_over_keep"] for r in rows]
    return {"pairs": rows, "median": statistics.median(ratios), "worst": min(ratios)}


def sim(scenarios: list[str], seeds: list[int], steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    policy = sim_policies("venus")
    for name in scenarios:
        per_seed = {}
        for seed in seeds:
            runs = {
                mode: simulate(SCENARIOS[name], policy, seed, SimConfig(steps, weight_update=mode))[
                    0
                ]
                for mode in MODES
            }
            per_seed[seed] = {
                "keep_step_s": runs["keep"]["mean_step_s"],
                "drain_step_s": runs["drain"]["mean_step_s"],
                "drain_s_per_step": runs["drain"]["drain_s_per_step"],
                "drain_over_keep": runs["drain"]["mean_step_s"] / runs["keep"]["mean_step_s"],
            }
        ratios = [r["drain_over_keep"] for r in per_seed.values()]
        out[name] = {
            "seeds": per_seed,
            "median": statistics.median(ratios),
            "worst": min(ratios),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scenarios", default="search-short,swe-short")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sim-steps", type=int, default=4)
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if not args.skip_sim:
        seeds = [int(s) for s in args.seeds.split(",")]
        result["sim"] = sim(args.scenarios.split(","), seeds, args.sim_steps)
    if not args.skip_cpu:
        result["cpu"] = cpu(args.pairs, args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
