"""What in-flight weight updates save: step time with `engine.weight_update=keep` (new weights
load between two engine steps; the requests in flight keep their KV and go on, and so does the
KV of trajectories waiting on a tool) against two baselines: `flush` (the same, then every KV no
running request holds is dropped, as vLLM's `reset_prefix_cache` and SGLang's `flush_cache` after
an update: a trajectory between turns computes its context again) and `drain` (the turns in
flight first run to their end, none admitted meanwhile, as engines that cannot update
mid-request do). Printed as JSON, the modes on the same seeds side by side:

- `cpu`: `venusrl train` on the built-in CPU example (its default config, a short warm start),
  once per mode per pair, in turn (each pair starts with another mode); each run's mean step
  time over its steps after the first (which fills the pipeline), and per pair the ratios
  `flush_over_keep`, `drain_over_keep`;
- `sim`: the simulator's `venus` policy on `--scenarios`, seeds `--seeds`, each mode; the same
  ratios per seed with their median and worst, the tokens computed again after losing their
  KV, and the seconds per step the engines waited for turns in flight (`drain_s_per_step`).

A ratio above 1 is the gain of keeping. Absolute times are context: this machine is shared.

    python benchmarks/weight_update.py [--pairs 2] [--steps 8] [--scenarios search-short,swe-short]
        [--seeds 0,1,2] [--sim-steps 4] [--jobs 2] [--skip-cpu] [--skip-sim]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from venusrl.runtime.record import read_metrics  # noqa: E402
from venusrl.sim.executor import simulate  # noqa: E402
from venusrl.sim.policies import sim_policies  # noqa: E402
from venusrl.sim.types import SimConfig  # noqa: E402
from venusrl.workloads import SCENARIOS  # noqa: E402

MODES = ("keep", "flush", "drain")


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


BASELINES = ("flush", "drain")


def ratios(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each baseline's step time over keep's, per row; the median and the worst of them."""
    out: dict[str, Any] = {}
    for b in BASELINES:
        for row in rows:
            row[f"{b}_over_keep"] = row[b]["mean_step_s"] / row["keep"]["mean_step_s"]
        got = [row[f"{b}_over_keep"] for row in rows]
        out[f"{b}_over_keep"] = {"median": statistics.median(got), "worst": min(got)}
    return out


def cpu(pairs: int, steps: int) -> dict[str, Any]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(pairs):
            order = MODES[pair % len(MODES) :] + MODES[: pair % len(MODES)]  # each mode first once
            rows.append({m: train_run(m, steps, Path(tmp) / f"{m}-{pair}") for m in order})
    return {**ratios(rows), "pairs": rows}


def _sim_run(name: str, seed: int, mode: str, steps: int) -> dict[str, Any]:
    config = SimConfig(steps, weight_update=mode)
    r = simulate(SCENARIOS[name], sim_policies("venus"), seed, config)[0]
    keys = ("mean_step_s", "reprefill_evicted_tokens", "drain_s_per_step", "weight_sync_s_per_step")
    return {k: r[k] for k in keys}


def sim(scenarios: list[str], seeds: list[int], steps: int, jobs: int) -> dict[str, Any]:
    """Each (scenario, seed, mode) run in `jobs` processes: each run is deterministic, so the
    figures do not depend on it."""
    runs = [(name, seed, mode) for name in scenarios for seed in seeds for mode in MODES]
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=fork) as pool:
        futures = {run: pool.submit(_sim_run, *run, steps) for run in runs}
        results = {run: f.result() for run, f in futures.items()}
    out: dict[str, Any] = {}
    for name in scenarios:
        rows = [
            {"seed": seed, **{mode: results[name, seed, mode] for mode in MODES}} for seed in seeds
        ]
        out[name] = {**ratios(rows), "seeds": rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scenarios", default="search-short,swe-short")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sim-steps", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2, help="processes for the simulations")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-sim", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if not args.skip_sim:
        seeds = [int(s) for s in args.seeds.split(",")]
        result["sim"] = sim(args.scenarios.split(","), seeds, args.sim_steps, args.jobs)
    if not args.skip_cpu:
        result["cpu"] = cpu(args.pairs, args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
