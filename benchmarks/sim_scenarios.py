"""Every scenario x policy in the simulator, over several seeds: the table of BENCHMARKS.md.

Runs `venusrl.sim` (the real policies on virtual time, WORKLOADS.md's cost model and workloads)
for each scenario, seed and policy, side by side on the same seeded workload, and prints one JSON
object: per scenario the workload's parameters and their sources, per seed each policy's figures
(with its knobs and `speedup_vs_<policy>`), and per policy the mean step time and the smallest and
largest speedup over the seeds. `--markdown` prints the table instead.

    python benchmarks/sim_scenarios.py [--scenarios swe-short,search-short] [--seeds 0,1,2]
                                       [--policies sync,async,concur,venus] [--steps 4]
                                       [--markdown] [--json-out FILE] [--workload FILE]

A policy NAME@N runs with a staleness bound of N versions (`--policies async@2,venus@2`).

Simulated time is not wall time: a full `swe-long` run takes minutes of this machine per policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

from venusrl.sim.executor import SimConfig, SimPolicy, sim_policies, simulate
from venusrl.workloads import SCENARIOS, Workload, load_workload

FIGURES = (
    "mean_step_s",
    "gpu_busy",
    "reprefill_tokens",
    "group_completion_p99_s",
    "staleness_mean",
    "train_s_per_step",
)


def run_scenario(
    workload: Workload, seeds: list[int], policies: list[SimPolicy], steps: int
) -> dict[str, Any]:
    started = time.monotonic()
    runs = {seed: simulate(workload, policies, seed, SimConfig(steps=steps)) for seed in seeds}
    names = [p.name for p in policies]
    summary: dict[str, Any] = {}
    for i, name in enumerate(names):
        per_seed = [runs[s][i] for s in seeds]
        row: dict[str, Any] = {
            f: statistics.fmean(r[f] for r in per_seed if r[f] is not None) for f in FIGURES
        }
        row["rollout_gpu_time"] = {
            k: statistics.fmean(r["rollout_gpu_time"][k] for r in per_seed)
            for k in per_seed[0]["rollout_gpu_time"]
        }
        for other in names:
            key = f"speedup_vs_{other}"
            values = [r[key] for r in per_seed if key in r]
            if values:
                row[key] = {"min": min(values), "max": max(values)}
        summary[name] = row
    params = {
        k: (repr(v) if not isinstance(v, int | float | str | dict) else v)
        for k, v in dataclasses.asdict(workload).items()
    }
    return {
        "workload": params,
        "wall_s": round(time.monotonic() - started, 1),
        "summary": summary,
        "runs": {str(s): r for s, r in runs.items()},
    }


def markdown(results: dict[str, Any], policies: list[str]) -> str:
    speedups = [f"vs {p}" for p in policies]
    head = ["scenario", "policy", "step (s)", "GPU busy", "re-prefill tokens",
            "GPU time re-prefilling", "GPU idle", "train (s/step)", "group p99 (s)", "staleness",
            *speedups]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario, res in results.items():
        for name in policies:
            row = res["summary"][name]
            cells = [
                scenario,
                name,
                f"{row['mean_step_s']:.0f}",
                f"{row['gpu_busy']:.0%}",
                f"{row['reprefill_tokens']:.3g}",
                f"{row['rollout_gpu_time']['reprefill']:.0%}",
                f"{row['rollout_gpu_time']['idle']:.0%}",
                f"{row['train_s_per_step']:.0f}",
                f"{row['group_completion_p99_s']:.0f}",
                f"{row['staleness_mean']:.2f}",
            ]
            for other in policies:
                s = row.get(f"speedup_vs_{other}")
                cells.append(f"{s['min']:.2f}-{s['max']:.2f}x" if s else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--scenarios", default="swe-short,search-short,math-python")
    p.add_argument("--workload", help="a workload YAML file instead of the scenarios")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--policies", default="sync,async,concur,venus")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--json-out", help="also write the JSON object to this file")
    args = p.parse_args()
    try:
        policies = sim_policies(args.policies)
    except ValueError as e:
        p.error(f"--policies: {e}")
    unknown = [n for n in args.scenarios.split(",") if n not in SCENARIOS]
    if unknown and not args.workload:
        p.error(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    if args.json_out:
        try:  # fail now, not after an hour of simulation
            open(args.json_out, "a").close()
        except OSError as e:
            p.error(f"--json-out: cannot write {args.json_out}: {e.strerror}")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds: comma-separated integers, got {args.seeds!r}")
    if len(set(seeds)) < len(seeds):
        p.error(f"--seeds: a seed listed twice in {args.seeds!r} would count its run twice")
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step only fills the pipeline)")
    try:
        workloads = (
            [load_workload(args.workload)]
            if args.workload
            else [SCENARIOS[name] for name in args.scenarios.split(",")]
        )
    except (ValueError, OSError) as e:
        p.error(f"--workload: {e}")
    results = {w.name: run_scenario(w, seeds, policies, args.steps) for w in workloads}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f)
    print(markdown(results, [p.name for p in policies]) if args.markdown else json.dumps(results))


if __name__ == "__main__":
    main()
